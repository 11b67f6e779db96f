"""``python -m aioshmcache demo serve``: the example gateway (:mod:`.app`) under uvicorn.

One process (the default): the app's lifespan creates the cache and starts its own engine
worker. ``--gateway-workers N``: uvicorn runs N gateway processes (spawned), each the writer of
its own shard of one cache group, and this process starts the group's one engine worker
(:func:`.app.group_engine_main`) beside them, as examples/README.md says to. Either way the
listening socket is bound here first (port 0 picks a free one) and the first line on stdout is
``listening on URL``; SIGINT or SIGTERM stops uvicorn (each lifespan unlinks its segment), then
the engine worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Literal

__all__ = ["APP", "serve"]

#: the app uvicorn imports in every gateway process
APP = "aioshmcache.tools.demo.app:app"


def serve(
    *,
    host: str,
    port: int,
    gateway_workers: int,
    name: str | None,
    cache_mb: float,
    max_object_mb: float,
    cache: bool,
    loop: Literal["auto", "asyncio", "uvloop"],
    log_level: str,
) -> int:
    """Serve until SIGINT / SIGTERM; returns the exit code."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    env = {
        "AIOSHM_EXAMPLE_CACHE_MB": str(cache_mb),
        "AIOSHM_EXAMPLE_MAX_OBJECT_MB": str(max_object_mb),
        "AIOSHM_EXAMPLE_CACHE": "on" if cache else "off",
    }
    sock_dir = tempfile.mkdtemp(prefix="aioshm-demo-")
    engine: multiprocessing.process.BaseProcess | None = None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(2048)
        if gateway_workers > 1:
            from .app import group_engine_main

            group = name or f"demo-{os.getpid()}"
            engine_sock = os.path.join(sock_dir, "engine.sock")
            env |= {"AIOSHM_GROUP": group, "AIOSHM_ENGINE_SOCKET": engine_sock}
            engine = multiprocessing.get_context("spawn").Process(
                target=group_engine_main, args=(group, engine_sock), name="aioshm-demo-engine"
            )
            engine.start()
        elif name:
            env["AIOSHM_EXAMPLE_NAME"] = name
        os.environ.update(env)  # read by every gateway process's lifespan
        bound_host, bound_port = listener.getsockname()[:2]
        print(f"listening on http://{bound_host}:{bound_port}", flush=True)
        config = uvicorn.Config(
            APP,
            workers=gateway_workers,
            loop="asyncio" if loop == "asyncio" else loop,
            log_level=log_level,
            timeout_graceful_shutdown=10,
        )
        # uvicorn shuts down gracefully on SIGTERM and then raises it again, to exit as if
        # killed by it: this handler makes that second one a clean exit (code 0) instead
        signal.signal(signal.SIGTERM, _exit_cleanly)
        if gateway_workers > 1:
            with contextlib.suppress(KeyboardInterrupt):
                Multiprocess(config, sockets=[listener]).run()
            return 0
        server = uvicorn.Server(config)
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[listener])
        return 0 if server.started else 3  # 3: the lifespan failed (uvicorn logged why)
    finally:
        listener.close()
        if engine is not None:  # after the gateways: they release their hand-outs first
            if engine.is_alive() and engine.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(engine.pid, signal.SIGTERM)
            engine.join(15.0)
            if engine.is_alive():
                engine.kill()
                engine.join(5.0)
        shutil.rmtree(sock_dir, ignore_errors=True)
        sys.stdout.flush()


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)

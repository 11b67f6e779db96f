"""``python -m aioshmcache demo serve``: the example gateway (:mod:`.app`) under uvicorn.

Alone, the app's lifespan starts its own engine worker; with ``--gateway-workers N`` uvicorn runs
N gateway processes, each the writer of its own shard of one cache group, and this process starts
the group's one engine worker (:func:`.app.group_engine_main`) beside them. The socket is bound
here first; the first line on stdout is ``listening on URL``. SIGINT or SIGTERM stops uvicorn
(each lifespan unlinks its segment), then the engine worker.
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

from .cli import ServeOptions

__all__ = ["APP", "serve"]

#: the app uvicorn imports in every gateway process
APP = "aioshmcache.tools.demo.app:app"


def serve(opts: ServeOptions) -> int:
    """Serve until SIGINT / SIGTERM; returns the exit code."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    workers = opts.gateway_workers

    env = {
        "AIOSHM_EXAMPLE_CACHE_MB": str(opts.cache_mb),
        "AIOSHM_EXAMPLE_MAX_OBJECT_MB": str(opts.max_object_mb),
        "AIOSHM_EXAMPLE_CACHE": "on" if opts.cache else "off",
    }
    sock_dir = tempfile.mkdtemp(prefix="aioshm-demo-")
    engine: multiprocessing.process.BaseProcess | None = None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((opts.host, opts.port))
        listener.listen(2048)
        if workers > 1:
            from .app import group_engine_main

            group = opts.name or f"demo-{os.getpid()}"
            engine_sock = os.path.join(sock_dir, "engine.sock")
            env |= {"AIOSHM_GROUP": group, "AIOSHM_ENGINE_SOCKET": engine_sock}
            engine = multiprocessing.get_context("spawn").Process(
                target=group_engine_main, args=(group, engine_sock), name="aioshm-demo-engine"
            )
            engine.start()
        elif opts.name:
            env["AIOSHM_EXAMPLE_NAME"] = opts.name
        os.environ.update(env)  # read by every gateway process's lifespan
        bound_host, bound_port = listener.getsockname()[:2]
        print(f"listening on http://{bound_host}:{bound_port}", flush=True)
        config = uvicorn.Config(
            APP,
            workers=workers,
            loop=opts.loop,
            log_level=opts.log_level,
            timeout_graceful_shutdown=10,
            # the supervisor pings each gateway process and replaces one that does not answer
            # in time (5 s by default): on a loaded 2-core host a process still importing or
            # busy with a burst answers late, and replacing it throws its shard away
            timeout_worker_healthcheck=60,
        )
        # uvicorn shuts down gracefully on SIGTERM and then raises it again, to exit as if
        # killed by it: this handler makes that second one a clean exit (code 0) instead
        signal.signal(signal.SIGTERM, _exit_cleanly)
        if workers > 1:
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

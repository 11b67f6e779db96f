"""``python -m aioshmcache demo``: the example gateway under uvicorn, its engine worker, a load run.

``serve`` runs the example app (:mod:`.app`, which ``examples/fastapi_app.py`` imports) under
uvicorn with its engine worker; ``run`` (the default, :mod:`.load`) starts ``serve`` in a
subprocess, drives a verified load at it and prints a table (examples/README.md, "The
one-command tour"). The options are dataclasses whose fields generate the argparse flags (a
field's metadata holds its help), so that the two commands agree on the gateway's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Final, TypeVar

__all__ = ["INSTALL_HINT", "DemoOptions", "ServeOptions", "main", "serve"]

#: what each subcommand imports, of the ``examples`` extra (import name = distribution name)
_NEEDS: Final = {"run": ("httpx", "fastapi", "uvicorn", "uvloop"), "serve": ("fastapi", "uvicorn")}
INSTALL_HINT: Final = "pip install -e '.[examples]' in a clone of aioshmcache"


def main(argv: list[str]) -> int:
    """Entry point of ``python -m aioshmcache demo ...``; returns the exit code."""
    command = argv[0] if argv and argv[0] in _NEEDS else "run"
    args = argv[1:] if argv and argv[0] == command else list(argv)
    try:
        for name in _NEEDS[command]:
            importlib.import_module(name)
    except ImportError as exc:  # the first one missing (or a package it needs)
        print(
            f"python -m aioshmcache demo needs the 'examples' extra, and {exc.name} is not "
            f"installed. Install it with:\n\n    {INSTALL_HINT}\n",
            file=sys.stderr,
        )
        return 1
    if command == "serve":
        opts = parse(ServeOptions, args, "python -m aioshmcache demo serve")
        if opts.name is not None and opts.gateway_workers == 1 and _has_live_writer(opts.name):
            print(
                f"python -m aioshmcache demo serve: cache {opts.name!r} already has a live writer "
                "(another gateway?); stop it or pick another --name",
                file=sys.stderr,
            )
            return 2
        return serve(opts)
    from .load import run_demo

    return run_demo(parse(DemoOptions, args, "python -m aioshmcache demo"))


T = TypeVar("T")
LOOPS = ("auto", "asyncio", "uvloop")
GATEWAY_WORKERS = (
    "N uvicorn gateway processes (spawned), each the writer of its own shard of one cache group, "
    "and one engine worker for the group (default 1: one process, one cache, its engine worker)"
)
#: the app uvicorn imports in every gateway process
APP = "aioshmcache.tools.demo.app:app"


#: uvicorn's log levels (``uvicorn.config.LOG_LEVELS``)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _opt(default: Any, help: str, **flag: Any) -> Any:
    """A field with its flag: ``help``, and ``flag=`` / ``min=`` / ``max=`` / any
    ``add_argument`` option."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


@dataclass
class GatewayOptions:
    """The flags that run and serve share: how the gateway runs."""

    gateway_workers: int = _opt(1, GATEWAY_WORKERS, metavar="N", min=1)
    cache_mb: float = _opt(256.0, "cache size in MiB (%(default)g)")
    #: a 576x576 image is 3.8 MiB once preprocessed: 8 MiB caches every image of the load
    max_object_mb: float = _opt(8.0, "largest cached item in MiB, else inline (%(default)g)")
    loop: str = _opt("auto", "gateway event loop (%(default)s: uvloop if installed)", choices=LOOPS)

    def gateway_name(self) -> str | None:
        """The name the gateway's cache is given (``serve --name``); ``None``: made up."""
        return None

    def check(self) -> str | None:
        """Why the gateway could not start with these options (a usage error), or ``None``.

        The gateway's ``CacheConfig`` is built here, as each gateway process builds it, so that
        a size or a name it refuses is one line and exit status 2, not a traceback in a gateway
        process."""
        from aioshmcache import CacheConfig

        for flag, mb in (("--cache-mb", self.cache_mb), ("--max-object-mb", self.max_object_mb)):
            if not (math.isfinite(mb) and mb > 0):
                return f"{flag} must be a positive number of MiB, got {mb:g}"
        name = self.gateway_name()
        group = name if self.gateway_workers > 1 else None
        try:
            CacheConfig.from_gb(
                self.cache_mb / 1024,
                self.max_object_mb,
                n_readers=1,
                name=None if group else name,
                group=group,
            )
        except ValueError as exc:
            return str(exc)
        return None


@dataclass
class DemoOptions(GatewayOptions):
    """Start the example gateway (examples/fastapi_app.py) under uvicorn on 127.0.0.1, drive a
    Zipf-distributed image load at it, verify every answer against a local computation, and print
    a table (cache on vs off)."""

    requests: int = _opt(300, "requests per phase (%(default)s)", min=1)
    concurrency: int = _opt(20, "concurrent clients (%(default)s)", min=1)
    images: int = _opt(64, "distinct images (%(default)s)", min=1)
    zipf: float = _opt(1.1, "Zipf exponent of image popularity")
    seed: int = _opt(0, "seed of the images and the request plan")
    compare: bool = _opt(True, "skip the cache-off phase", flag="--no-compare")
    hash_first: float = _opt(
        0.2, "share of repeat requests sending the hash first (%(default)s)", min=0, max=1
    )
    quick: bool = _opt(False, "a short CI run (< 20 s)")
    json_path: str | None = _opt(None, "write the results as JSON", flag="--json", metavar="PATH")

    def __post_init__(self) -> None:
        if self.quick:
            self.requests = min(self.requests, 60)
            self.concurrency = min(self.concurrency, 8)
            self.images = min(self.images, 12)


@dataclass
class ServeOptions(GatewayOptions):
    """Run the example gateway (examples/fastapi_app.py) under uvicorn, with its engine worker."""

    host: str = _opt("127.0.0.1", "address to listen on (%(default)s)")
    port: int = _opt(0, "0 picks a free port (default)", min=0, max=65535)
    name: str | None = _opt(None, "segment name, or the group's with --gateway-workers")
    cache: bool = _opt(True, "bypass the cache: always inline", flag="--no-cache")
    log_level: str = _opt("warning", "uvicorn's log level (%(default)s)", choices=LOG_LEVELS)

    def gateway_name(self) -> str | None:
        return self.name or None  # serve: an empty --name is a made-up one


def parse(cls: type[T], argv: list[str], prog: str) -> T:
    """``cls`` from ``argv``: a flag per field; the class's docstring describes the command."""
    p = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    limits: dict[str, tuple[float | None, float | None]] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        meta = dict(f.metadata)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        if "min" in meta or "max" in meta:
            limits[f.name] = (meta.pop("min", None), meta.pop("max", None))
        if isinstance(f.default, bool):
            action = "store_false" if f.default else "store_true"
            p.add_argument(flag, dest=f.name, action=action, **meta)
        else:
            kind = str if f.default is None else type(f.default)
            p.add_argument(flag, dest=f.name, type=kind, default=f.default, **meta)
    ns = p.parse_args(argv)
    for name, (least, most) in limits.items():
        value, flag = getattr(ns, name), f"--{name.replace('_', '-')}"
        if least is not None and not value >= least:  # not >=: a NaN is refused too
            p.error(f"{flag} must be >= {least}")
        if most is not None and not value <= most:
            p.error(f"{flag} must be <= {most}")
    opts = cls(**vars(ns))
    check = getattr(opts, "check", None)
    if check is not None and (problem := check()) is not None:
        p.error(problem)
    return opts


def _has_live_writer(name: str) -> bool:
    """Whether segment ``name`` exists with a live writer (checked before anything is bound).

    Read from shared memory, without taking a reader slot; a segment whose writer died is not in
    the way (the gateway's cache reclaims it).
    """
    from aioshmcache import ShmCacheError
    from aioshmcache._inspect import read_snapshot

    try:
        return read_snapshot(name)[1]
    except (ShmCacheError, OSError, ValueError):
        return False  # no such segment, or not a segment of ours


def serve(opts: ServeOptions) -> int:
    """Serve until SIGINT / SIGTERM; returns the exit code.

    Alone, the app's lifespan starts its own engine worker; with ``--gateway-workers N`` uvicorn
    runs N gateway processes, each the writer of its own shard of one cache group, and this
    process starts the group's one engine worker (:func:`.app.group_engine_main`) beside them.
    The socket is bound here first; the first line on stdout is ``listening on URL``. SIGINT or
    SIGTERM stops uvicorn (each lifespan unlinks its segment), then the engine worker.
    """
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    workers = opts.gateway_workers
    config = uvicorn.Config(
        APP,
        host=opts.host,
        port=opts.port,
        workers=workers,
        loop=opts.loop,
        log_level=opts.log_level,
        timeout_graceful_shutdown=10,
        # the supervisor pings each gateway process and replaces one that does not answer
        # in time (5 s by default): on a loaded 2-core host a process still importing or
        # busy with a burst answers late, and replacing it throws its shard away
        timeout_worker_healthcheck=60,
    )
    listener = config.bind_socket()  # port 0: a free one, read back below
    env = {
        "AIOSHM_EXAMPLE_CACHE_MB": str(opts.cache_mb),
        "AIOSHM_EXAMPLE_MAX_OBJECT_MB": str(opts.max_object_mb),
        "AIOSHM_EXAMPLE_CACHE": "on" if opts.cache else "off",
    }
    sock_dir = tempfile.mkdtemp(prefix="aioshm-demo-")
    engine: multiprocessing.process.BaseProcess | None = None
    try:
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
        # uvicorn shuts down gracefully on SIGTERM and then raises it again, to exit as if
        # killed by it: this handler makes that second one a clean exit (code 0) instead
        signal.signal(signal.SIGTERM, _exit_cleanly)
        server = uvicorn.Server(config)
        supervisor = Multiprocess(config, sockets=[listener]) if workers > 1 else None
        with contextlib.suppress(KeyboardInterrupt):
            if supervisor is not None:
                supervisor.run()
            else:
                server.run(sockets=[listener])
        # 3: the lifespan of a gateway process failed (uvicorn logged why); with N processes
        # uvicorn's supervisor then stops the others, and that one's exit status says so
        if supervisor is not None:
            return 3 if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes) else 0
        return 0 if server.started else 3
    finally:
        listener.close()
        if engine is not None:  # after the gateways: they release their hand-outs first
            engine.terminate()  # SIGTERM: it stops serving and closes its reader
            engine.join(15.0)
            if engine.is_alive():
                engine.kill()
                engine.join(5.0)
        shutil.rmtree(sock_dir, ignore_errors=True)
        sys.stdout.flush()


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)

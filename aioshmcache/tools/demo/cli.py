"""Options of ``python -m aioshmcache demo [run]`` and ``... demo serve``: dataclasses whose
fields generate the argparse flags (a field's metadata holds its help), so that they agree."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["DemoOptions", "ServeOptions", "run_main", "serve_main"]

T = TypeVar("T")
LOOPS = ("auto", "asyncio", "uvloop")
GATEWAY_WORKERS = (
    "run the gateway as N uvicorn worker processes (spawned), each the writer of its own shard "
    "of one cache group, with one engine worker attached to the group (default 1: one process, "
    "one cache, its own engine worker)"
)


def _opt(default: Any, help: str, **flag: Any) -> Any:
    """A field with its flag: ``help``, and ``flag=`` / ``min=`` / any ``add_argument`` option."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


@dataclass
class GatewayOptions:
    """The flags that run and serve share: how the gateway runs."""

    gateway_workers: int = _opt(1, GATEWAY_WORKERS, metavar="N", min=1)
    cache_mb: float = _opt(256.0, "cache size in MiB (%(default)g)")
    #: a 576x576 image is 3.8 MiB once preprocessed: 8 MiB caches every image of the load
    max_object_mb: float = _opt(8.0, "largest cached item in MiB, else inline (%(default)g)")
    loop: str = _opt("auto", "gateway event loop (%(default)s: uvloop if installed)", choices=LOOPS)


@dataclass
class DemoOptions(GatewayOptions):
    """What ``python -m aioshmcache demo run`` does."""

    requests: int = _opt(300, "requests per phase (%(default)s)", min=1)
    concurrency: int = _opt(20, "concurrent clients (%(default)s)", min=1)
    images: int = _opt(64, "distinct images (%(default)s)", min=1)
    zipf: float = _opt(1.1, "Zipf exponent of image popularity")
    seed: int = _opt(0, "seed of the images and the request plan")
    compare: bool = _opt(True, "skip the cache-off phase", flag="--no-compare")
    hash_first: float = _opt(0.2, "share of repeat requests sending the hash first (%(default)s)")
    quick: bool = _opt(False, "a short CI run (< 20 s)")
    json_path: str | None = _opt(None, "write the results as JSON", flag="--json", metavar="PATH")
    progress: bool = True


@dataclass
class ServeOptions(GatewayOptions):
    """What ``python -m aioshmcache demo serve`` does."""

    host: str = _opt("127.0.0.1", "address to listen on (%(default)s)")
    port: int = _opt(0, "0 picks a free port (default)")
    name: str | None = _opt(None, "segment name, or the group's with --gateway-workers")
    cache: bool = _opt(True, "bypass the cache: always inline", flag="--no-cache")
    log_level: str = _opt("warning", "uvicorn's log level (%(default)s)")


def parse(cls: type[T], argv: list[str], prog: str, description: str) -> T:
    """``cls`` from ``argv``: one flag per field that has a help text."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    limits: dict[str, int] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "help" not in (meta := dict(f.metadata)):
            continue
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        if "min" in meta:
            limits[f.name] = meta.pop("min")
        if isinstance(f.default, bool):
            action = "store_false" if f.default else "store_true"
            p.add_argument(flag, dest=f.name, action=action, **meta)
        else:
            kind = str if f.default is None else type(f.default)
            p.add_argument(flag, dest=f.name, type=kind, default=f.default, **meta)
    ns = p.parse_args(argv)
    for name, least in limits.items():
        if getattr(ns, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}")
    return cls(**vars(ns))


def serve_main(argv: list[str]) -> int:
    """``python -m aioshmcache demo serve``: the example gateway alone, until SIGINT / SIGTERM."""
    what = (
        "Run the example gateway (examples/fastapi_app.py) under uvicorn, with its engine worker."
    )
    opts = parse(ServeOptions, argv, "python -m aioshmcache demo serve", what)
    if opts.name is not None and opts.gateway_workers == 1 and _has_live_writer(opts.name):
        print(
            f"python -m aioshmcache demo serve: cache {opts.name!r} already has a live writer "
            "(another gateway?); stop it or pick another --name",
            file=sys.stderr,
        )
        return 2
    from .serve import serve

    return serve(opts)


def _has_live_writer(name: str) -> bool:
    """Whether segment ``name`` exists with a live writer (checked before anything is bound).

    Attaching succeeds only while the writer lives (its slot is freed at once); a segment whose
    writer died is not in the way (the gateway's cache reclaims it).
    """
    from aioshmcache import ReaderLimitError, ReceiverCache, ShmCacheError

    try:
        ReceiverCache.attach(name).close()
    except ReaderLimitError:
        return True  # every slot taken: alive, and busy
    except ShmCacheError:
        return False  # no such segment, a dead writer, or not a segment of ours
    return True


def run_main(argv: list[str]) -> int:
    """``python -m aioshmcache demo [run]``: gateway, load, verification and the table."""
    opts = parse(
        DemoOptions,
        argv,
        "python -m aioshmcache demo",
        "Start the example gateway (examples/fastapi_app.py) under uvicorn on 127.0.0.1, drive a "
        "Zipf-distributed image load at it, verify every answer against a local computation, "
        "and print a table (cache on vs off).",
    )
    if opts.quick:
        opts.requests = min(opts.requests, 60)
        opts.concurrency = min(opts.concurrency, 8)
        opts.images = min(opts.images, 12)
    from .load import run_demo

    return run_demo(opts)

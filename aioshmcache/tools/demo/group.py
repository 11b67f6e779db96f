"""``demo serve --gateway-workers N``: the gateway as N uvicorn worker processes, one cache group.

uvicorn spawns N gateway processes (fresh interpreters, ``create_app_from_env``). Each one opens
its own shard of the cache group in its lifespan (``CacheConfig(group=...)``) and listens for
the engine workers on ``DIR/gw-<pid>.sock``. The engine workers are started once, here, by the
serving process (no gateway process is special): each attaches to the whole group
(``AsyncReceiverCache.attach_group``) and connects to every gateway socket it finds in ``DIR``.

A gateway process marks itself ready (``DIR/ready-<pid>``) once every engine worker said hello
to it; ``/healthz`` answers 200 only when all N are. On shutdown each writes its ``/stats``
JSON to ``DIR/stats-<pid>.json``; the serving process prints their merge on stdout as one line
``group stats: {...}`` (the demo's table reads it: a ``/stats`` call reaches one process only).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Final, Literal

from .pool import SOCKET_DIR_PREFIX
from .settings import GatewaySettings
from .worker import TOKEN_ENV

__all__ = [
    "GROUP_STATS_LINE",
    "mark_ready",
    "merge_stats",
    "ready_count",
    "serve_group",
    "write_stats",
]

#: the serving process's last line on stdout: this prefix, then the merged stats as JSON
GROUP_STATS_LINE: Final = "group stats: "
_SUMMED_CACHE: Final = (
    "hits",
    "misses",
    "sibling_hits",
    "inline_too_large",
    "inline_full",
    "evictions",
    "bytes_used",
    "items",
    "capacity_bytes",
)


def mark_ready(sock_dir: str) -> None:
    """This gateway process has every engine worker connected."""
    with open(os.path.join(sock_dir, f"ready-{os.getpid()}"), "w"):
        pass


def ready_count(sock_dir: str) -> int:
    """How many gateway processes are ready."""
    return len(glob.glob(os.path.join(sock_dir, "ready-*")))


def write_stats(sock_dir: str, stats: dict[str, Any]) -> None:
    """This gateway process's ``/stats``, for the merge (written on shutdown)."""
    path = os.path.join(sock_dir, f"stats-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(stats, f, default=str)
    os.replace(path + ".tmp", path)


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``/stats`` of the whole group: counters summed, loop lag at its worst."""
    out: dict[str, Any] = {"gateway_processes": len(parts), "worker_restarts": 0}
    gateway: dict[str, int] = {}
    cache: dict[str, int] = {}
    flight: dict[str, int] = {}
    lag = {"p99_ms": 0.0, "max_ms": 0.0}
    for p in parts:
        for k, v in p.get("gateway", {}).items():
            gateway[k] = gateway.get(k, 0) + int(v)
        for k in _SUMMED_CACHE:
            cache[k] = cache.get(k, 0) + int(p.get("cache", {}).get(k, 0))
        for k, v in p.get("single_flight", {}).items():
            if isinstance(v, int):
                flight[k] = flight.get(k, 0) + v
        for k in lag:
            lag[k] = max(lag[k], float(p.get("loop_lag", {}).get(k, 0.0)))
    looked = cache.get("hits", 0) + cache.get("misses", 0)
    out["gateway"] = gateway
    out["cache"] = dict(cache, hit_ratio=cache.get("hits", 0) / looked if looked else 0.0)
    out["single_flight"] = flight
    out["loop_lag"] = lag
    return out


def _watch_parent(parent: int) -> None:
    """--exit-with-parent: SIGTERM ourselves (a graceful stop) when our parent is gone."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the engine workers, SIGKILL after 5 s."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5.0)


def serve_group(
    settings: GatewaySettings,
    *,
    host: str,
    port: int,
    loop: Literal["auto", "asyncio", "uvloop"],
    log_level: str,
) -> int:
    """Run ``settings.gateway_processes`` gateway processes under uvicorn (blocking)."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    n = settings.gateway_processes
    name = settings.name or f"demo-{os.getpid()}-{secrets.token_hex(3)}"
    group = name.removeprefix("aioshm-")
    sock_dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{group}-")
    token = secrets.token_hex(16)
    env = {
        TOKEN_ENV: token,
        "AIOSHM_DEMO_GROUP": group,
        "AIOSHM_DEMO_DIR": sock_dir,
        "AIOSHM_DEMO_PROCS": str(n),
        "AIOSHM_DEMO_WORKERS": str(settings.workers),
        "AIOSHM_DEMO_DELIVERY": settings.delivery,
        "AIOSHM_DEMO_CACHE_MB": str(settings.cache_mb),
        "AIOSHM_DEMO_CACHE": "on" if settings.cache_enabled else "off",
    }
    if settings.max_object_mb is not None:
        env["AIOSHM_DEMO_MAX_OBJECT_MB"] = str(settings.max_object_mb)
    os.environ.update(env)  # the spawned gateway processes read their settings from it
    if settings.exit_with_parent:
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    workers: list[subprocess.Popen[bytes]] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        for i in range(settings.workers):
            cmd = [sys.executable, "-m", "aioshmcache", "demo", "worker", "--group", group]
            cmd += ["--dir", sock_dir, "--index", str(i), "--loop", settings.worker_loop]
            cmd += ["--processor", json.dumps(settings.processor.to_dict())]
            workers.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
        config = uvicorn.Config(
            "aioshmcache.tools.demo.gateway:create_app_from_env",
            factory=True,
            workers=n,
            loop=loop,
            log_level=log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        Multiprocess(config, sockets=[sock]).run()
        parts = []
        for path in sorted(glob.glob(os.path.join(sock_dir, "stats-*.json"))):
            with open(path) as f:
                parts.append(json.load(f))
        print(GROUP_STATS_LINE + json.dumps(merge_stats(parts)), flush=True)
        return 0
    finally:
        sock.close()
        _stop(workers)
        shutil.rmtree(sock_dir, ignore_errors=True)

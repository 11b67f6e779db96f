"""The round trip, ours and the peers': writer → another process (or server) → reply.

aioshmcache puts the array and sends the ``ShmRef`` over a ``Pipe`` to the reader process, which
reads it (a copy, or a lease: view + ack) and replies; a ``multiprocessing`` Pipe sends the array
itself and gets its size back (or the array: the "echo" row); Redis is
``SET`` + ``GET`` through ``redis.asyncio`` (uvloop) against a private ``redis-server``. Every
mechanism runs interleaved with the others and with the ``np.copyto`` baseline of the same size.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

from aioshmcache import ShmObjectStore
from aioshmcache.store import StoreWriter

from ..progress import Progress
from ..redis_server import RedisServer, redis_binaries
from ..units import KiB, MiB, fmt_bytes
from . import timing as tm
from .params import Params, bench_config
from .procs import Worker
from .report import Report, Target

__all__ = ["run_peers_suite"]

S_RT = "Round trip: writer → reader process → reply, vs peers"

_clock = time.perf_counter_ns
_keys = itertools.count()
LOOP = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


def _redis_set_get(url: str, arr: Any, n: int, out: list[float]) -> None:
    """``n`` ``SET`` + ``GET`` of ``arr`` through a new ``redis.asyncio`` client, each timed."""
    import redis.asyncio

    async def run() -> None:
        async with redis.asyncio.Redis.from_url(url) as client:
            await client.ping()  # connected before the clock starts
            for _ in range(n):
                t0 = _clock()
                await client.set("bench", memoryview(arr))  # bytes-like values go as they are
                back = await client.get("bench")
                out.append((_clock() - t0) * 1e-9)
                if not isinstance(back, bytes) or len(back) != arr.nbytes:
                    raise RuntimeError("redis returned a different size")

    tm.run_on(LOOP, run)


def redis_missing(extra: str) -> str | None:
    """Why no Redis workload can run here (no server binary, no client), or None."""
    if redis_binaries() is None:
        return "redis-server is not installed (apt-get install redis-server)"
    if importlib.util.find_spec("redis") is None:
        return f"the redis client is not installed (pip install -e '.[{extra}]' in a clone)"
    return None


@contextlib.contextmanager
def redis_peer(report: Report, progress: Progress) -> Iterator[str | None]:
    """The URL of a private ``redis-server``, or None (and a skip line) when there is none."""
    if missing := redis_missing("bench"):
        report.skip(f"redis: {missing}")
        yield None
        return
    progress("redis: starting redis-server on 127.0.0.1")
    try:
        server = RedisServer()
    except (OSError, RuntimeError) as exc:
        report.skip(f"redis: redis-server would not start here ({exc})")
        yield None
        return
    with server:
        yield server.url


def _ours(
    store: StoreWriter, worker: Worker, mode: str, arr: Any, n: int, out: list[float]
) -> None:
    """``n`` round trips: a put, its ``ShmRef`` over the pipe to the worker (a reader process),
    which reads it (``copy`` or ``lease``) and replies; each timed."""
    item = {"data": arr}
    with worker.serving("read", mode, True) as conn:
        for _ in range(n):
            t0 = _clock()
            conn.send([store.put(f"rt{next(_keys)}", item)])
            reply = conn.recv()
            out.append((_clock() - t0) * 1e-9)
            if not isinstance(reply, list):
                raise RuntimeError(f"bench worker: {reply!r}")


def _echo(echo: bool, worker: Worker, arr: Any, n: int, out: list[float]) -> None:
    """``n`` arrays to the worker over the pipe, and back (or their size back)."""

    def there_and_back() -> None:
        worker.conn.send(arr)
        worker.conn.recv()

    with worker.serving("pipe_echo", echo):
        tm.each(n, there_and_back)(out)


#: row label (its plot series: the part before the parenthesis), and how it is measured
_PEERS = {
    "Pipe (array → reader, size back)": partial(_echo, False),
    "Pipe echo (array both ways)": partial(_echo, True),
}
BASE = "np.copyto (baseline)"
_OURS = {"copy": "aioshmcache, reader copies", "lease": "aioshmcache, reader leases"}


def _roundtrips(
    p: Params, report: Report, progress: Progress, worker: Worker, redis: str | None
) -> None:
    with tm.ShmBuffer(max(p.peer_sizes)) as shm:
        for size in p.peer_sizes:
            peers = "Pipe" + (" / redis" if redis else "")
            progress(f"round trip: {fmt_bytes(size)}, aioshmcache vs {peers} ({p.runs} runs)")
            n, arr = p.n_ops(size, peers=True), tm.source_array(size)
            cfg = bench_config(max(8 * MiB, 6 * (size + 4096)), size + 64 * KiB)
            with ShmObjectStore.create(cfg) as store, worker.attached(store.handle()):
                ours = partial(_ours, store, worker)
                for mode in _OURS:  # warm-up: both processes, the pipe, the ring
                    ours(mode, arr, max(2, n // 5), [])
                cells: dict[str, tm.Cell] = {BASE: tm.copy_into(shm, arr, n)}
                cells |= {label: partial(ours, mode, arr, n) for mode, label in _OURS.items()}
                cells |= {label: partial(fn, worker, arr, n) for label, fn in _PEERS.items()}
                if redis is not None:
                    redis_cell = partial(_redis_set_get, redis, arr, n)
                    cells[f"redis.asyncio SET + GET ({LOOP})"] = redis_cell
                stats = tm.interleave(p.runs, cells)
            _report_roundtrip(report, size, stats)


def _report_roundtrip(report: Report, size: int, stats: dict[str, Any]) -> None:
    base, add = stats[BASE], report.section(S_RT, fmt_bytes(size), plot="roundtrip", x=size)
    for label, st in stats.items():
        vs = None if label == BASE else ("np.copyto", base)
        add(label, st, vs=vs, series=label.split(" (")[0])
    add = report.section(S_RT, fmt_bytes(size))
    for ours in _OURS.values():
        for peer, st in stats.items():  # aioshmcache against each peer, same size, same runs
            if peer == BASE or peer in _OURS.values() or "echo" in peer:
                continue
            short = peer.split(" (")[0]
            big_redis = size == 16 * MiB and peer.startswith("redis")
            tgt = Target(">=", 20.0, "ratio") if big_redis else None
            add(f"{ours} vs {short}", stats[ours].median, vs=(short, st), target=tgt)


def run_peers_suite(p: Params, report: Report, progress: Progress) -> None:
    if not p.redis:
        report.skip("redis: --no-redis")
    redis = redis_peer(report, progress) if p.redis else contextlib.nullcontext()
    with Worker() as worker, redis as client:
        worker.attempt(
            report, "round trip", partial(_roundtrips, p, report, progress, redis=client)
        )

"""``python -m aioshmcache stress``: an async stress and fault-injection harness.

It proves the guarantees of DESIGN.md section 6 under load and faults: no wrong data, no hang,
nothing lost (the cache drains), nothing left behind (no segment, no semaphore, no child).

Processes and channels (every arrow is an abstract Unix socket carrying length-prefixed msgpack
frames; references travel as ``ShmRef.to_dict()``)::

    parent: orchestrator (asyncio) -- faults, flow control, watchdog, report
      |  ^                                   |  ^
      |  | req (references), probe, hb       |  | done, probe_done, synced, hb
      v  | credit, stop, check, exit         v  | handle, req, probe, sync, exit
    writer process, generation g            reader process x N (fresh interpreters)
    AsyncSenderCache, M writer tasks,       AsyncReceiverCache, K concurrent reads,
    forged/stale reference injector         checksum verification of every array

The writer is a child process so that it can be SIGKILLed for real. The parent then checks that
``sweep`` lists the dead writer's segment as an orphan and removes it (in a private /dev/shm the
real ``sweep()`` runs; on a shared machine only our own names are unlinked, other people's
segments are left alone), starts generation ``g + 1`` and hands its handle to the readers. A
reader that was attached to generation ``g`` must then see ``WriterGoneError`` from it, at the
latest on a call made 1 s after the death. In ``alternate`` delivery each generation switches
between broadcast and one-of-N, and the writer is also rotated gracefully at half time.

Items are deterministic functions of their hash (heavy-tailed sizes from 1 KiB to 32 MiB, mostly
small; content sliced from a seeded random buffer), so every writer generation produces the
same bytes for the same hash. An item carries its crc32 (over dtype, shape and bytes of each
array) in a field and the request message carries it too: readers recompute it for every array.
Hashes repeat with a Zipf distribution; the ring is small enough to evict all the time and wrap.

What counts as a violation (exit status 1, listed in the report): wrong or torn data; a forged
or stale reference that returns data, or raises anything but the expected typed error; any
unexpected exception; an operation past its deadline, a silent child (hang), a writer event
loop blocked longer than ``--max-loop-lag``; a reader whose slot holds fewer (or, without
cancellations, other than exactly as many) acknowledgements than the references it read and
verified; a cache that does not drain after quiescence; a segment, semaphore or child process
left behind; a crashed child; and a "stale" genuine reference that nothing explains. A stale
genuine reference means the writer reclaimed a hand-out before this reader acknowledged it:

* broadcast: explained if the hand-out may predate the reader's session (its request started
  before the reader attached), if the session acknowledged the same chunk through such an
  unowed hand-out before (acknowledgements are counted per chunk, not per hand-out), or if the
  reader was revoked (checked at once with a no-op call that must raise ``ReaderEvictedError``);
* one-of-N: explained only if the hand-out is older than ``handout_ttl``.

Flow control: the parent forwards each request to its readers (all of them in broadcast, one in
one-of-N) and returns one credit to the writer when every target has reported it (a killed or
stopped target is written off), so the writer runs at most ``--window`` requests ahead.

Cancellation: a raw ``Task.cancel()`` lands while the call is suspended (a call that finishes
without suspending cannot be cancelled and is counted as "completed first"); an
``anyio.move_on_after`` scope can only cancel at anyio checkpoints, because
``anyio.to_thread.run_sync`` holds scope cancellation back until its thread returns.

At the end (and before each planned rotation) the harness quiesces: faults stop, stopped readers
resume, the writer stops issuing requests, every reader reports every request and syncs, then
the writer checks that every cached item becomes freeable (one-of-N: within ``handout_ttl``),
frees them all and that the ring is empty. SIGINT / SIGTERM end a run early with the same
cleanup (exit status 2); children die with the parent (``PR_SET_PDEATHSIG``) even on SIGKILL.
``--private-shm SIZE`` re-runs everything in its own mount namespace with a private tmpfs on
/dev/shm (root only), immune to other processes' cleanups of the shared /dev/shm.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, BinaryIO, Final, TypeVar

import anyio
import msgpack
import numpy as np

from ._sweep import sweep
from ._types import SEGMENT_PREFIX, CacheConfig, FeatureSpec, ShmRef, reference_tag
from .aio import AsyncReceiverCache, AsyncSenderCache
from .errors import (
    CacheMissError,
    ReaderEvictedError,
    SegmentNotFoundError,
    ShmCacheError,
    WriterGoneError,
)

__all__ = ["FAULTS", "StressOptions", "main", "parse_duration", "parse_size"]

T = TypeVar("T")

FAULTS: Final = ("kill-readers", "stop-readers", "cancel", "kill-writer", "forge")
SHM_DIR: Final = "/dev/shm"
_LEN: Final = struct.Struct(">I")
MAX_FRAME: Final = 1 << 24
HB_INTERVAL: Final = 0.5
DEAD_WRITER_BOUND: Final = 1.0  # DESIGN 4: a reader learns of a dead writer within 1 s
ARRAY_FIELDS: Final = ("pixel_values", "grid", "mask", "half")
PR_SET_PDEATHSIG: Final = 1
IN_PRIVATE_SHM: Final = "AIOSHM_STRESS_PRIVATE_SHM"  # set inside the private /dev/shm namespace


# --------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------
_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?", re.IGNORECASE)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds from ``"60s"``, ``"2h"``, ``"1m30s"``, ``"500ms"`` or a bare number of seconds."""
    s = text.strip().replace(" ", "")
    if not s:
        raise ValueError("empty duration")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION_RE.match(s, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"bad duration {text!r} (use e.g. 60s, 2h, 1m30s, 500ms)")
        total += float(m.group(1)) * _UNITS[(m.group(2) or "s").lower()]
        pos = m.end()
    if not math.isfinite(total) or total <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return total


def parse_size(text: str) -> int:
    """Bytes from ``"96MiB"``, ``"32M"``, ``"1KiB"``, ``"4096"`` (binary multiples)."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"bad size {text!r} (use e.g. 1KiB, 32MiB, 1GiB)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass
class StressOptions:
    """Everything a run is parametrised by (the parent passes what children need as JSON)."""

    duration: float | None = 30.0
    ops: int | None = None
    readers: int = 3
    writers: int = 4
    reader_concurrency: int = 2
    delivery: str = "alternate"
    faults: frozenset[str] = frozenset()
    capacity: int = 96 << 20
    max_object: int = 33 << 20
    min_item: int = 1 << 10
    max_item: int = 32 << 20
    oversize_fraction: float = 0.003
    universe: int = 2000
    zipf: float = 1.1
    window: int = 16
    evict_after: float = 1.5
    handout_ttl: float = 3.0
    wait_for_space: float = 0.2
    op_deadline: float = 10.0
    hang_timeout: float = 15.0
    max_loop_lag: float = 5.0
    reader_kill_every: float = 4.0
    reader_stop_every: float = 5.0
    writer_kill_every: float = 15.0
    cancel_prob: float = 0.1
    probe_rate: float = 20.0
    seed: int = 0
    loop: str = "asyncio"
    json_path: str | None = None
    quiet: bool = False
    keep_logs: bool = False
    private_shm: int = 0
    switch_interval: float = 0.0001
    sabotage: frozenset[str] = frozenset()

    def child_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["faults"] = sorted(self.faults)
        d["sabotage"] = sorted(self.sabotage)
        return d

    @classmethod
    def from_child_dict(cls, d: dict[str, Any]) -> StressOptions:
        d = dict(d)
        d["faults"] = frozenset(d["faults"])
        d["sabotage"] = frozenset(d["sabotage"])
        return cls(**d)


def _parse_args(argv: list[str]) -> StressOptions:
    p = argparse.ArgumentParser(
        prog="python -m aioshmcache stress",
        description="Async stress and fault-injection harness (exit 0: clean, 1: violations).",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--duration", type=parse_duration, help="run time, e.g. 60s, 2h (default 30s)")
    g.add_argument("--ops", type=int, help="stop after this many writer requests")
    p.add_argument("--readers", type=int, default=3, help="reader processes (default 3)")
    p.add_argument("--writers", type=int, default=4, help="concurrent writer tasks (default 4)")
    p.add_argument("--reader-concurrency", type=int, default=2, help="concurrent reads per reader")
    p.add_argument(
        "--delivery",
        choices=("broadcast", "one_of_n", "alternate"),
        default="alternate",
        help="alternate: each writer generation switches mode (default)",
    )
    p.add_argument(
        "--faults",
        default="none",
        help=f"comma list of {', '.join(FAULTS)}; or 'all' / 'none' (default none)",
    )
    for f in FAULTS:
        p.add_argument(f"--{f}", action="store_true", help=f"enable the {f} fault")
    p.add_argument("--capacity", type=parse_size, default=96 << 20, help="ring capacity (96MiB)")
    p.add_argument("--max-object", type=parse_size, default=33 << 20, help="max object (33MiB)")
    p.add_argument("--min-item", type=parse_size, default=1 << 10, help="smallest item (1KiB)")
    p.add_argument("--max-item", type=parse_size, default=32 << 20, help="largest item (32MiB)")
    p.add_argument("--universe", type=int, default=2000, help="distinct hashes (2000)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of hash repeats (1.1)")
    p.add_argument("--window", type=int, default=16, help="requests in flight (16)")
    p.add_argument(
        "--evict-after",
        type=float,
        default=1.5,
        help="evict_stuck_readers_after when stop-readers is on (1.5 s; 0: never)",
    )
    p.add_argument("--handout-ttl", type=float, default=3.0, help="one-of-N handout_ttl (3 s)")
    p.add_argument(
        "--wait-for-space",
        type=float,
        default=0.2,
        help="largest wait_for_space a writer task passes (0.2 s; 0: never wait)",
    )
    p.add_argument("--op-deadline", type=float, default=10.0, help="per-operation deadline (s)")
    p.add_argument("--hang-timeout", type=float, default=15.0, help="silent child = hang (s)")
    p.add_argument("--max-loop-lag", type=float, default=5.0, help="writer loop lag bound (s)")
    p.add_argument("--reader-kill-every", type=parse_duration, default=4.0)
    p.add_argument("--reader-stop-every", type=parse_duration, default=5.0)
    p.add_argument("--writer-kill-every", type=parse_duration, default=15.0)
    p.add_argument("--cancel-prob", type=float, default=0.1, help="share of cancelled operations")
    p.add_argument("--probe-rate", type=float, default=20.0, help="forged/stale probes per second")
    p.add_argument(
        "--switch-interval",
        type=float,
        default=0.0001,
        help="sys.setswitchinterval in the children: more thread interleaving (0.1 ms; 0: default)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--json", dest="json_path", help="write the final statistics here as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--keep-logs", action="store_true", help="keep the children's logs")
    p.add_argument(
        "--private-shm",
        type=parse_size,
        default=0,
        metavar="SIZE",
        help="run in a private /dev/shm of this size (unshare -m; needs root): other "
        "processes' sweeps and cleanups cannot touch our segments, and the real sweep() runs",
    )
    p.add_argument("--sabotage", default="", help=argparse.SUPPRESS)  # harness self-test
    ns = p.parse_args(argv)

    faults: set[str] = set()
    spec = ns.faults.strip().lower()
    if spec == "all":
        faults.update(FAULTS)
    elif spec not in ("", "none"):
        for f in spec.split(","):
            f = f.strip()
            if f not in FAULTS:
                p.error(f"unknown fault {f!r}; choose from {', '.join(FAULTS)}")
            faults.add(f)
    for f in FAULTS:
        if getattr(ns, f.replace("-", "_")):
            faults.add(f)
    sabotage = frozenset(s for s in ns.sabotage.split(",") if s)
    if not sabotage <= {"digest", "drop"}:
        p.error("--sabotage takes digest,drop")
    duration = ns.duration if ns.duration is not None else (None if ns.ops else 30.0)
    opts = StressOptions(
        duration=duration,
        ops=ns.ops,
        readers=ns.readers,
        writers=ns.writers,
        reader_concurrency=ns.reader_concurrency,
        delivery=ns.delivery,
        faults=frozenset(faults),
        capacity=ns.capacity,
        max_object=ns.max_object,
        min_item=ns.min_item,
        max_item=ns.max_item,
        universe=ns.universe,
        zipf=ns.zipf,
        window=ns.window,
        evict_after=ns.evict_after,
        handout_ttl=ns.handout_ttl,
        wait_for_space=ns.wait_for_space,
        op_deadline=ns.op_deadline,
        hang_timeout=ns.hang_timeout,
        max_loop_lag=ns.max_loop_lag,
        reader_kill_every=ns.reader_kill_every,
        reader_stop_every=ns.reader_stop_every,
        writer_kill_every=ns.writer_kill_every,
        cancel_prob=ns.cancel_prob,
        probe_rate=ns.probe_rate,
        seed=ns.seed if ns.seed is not None else secrets.randbits(32),
        loop=ns.loop,
        json_path=ns.json_path,
        quiet=ns.quiet,
        keep_logs=ns.keep_logs,
        private_shm=ns.private_shm,
        switch_interval=ns.switch_interval,
        sabotage=sabotage,
    )
    checks = [
        (opts.readers >= 1, "--readers must be >= 1"),
        (opts.readers <= 64, "--readers must be <= 64"),
        (opts.writers >= 1, "--writers must be >= 1"),
        (opts.reader_concurrency >= 1, "--reader-concurrency must be >= 1"),
        (opts.ops is None or opts.ops >= 1, "--ops must be >= 1"),
        (opts.window >= 1, "--window must be >= 1"),
        (opts.universe >= 1, "--universe must be >= 1"),
        (opts.zipf > 0, "--zipf must be > 0"),
        (1024 <= opts.min_item <= opts.max_item, "need 1KiB <= --min-item <= --max-item"),
        (opts.handout_ttl > 0, "--handout-ttl must be > 0"),
        (opts.op_deadline > 0 and opts.hang_timeout > 0, "deadlines must be > 0"),
        (0 <= opts.cancel_prob <= 1, "--cancel-prob must be in [0, 1]"),
        (opts.wait_for_space >= 0 and opts.evict_after >= 0, "negative seconds"),
    ]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    try:
        CacheConfig(opts.capacity, opts.max_object, opts.readers)
    except ValueError as exc:
        p.error(f"cache configuration: {exc}")
    return opts


# --------------------------------------------------------------------------------------------
# the workload: deterministic items with digests
# --------------------------------------------------------------------------------------------
def _unit(seed: int, k: int, salt: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, k, salt)."""
    h = zlib.crc32(struct.pack("<QQQ", seed & 0xFFFFFFFFFFFFFFFF, k, salt))
    h = (h * 0x9E3779B1 + k * 0x85EBCA77 + salt) & 0xFFFFFFFF
    return ((h ^ (h >> 15)) * 0x2C1B3C6D & 0xFFFFFFFF) / 2.0**32


def item_size(seed: int, k: int, min_item: int, max_item: int) -> int:
    """Heavy-tailed size: log-uniform in u**3 (median ~4 KiB, mean ~1.1 MiB for 1 KiB..32 MiB)."""
    u = _unit(seed, k, 1)
    ratio = max_item / min_item
    return int(min_item * ratio ** (u**3))


def array_digest(arrays: Iterable[np.ndarray[Any, Any]]) -> int:
    """crc32 over dtype, shape and bytes of each array, in order."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(f"{a.dtype.str}{a.shape}".encode(), crc)
        if a.size:
            crc = zlib.crc32(np.ascontiguousarray(a).data.cast("B"), crc)
    return crc


class Workload:
    """Hash universe, Zipf sampler and item factory (same items in every process)."""

    def __init__(self, opts: StressOptions) -> None:
        self.opts = opts
        self.seed = opts.seed
        n = opts.universe
        ranks = np.arange(1, n + 1, dtype=np.float64)
        w = ranks ** (-opts.zipf)
        self._cdf = np.cumsum(w / w.sum())
        # popularity rank -> hash index: popular hashes get random sizes
        self._perm = np.random.default_rng(opts.seed).permutation(n)
        big = max(opts.max_item, opts.max_object + (256 << 10))
        self._base = np.random.default_rng(opts.seed ^ 0x5EED).integers(
            0, 256, size=big + (1 << 20), dtype=np.uint8
        )
        self._digests: dict[int, tuple[int, int]] = {}

    def sample(self, rng: random.Random) -> int:
        i = int(np.searchsorted(self._cdf, rng.random(), side="right"))
        return int(self._perm[min(i, len(self._perm) - 1)])

    @staticmethod
    def name(k: int) -> str:
        return f"h{k:06d}"

    def nbytes(self, k: int) -> int:
        o = self.opts
        if _unit(self.seed, k, 3) < o.oversize_fraction:  # too large to cache: served inline
            return o.max_object + (128 << 10)
        return item_size(self.seed, k, o.min_item, o.max_item)

    def item(self, k: int) -> tuple[dict[str, Any], int, int]:
        """(item, digest, nbytes): arrays are read-only views into the seeded base buffer."""
        n = self.nbytes(k)
        rows = max(1, (n - 512) // 64)
        pix_bytes = rows * 64
        span = len(self._base) - pix_bytes - 256
        off = int(_unit(self.seed, k, 2) * (span // 64)) * 64
        base = self._base
        pixel = base[off : off + pix_bytes].view(np.float32).reshape(rows, 16)
        grid = np.array([k, rows, 16], dtype=">i8")
        mask = (base[off + pix_bytes : off + pix_bytes + 64] & 1).astype(np.bool_)
        half = base[off + pix_bytes + 64 : off + pix_bytes + 128].view(np.float16)
        arrays = (pixel, grid, mask, half)
        cached = self._digests.get(k)
        if cached is None:
            cached = (array_digest(arrays), n)
            self._digests[k] = cached
        digest = cached[0]
        item = {
            "pixel_values": pixel,
            "grid": grid,
            "mask": mask,
            "half": half,
            "meta": {"mm_hash": self.name(k), "digest": digest, "nbytes": n, "tags": ["x", 1, 2.5]},
        }
        return item, digest, n


def verify_item(data: object, mm_hash: str, digest: int, nbytes: int) -> str | None:
    """None if ``data`` is exactly the item written for ``mm_hash``; else what is wrong."""
    if not isinstance(data, dict):
        return f"{mm_hash}: got {type(data).__name__}, not an item"
    if set(data) != {*ARRAY_FIELDS, "meta"}:
        return f"{mm_hash}: fields {sorted(data)}"
    meta = data["meta"]
    if not isinstance(meta, dict) or meta.get("mm_hash") != mm_hash:
        got = meta.get("mm_hash") if isinstance(meta, dict) else meta
        return f"{mm_hash}: item of another hash ({got!r})"
    if meta.get("digest") != digest or meta.get("nbytes") != nbytes:
        got_meta = f"{meta.get('digest')}/{meta.get('nbytes')}"
        return f"{mm_hash}: digest/size field {got_meta} != {digest}/{nbytes}"
    arrays = []
    for f in ARRAY_FIELDS:
        a = data[f]
        if not isinstance(a, np.ndarray):
            return f"{mm_hash}: field {f} is {type(a).__name__}"
        arrays.append(a)
    got = array_digest(arrays)
    if got != digest:
        return f"{mm_hash}: checksum {got:#010x} != expected {digest:#010x} (wrong or torn data)"
    return None


# --------------------------------------------------------------------------------------------
# framing: 4-byte big-endian length + msgpack
# --------------------------------------------------------------------------------------------
def pack(msg: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes] | None:
    """The next message and its raw frame, or None at end of stream."""
    try:
        head = await reader.readexactly(4)
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
        body = await reader.readexactly(n)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    msg = msgpack.unpackb(body, raw=False)
    if not isinstance(msg, dict):
        raise ValueError("a frame must hold a map")
    return msg, head + body


class Link:
    """One end of a framed connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def send(self, msg: dict[str, Any]) -> None:
        self.send_raw(pack(msg))

    def send_raw(self, frame: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame)

    async def recv(self) -> dict[str, Any] | None:
        got = await read_frame(self.reader)
        return None if got is None else got[0]

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
            with anyio.move_on_after(2):
                await self.writer.wait_closed()


# --------------------------------------------------------------------------------------------
# operations with deadlines and injected cancellation
# --------------------------------------------------------------------------------------------
class Outcome:
    __slots__ = ("exc", "kind", "value")

    def __init__(self, kind: str, value: Any = None, exc: BaseException | None = None) -> None:
        self.kind = kind  # ok | error | cancelled | timeout
        self.value = value
        self.exc = exc


async def guarded(
    make: Callable[[], Awaitable[T]], *, mode: str, deadline: float, rng: random.Random
) -> Outcome:
    """Run one library call under a deadline, optionally cancelling it mid-way.

    ``mode``: ``"none"``; ``"task"`` (a raw ``Task.cancel()`` after a random delay, the call
    already started); ``"scope"`` (an ``anyio.move_on_after`` with a tiny random timeout).
    """
    if mode == "task":
        started = asyncio.Event()

        async def run() -> T:
            started.set()
            return await make()

        task = asyncio.ensure_future(run())
        await started.wait()  # cancel mid-operation, not before the call began
        if not task.done():
            await asyncio.sleep(rng.uniform(0.0, 0.004))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=deadline)
        if not done:
            return Outcome("timeout")
        if task.cancelled():
            return Outcome("cancelled")
        exc = task.exception()
        if exc is not None:
            return Outcome("error", exc=exc)
        return Outcome("ok", task.result())
    t_start = time.monotonic()
    limit = rng.uniform(0.0, 0.006) if mode == "scope" else deadline
    got = False
    value: Any = None
    try:
        with anyio.move_on_after(limit):
            value = await make()
            got = True
    except Exception as exc:
        return Outcome("error", exc=exc)
    if got:
        return Outcome("ok", value)
    if mode == "scope":
        return Outcome("cancelled")
    return Outcome("timeout", value=time.monotonic() - t_start)


def _cancel_mode(opts: StressOptions, rng: random.Random) -> str:
    if "cancel" not in opts.faults or rng.random() >= opts.cancel_prob:
        return "none"
    return "task" if rng.random() < 0.5 else "scope"


def _sock_path(name: str) -> str:
    """``@name`` is the abstract socket ``\\0name`` (argv cannot carry a NUL byte)."""
    return "\0" + name[1:] if name.startswith("@") else name


def _set_pdeathsig() -> None:
    """Children die with the parent (no orphan process even if the harness is killed)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class LagMeter:
    """Event-loop lag: how late a 50 ms sleep wakes up."""

    def __init__(self) -> None:
        self.max = 0.0
        self.over_100ms = 0

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.05)
            lag = time.monotonic() - t - 0.05
            self.max = max(self.max, lag)
            if lag > 0.1:
                self.over_100ms += 1


# --------------------------------------------------------------------------------------------
# the writer process
# --------------------------------------------------------------------------------------------
class WriterProc:
    """One writer generation: an AsyncSenderCache, M request tasks and the probe injector."""

    def __init__(self, opts: StressOptions, gen: int, name: str, delivery: str, link: Link) -> None:
        self.opts = opts
        self.gen = gen
        self.name = name
        self.delivery = delivery
        self.link = link
        self.rng = random.Random(opts.seed * 1000 + gen)
        self.work = Workload(opts)
        self.credit = opts.window
        self.credit_event = asyncio.Event()
        self.stopping = False
        self.rid = 0
        self.stats: Counter[str] = Counter()
        self.lag = LagMeter()
        self.recent: deque[tuple[str, dict[str, int]]] = deque(maxlen=512)
        self.seen: deque[int] = deque(maxlen=256)
        self.tx: AsyncSenderCache | None = None
        self.max_op = 0.0

    def violation(self, text: str) -> None:
        self.stats["violations"] += 1
        self.link.send({"t": "violation", "who": f"writer g{self.gen}", "text": text})

    def config(self) -> CacheConfig:
        o = self.opts
        evict = o.evict_after if ("stop-readers" in o.faults and o.evict_after > 0) else None
        return CacheConfig(
            o.capacity,
            o.max_object,
            o.readers,
            name=self.name,
            delivery="one_of_n" if self.delivery == "one_of_n" else "broadcast",
            handout_ttl=o.handout_ttl,
            evict_stuck_readers_after=evict,
        )

    async def run(self) -> None:
        async with AsyncSenderCache.from_config(self.config()) as tx:
            self.tx = tx
            self.link.send(
                {
                    "t": "handle",
                    "gen": self.gen,
                    "handle": tx.handle().to_dict(),
                    "delivery": self.delivery,
                    "name": tx.sender.name,
                }
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.lag.run)
                tg.start_soon(self.heartbeat)
                tasks = [
                    asyncio.ensure_future(self.request_loop(i)) for i in range(self.opts.writers)
                ]
                if "forge" in self.opts.faults and self.opts.probe_rate > 0:
                    tasks.append(asyncio.ensure_future(self.inject_loop()))
                for t in tasks:
                    t.add_done_callback(self.task_done)
                await self.control(tasks)
                tg.cancel_scope.cancel()

    async def control(self, tasks: list[asyncio.Task[None]]) -> None:
        while True:
            msg = await self.link.recv()
            if msg is None:  # the parent is gone
                self.stopping = True
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return
            kind = msg["t"]
            if kind == "credit":
                self.give_credit(int(msg["n"]))
            elif kind == "stop":
                self.stopping = True
                self.credit_event.set()
                _, pending = await asyncio.wait(tasks, timeout=self.opts.op_deadline + 5)
                for t in pending:
                    self.violation("a writer task did not stop within its deadline")
                    t.cancel()
                self.link.send({"t": "stopped", "gen": self.gen, "stats": self.stats_msg()})
            elif kind == "check":
                self.link.send(await self.final_check(float(msg["within"])))
            elif kind == "exit":
                return

    def task_done(self, t: asyncio.Future[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            exc = t.exception()
            tb = "".join(traceback.format_exception(exc)) if exc is not None else ""
            self.violation(f"writer task crashed: {exc!r}\n{tb}")

    def stats_msg(self) -> dict[str, Any]:
        tx = self.tx
        out: dict[str, Any] = dict(self.stats)
        if tx is not None and not tx.sender.closed:
            snap = tx.snapshot()
            out.update(
                hits=snap.hits,
                misses=snap.misses,
                inline_full=snap.inline_full,
                inline_too_large=snap.inline_too_large,
                evictions=snap.evictions,
                inline_busy=tx.inline_busy,
                items=snap.items,
                bytes_used=snap.bytes_used,
            )
        out["lag_max"] = self.lag.max
        out["lag_over_100ms"] = self.lag.over_100ms
        out["op_max"] = self.max_op
        return out

    async def heartbeat(self) -> None:
        while True:
            self.link.send({"t": "hb", "stats": self.stats_msg()})
            if self.lag.max > self.opts.max_loop_lag and not self.stats["lag_reported"]:
                self.stats["lag_reported"] = 1
                self.violation(f"writer event loop blocked for {self.lag.max:.2f} s")
            await asyncio.sleep(HB_INTERVAL)

    def give_credit(self, n: int) -> None:
        self.credit += n
        self.credit_event.set()

    async def take_credit(self) -> bool:
        t = time.monotonic()
        while self.credit <= 0 and not self.stopping:
            self.credit_event.clear()
            with anyio.move_on_after(1.0):
                await self.credit_event.wait()
            if time.monotonic() - t > 60:
                self.violation("no flow-control credit for 60 s: readers stopped reporting")
                t = time.monotonic()
        if self.stopping:
            return False
        self.credit -= 1
        return True

    def build(
        self, ks: list[int], force_data: set[str]
    ) -> tuple[list[FeatureSpec], list[tuple[str, int, dict[str, Any], int, int]]]:
        tx = self.tx
        if tx is None:
            raise RuntimeError("no sender")
        specs: list[FeatureSpec] = []
        meta: list[tuple[str, int, dict[str, Any], int, int]] = []
        for j, k in enumerate(ks):
            h = self.work.name(k)
            item, digest, n = self.work.item(k)
            r = self.rng.random()
            data: Any = item
            if h not in force_data and (
                (r < 0.4 and tx.is_cached_item(h)) or (r > 0.97 and k in self.seen)
            ):
                data = None  # "the readers have it": a miss here is the sender's CacheMissError
            specs.append(
                FeatureSpec(h, data, identifier=f"{self.rid}.{j}", prompt_updates=(("upd", k),))
            )
            meta.append((h, k, item, digest, n))
        return specs, meta

    async def request_loop(self, task_no: int) -> None:
        o, rng, tx = self.opts, self.rng, self.tx
        if tx is None:
            return
        while not self.stopping:
            if not await self.take_credit():
                return
            self.rid += 1
            rid = self.rid
            ks = [self.work.sample(rng) for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4)))]
            force: set[str] = set()
            wait = 0.0
            if o.wait_for_space > 0 and rng.random() < 0.2:
                wait = rng.uniform(0.0, o.wait_for_space)
            sent = False
            for attempt in range(3):
                specs, meta = self.build(ks, force)
                mode = _cancel_mode(o, rng)
                t0 = time.monotonic()
                call = functools.partial(tx.get_and_update_features, specs, wait_for_space=wait)
                res = await guarded(call, mode=mode, deadline=o.op_deadline, rng=rng)
                took = time.monotonic() - t0
                self.max_op = max(self.max_op, took)
                self.stats["requests"] += 1
                if res.kind == "timeout":
                    self.violation(f"get_and_update_features missed its {o.op_deadline} s deadline")
                    break
                if res.kind == "cancelled":
                    self.stats[f"cancelled_{mode}"] += 1
                    break
                if res.kind == "error":
                    exc = res.exc
                    if isinstance(exc, CacheMissError) and attempt < 2:
                        self.stats["sender_cache_miss"] += 1
                        force.update(exc.mm_hashes)
                        continue
                    self.violation(f"get_and_update_features raised {exc!r}")
                    break
                if mode != "none":
                    self.stats["cancel_too_late"] += 1
                sent = self.publish(rid, t0, specs, meta, res.value)
                break
            if not sent:  # nothing went to the readers: no credit comes back for it
                self.give_credit(1)
            await asyncio.sleep(0)

    def publish(
        self,
        rid: int,
        t0: float,
        specs: list[FeatureSpec],
        meta: list[tuple[str, int, dict[str, Any], int, int]],
        out: Any,
    ) -> bool:
        """Check what the sender returned and send the references (no await: cancel-safe)."""
        feats: list[list[Any]] = []
        if not isinstance(out, list) or len(out) != len(specs):
            self.violation(f"get_and_update_features returned {type(out).__name__}")
            return False
        sabotage = "digest" in self.opts.sabotage and self.rng.random() < 0.01
        for spec, f, (h, k, item, digest, n) in zip(specs, out, meta):
            self.seen.append(k)
            if not isinstance(f, FeatureSpec) or f.mm_hash != h:
                self.violation(f"{h}: sender returned {f!r}")
                continue
            if (
                tuple(f.prompt_updates) != tuple(spec.prompt_updates)
                or f.identifier != spec.identifier
            ):
                self.violation(f"{h}: prompt updates / identifier not preserved")
            if isinstance(f.data, ShmRef):
                ref = f.data.to_dict()
                self.recent.append((h, ref))
                self.stats["refs"] += 1
                self.stats["ref_bytes"] += n
                feats.append([h, ref, digest ^ 1 if sabotage else digest, n])
            elif f.data is item and spec.data is item:
                self.stats["inline"] += 1
                feats.append([h, None, digest, n])
            else:
                self.violation(f"{h}: sender returned data that is neither a ShmRef nor the input")
        self.link.send({"t": "req", "gen": self.gen, "rid": rid, "t0": t0, "f": feats})
        return True

    # --- forged and stale references ------------------------------------------------------
    async def inject_loop(self) -> None:
        tx = self.tx
        if tx is None:
            return
        kinds = (
            "stale_evicted",
            "past_epoch",
            "future_epoch",
            "foreign_nonce",
            "misaligned",
            "out_of_range",
            "wrong_length",
            "unissued_id",
            "random",
            "malformed",
        )
        while not self.stopping:
            await asyncio.sleep(self.rng.expovariate(self.opts.probe_rate))
            if self.stopping or not self.recent:
                continue
            kind = self.rng.choice(kinds)
            probe = self.forge(kind)
            if probe is None:
                continue
            via = "item" if self.rng.random() < 0.3 else "features"
            ref, expect, kind = probe
            if via == "item":
                expect = ["StaleReferenceError" if e == "CacheMissError" else e for e in expect]
            self.stats[f"probe_{kind}"] += 1
            self.stats["probes"] += 1
            self.link.send(
                {
                    "t": "probe",
                    "gen": self.gen,
                    "kind": kind,
                    "via": via,
                    "h": "forged",
                    "ref": ref,
                    "expect": expect,
                }
            )

    def forge(self, kind: str) -> tuple[dict[str, Any], list[str], str] | None:
        """A forged or stale reference and the typed errors a reader may answer it with.

        References carry a tag binding their fields to the segment's secret, so an altered field
        is ``InvalidReferenceError``. Half of the forgeries are re-tagged with the secret (what
        an attacker who can map the segment could do): then the ring's own checks (bounds,
        alignment, chunk header, id, state, length) must still refuse them.
        """
        tx = self.tx
        if tx is None:
            return None
        store = tx.sender.store
        h, ref = self.rng.choice(self.recent)
        r: dict[str, Any] = dict(ref)
        inv, miss = "InvalidReferenceError", "CacheMissError"
        if kind == "stale_evicted":
            cur = store.ref_of(h)
            if cur is not None and cur.id == r["id"]:
                return None  # still cached: not certainly stale
            return r, [miss], kind
        if kind == "malformed":  # not even a well-formed reference
            variant = self.rng.randrange(4)
            if variant == 0:
                del r["length"]
            elif variant == 1:
                r["address"] = -64
            elif variant == 2:
                r["id"] = "7"
            else:
                r["epoch"] = True
            return r, [inv], kind
        if kind == "foreign_nonce":
            r["nonce"] ^= 0x2
            return r, [inv], kind
        cap = store.ring.capacity
        if kind == "past_epoch":
            r["epoch"] -= 1
            retagged = [miss]  # an older epoch with a valid tag: from before a clear
        elif kind == "future_epoch":
            r["epoch"] += 1
            retagged = [inv]
        elif kind == "misaligned":
            r["address"] += 8
            retagged = [inv]
        elif kind == "out_of_range":
            r["address"] = cap + 64 * self.rng.randrange(1, 1 << 20)
            retagged = [inv]
        elif kind == "wrong_length":
            r["length"] += self.rng.choice((1, 64, 4096))
            retagged = [inv, miss]  # stale if the chunk was evicted meanwhile
        elif kind == "unissued_id":
            r["id"] = (1 << 62) + self.rng.randrange(1 << 40)
            retagged = [inv]
        elif kind == "random":
            r["address"] = self.rng.randrange(0, cap // 64) * 64
            r["id"] = self.rng.randrange(1, max(2, store.ring.next_id))
            r["length"] = self.rng.randrange(0, 1 << 20)
            retagged = [inv, miss]  # an issued id at a place it does not live: stale or invalid
        else:
            raise ValueError(kind)
        secret = getattr(store, "_secret", None)
        if isinstance(secret, int) and self.rng.random() < 0.5:
            r["tag"] = reference_tag(
                secret,
                r["epoch"],
                r["address"],
                r["id"],
                r["length"],
                r.get("position", 0),
                r.get("seq", 0),
            )
            return r, retagged, kind + "+tag"
        return r, [inv], kind

    async def final_check(self, within: float) -> dict[str, Any]:
        """After quiescence: every cached item becomes freeable, and then the ring drains."""
        tx = self.tx
        out: dict[str, Any] = {"t": "final", "gen": self.gen}
        if tx is None:
            out["error"] = "no sender"
            return out
        deadline = time.monotonic() + within
        while True:
            keys = tx.cached_order()
            stuck = [h for h in keys if not tx.is_freeable(h)]
            if not stuck or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        out["items"] = len(keys)
        out["not_freeable"] = stuck[:20]
        out["n_not_freeable"] = len(stuck)
        if not stuck:
            await tx.remove_dangling_items()
        snap = tx.snapshot()
        out["after_items"] = snap.items
        out["after_bytes"] = snap.bytes_used
        out["slots"] = [
            {
                "slot": s.slot,
                "attached": s.attached,
                "alive": s.alive,
                "pid": s.pid,
                "lag": s.lag,
                "acknowledged": s.acknowledged,
                "revoked": s.revoked,
            }
            for s in snap.readers
        ]
        out["stats"] = self.stats_msg()
        return out


# --------------------------------------------------------------------------------------------
# the reader process
# --------------------------------------------------------------------------------------------
class ReaderProc:
    """One reader: attaches to each writer generation in turn and verifies every array."""

    def __init__(self, opts: StressOptions, token: str, seed: int, link: Link) -> None:
        self.opts = opts
        self.token = token
        self.link = link
        self.rng = random.Random(seed)
        self.rx: AsyncReceiverCache | None = None
        self.gen = 0
        self.handle: dict[str, Any] | None = None
        self.delivery = "broadcast"
        self.gone = False  # the current generation's writer is gone
        self.need_reattach = False
        self.attach_after = 0.0
        self.unowed_ids: set[int] = set()
        self.session_reads = 0  # references read and verified in this session (one ack each)
        self.session_uncertain = 0  # cancelled or half-read requests: acks we cannot count
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.sem = asyncio.Semaphore(opts.reader_concurrency)
        self.lag = LagMeter()
        self.tasks: set[asyncio.Task[None]] = set()

    def violation(self, text: str) -> None:
        self.link.send({"t": "violation", "who": f"reader {self.token}", "text": text})

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.heartbeat)
            tg.start_soon(self.lag.run)
            try:
                await self.dispatch()
            finally:
                await self.wait_idle()
                await self.detach()
                tg.cancel_scope.cancel()

    async def heartbeat(self) -> None:
        while True:
            self.link.send({"t": "hb", "gen": self.gen, "lag_max": self.lag.max})
            await asyncio.sleep(HB_INTERVAL)

    async def wait_idle(self) -> None:
        with anyio.move_on_after(self.opts.op_deadline * 2):
            await self.idle.wait()

    async def dispatch(self) -> None:
        while True:
            msg = await self.link.recv()
            if msg is None:
                return
            kind = msg["t"]
            if self.need_reattach and kind in ("req", "probe", "sync"):
                await self.wait_idle()
                await self.reattach()
            if kind in ("req", "probe"):
                if "drop" in self.opts.sabotage and kind == "req" and self.rng.random() < 0.02:
                    self.link.send({"t": "done", "rid": msg["rid"], "gen": msg["gen"], "r": "ok"})
                    continue  # self-test: a reader that silently loses requests
                await self.sem.acquire()
                self.inflight += 1
                self.idle.clear()
                task = asyncio.ensure_future(self.run_one(msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif kind == "handle":
                await self.wait_idle()
                await self.switch(msg)
            elif kind == "sync":
                await self.wait_idle()
                self.check_acks()
                self.link.send(
                    {
                        "t": "synced",
                        "token": msg["token"],
                        "gen": self.gen,
                        "attached": self.rx is not None and not self.gone,
                    }
                )
            elif kind == "exit":
                return

    def check_acks(self) -> None:
        """Every verified read wrote an acknowledgement into our slot's log: none was lost."""
        rx = self.rx
        if rx is None or self.gone:
            return
        slot = getattr(getattr(rx.receiver, "store", None), "slot", None)
        acked = getattr(slot, "acknowledged", None)
        if not isinstance(acked, int):
            return
        # more acknowledgements than reads is fine: stale or rejected references are given back
        # (acknowledged unread) so that they pin nothing; fewer would be a lost one
        if acked < self.session_reads:
            self.violation(
                f"acknowledgements lost: {self.session_reads} references read and verified in "
                f"this session, but the slot's log holds {acked} acknowledgements"
                + (f" ({self.session_uncertain} uncounted)" if self.session_uncertain else "")
            )

    async def run_one(self, msg: dict[str, Any]) -> None:
        try:
            if msg["t"] == "req":
                await self.read_request(msg)
            else:
                await self.read_probe(msg)
        except Exception as exc:
            self.violation(f"reader harness error: {exc!r}\n{traceback.format_exc()}")
        finally:
            self.sem.release()
            self.inflight -= 1
            if not self.inflight:
                self.idle.set()

    # --- attach / detach --------------------------------------------------------------------
    async def detach(self) -> None:
        rx, self.rx = self.rx, None
        if rx is not None:
            with anyio.move_on_after(self.opts.op_deadline) as sc:
                await rx.aclose()
            if sc.cancelled_caught:
                self.violation("AsyncReceiverCache.aclose missed its deadline")

    async def attach(self) -> None:
        if self.handle is None:
            return
        rx = AsyncReceiverCache.attach(self.handle)
        try:
            with anyio.fail_after(self.opts.op_deadline):
                await rx.open()
        except (WriterGoneError, SegmentNotFoundError) as exc:
            self.gone = True
            self.link.send(
                {
                    "t": "err",
                    "kind": type(exc).__name__,
                    "gen": self.gen,
                    "where": "attach",
                    "text": str(exc),
                }
            )
            return
        except TimeoutError:
            self.violation("attach missed its deadline")
            self.gone = True
            return
        except ShmCacheError as exc:
            self.violation(f"attach to g{self.gen} raised {exc!r}")
            self.gone = True
            return
        self.rx = rx
        self.gone = False
        self.attach_after = time.monotonic()
        self.unowed_ids = set()
        self.session_reads = self.session_uncertain = 0
        self.link.send({"t": "attached", "gen": self.gen})

    async def reattach(self) -> None:
        self.need_reattach = False
        await self.detach()
        await self.attach()
        self.link.send({"t": "err", "kind": "reattach", "gen": self.gen, "where": "revoked"})

    async def switch(self, msg: dict[str, Any]) -> None:
        """A new writer generation: the old one must have been reported gone (within 1 s)."""
        if int(msg["gen"]) == self.gen:
            return  # already have it (sent on hello and again with the generation change)
        prev = msg.get("prev")
        if self.rx is not None and not self.gone and prev is not None:
            dead_at = float(prev["dead_at"])
            while True:
                t_call = time.monotonic()
                try:
                    await self.rx.get_and_update_features([])
                except WriterGoneError:
                    self.link.send(
                        {"t": "err", "kind": "WriterGoneError", "gen": self.gen, "where": "switch"}
                    )
                    break
                except ReaderEvictedError:
                    break
                if t_call - dead_at > DEAD_WRITER_BOUND:
                    self.violation(
                        f"writer g{self.gen} died {t_call - dead_at:.2f} s ago and the reader "
                        "still does not see WriterGoneError"
                    )
                    break
                await asyncio.sleep(0.05)
        await self.detach()
        self.gen = int(msg["gen"])
        self.handle = msg["handle"]
        self.delivery = str(msg["delivery"])
        self.need_reattach = False
        await self.attach()

    # --- reads --------------------------------------------------------------------------------
    def report(self, msg: dict[str, Any], result: str, **extra: Any) -> None:
        out = {"t": "done", "rid": msg["rid"], "gen": msg["gen"], "r": result}
        out.update(extra)
        self.link.send(out)

    async def read_request(self, msg: dict[str, Any]) -> None:
        rx = self.rx
        if rx is None or self.gone or int(msg["gen"]) != self.gen:
            self.report(msg, "skip")
            return
        t0 = float(msg["t0"])
        feats: list[list[Any]] = msg["f"]
        specs: list[FeatureSpec] = []
        for h, ref, _digest, _n in feats:
            if ref is None:
                specs.append(FeatureSpec(h, None))
            else:
                data = ShmRef.from_dict(ref) if self.rng.random() < 0.5 else dict(ref)
                specs.append(FeatureSpec(h, data))
        maybe_unowed = t0 < self.attach_after
        if maybe_unowed:
            self.unowed_ids.update(int(ref["id"]) for _h, ref, _d, _n in feats if ref is not None)
        mode = _cancel_mode(self.opts, self.rng)
        res = await guarded(
            lambda: rx.get_and_update_features(specs),
            mode=mode,
            deadline=self.opts.op_deadline,
            rng=self.rng,
        )
        if res.kind == "timeout":
            self.violation(f"get_and_update_features missed its {self.opts.op_deadline} s deadline")
            self.report(msg, "timeout")
            return
        if res.kind == "cancelled":
            self.session_uncertain += 1
            self.report(msg, f"cancelled_{mode}")
            return
        if res.kind == "ok":
            n_ok, nbytes, bad = self.verify(feats, res.value)
            self.session_reads += n_ok + bad
            self.report(msg, "ok", n=n_ok, b=nbytes, bad=bad)
            return
        exc = res.exc
        if isinstance(exc, CacheMissError):
            n_ok = nbytes = bad = 0
            if exc.features is not None:
                n_ok, nbytes, bad = self.verify(feats, exc.features, allow_missing=True)
                self.session_reads += n_ok + bad
            stale = self.stale_indices(feats, exc.features)
            explained, unexplained = await self.classify(feats, stale, t0, maybe_unowed)
            self.report(
                msg,
                "miss",
                n=n_ok,
                b=nbytes,
                bad=bad,
                stale=len(stale),
                why=dict(explained),
                unexplained=len(unexplained),
            )
            for why in unexplained:
                self.violation(why)
            return
        self.session_uncertain += 1  # part of the request may have been read and acknowledged
        if isinstance(exc, ReaderEvictedError):
            self.need_reattach = True
            self.report(msg, "ReaderEvictedError")
            return
        if isinstance(exc, WriterGoneError):
            self.gone = True
            self.report(msg, "WriterGoneError")
            return
        self.violation(f"genuine request {msg['rid']} (g{msg['gen']}) raised {exc!r}")
        self.report(msg, f"unexpected_{type(exc).__name__}")

    def verify(
        self, feats: list[list[Any]], out: Any, *, allow_missing: bool = False
    ) -> tuple[int, int, int]:
        if not isinstance(out, list) or len(out) != len(feats):
            self.violation(f"receiver returned {type(out).__name__} for {len(feats)} features")
            return 0, 0, 1
        n_ok = nbytes = bad = 0
        for (h, ref, digest, n), f in zip(feats, out):
            if not isinstance(f, FeatureSpec) or f.mm_hash != h:
                self.violation(f"receiver returned {f!r} for {h}")
                bad += 1
                continue
            if ref is None:
                if f.data is not None:
                    self.violation(f"{h}: inline placeholder came back as {type(f.data).__name__}")
                    bad += 1
                continue
            if f.data is None and allow_missing:
                continue
            err = verify_item(f.data, h, digest, n)
            if err is not None:
                self.violation(f"WRONG DATA: {err}")
                bad += 1
            else:
                n_ok += 1
                nbytes += n
        return n_ok, nbytes, bad

    @staticmethod
    def stale_indices(feats: list[list[Any]], out: Any) -> list[int]:
        if not isinstance(out, list):
            return [i for i, f in enumerate(feats) if f[1] is not None]
        return [
            i
            for i, (f, o) in enumerate(zip(feats, out))
            if f[1] is not None and isinstance(o, FeatureSpec) and o.data is None
        ]

    async def classify(
        self, feats: list[list[Any]], stale: list[int], t0: float, maybe_unowed: bool
    ) -> tuple[Counter[str], list[str]]:
        """Why stale genuine references are explained (by cause); the others, described."""
        now = time.monotonic()
        explained: Counter[str] = Counter()
        todo: list[int] = []
        for i in stale:
            ref = feats[i][1]
            if self.delivery == "one_of_n":
                if now - t0 > self.opts.handout_ttl - 0.05:
                    explained["ttl"] += 1
                    continue
            elif maybe_unowed:
                explained["before_attach"] += 1
                continue
            elif int(ref["id"]) in self.unowed_ids:
                explained["unowed_ack"] += 1
                continue
            todo.append(i)
        if not todo:
            return explained, []
        if self.delivery != "one_of_n" and self.rx is not None:
            try:
                await self.rx.get_and_update_features([])  # revoked? (public, no-op otherwise)
            except ReaderEvictedError:
                self.need_reattach = True
                explained["revoked"] += len(todo)
                return explained, []
            except (WriterGoneError, ShmCacheError):
                pass
        why = []
        for i in todo:
            h, ref = feats[i][0], feats[i][1]
            why.append(
                f"{h} (chunk {ref['id']}, {self.delivery}, g{self.gen}) was reclaimed "
                f"{now - t0:.2f} s after its hand-out, before this reader acknowledged it"
            )
        return explained, why

    async def read_probe(self, msg: dict[str, Any]) -> None:
        rx = self.rx
        out: dict[str, Any] = {"t": "probe_done", "kind": msg["kind"], "gen": msg["gen"]}
        if rx is None or self.gone or int(msg["gen"]) != self.gen:
            out["r"] = "skip"
            self.link.send(out)
            return
        ref, h, expect = msg["ref"], str(msg["h"]), list(msg["expect"])

        async def call() -> Any:
            if msg["via"] == "item":
                return await rx.get_and_update_item(ref, h)
            return await rx.get_and_update_features([FeatureSpec(h, ref)])

        res = await guarded(call, mode="none", deadline=self.opts.op_deadline, rng=self.rng)
        if res.kind == "timeout":
            self.violation(f"probe {msg['kind']} missed its deadline")
            out["r"] = "timeout"
        elif res.kind == "ok":
            self.violation(
                f"FORGED/STALE reference ({msg['kind']}, via {msg['via']}) returned data "
                f"instead of one of {expect}: {ref}"
            )
            out["r"] = "DATA"
        else:
            name = type(res.exc).__name__
            out["r"] = name
            if name in expect:
                pass
            elif isinstance(res.exc, ReaderEvictedError):
                self.need_reattach = True
            elif isinstance(res.exc, WriterGoneError):
                self.gone = True
            else:
                self.violation(
                    f"probe {msg['kind']} (via {msg['via']}) raised {res.exc!r}, expected {expect}"
                )
        self.link.send(out)


# --------------------------------------------------------------------------------------------
# child entry point
# --------------------------------------------------------------------------------------------
def _run_loop(opts: StressOptions, coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    if opts.loop == "uvloop":
        import uvloop

        uvloop.run(coro())
    else:
        asyncio.run(coro())


def _child_main(argv: list[str]) -> int:
    _set_pdeathsig()
    role, sock, token, blob = argv[0], argv[1], argv[2], argv[3]
    spec = json.loads(blob)
    opts = StressOptions.from_child_dict(spec["opts"])
    if opts.switch_interval > 0:
        sys.setswitchinterval(opts.switch_interval)

    async def amain() -> None:
        reader, writer = await asyncio.open_unix_connection(_sock_path(sock))
        link = Link(reader, writer)
        link.send({"t": "hello", "token": token, "pid": os.getpid()})
        try:
            if role == "writer":
                w = WriterProc(
                    opts, int(spec["gen"]), str(spec["name"]), str(spec["delivery"]), link
                )
                try:
                    await w.run()
                except Exception as exc:
                    link.send(
                        {
                            "t": "violation",
                            "who": f"writer g{spec['gen']}",
                            "text": f"writer crashed: {exc!r}\n{traceback.format_exc()}",
                        }
                    )
                    raise
            else:
                r = ReaderProc(opts, token, int(spec["seed"]), link)
                await r.run()
        finally:
            with contextlib.suppress(Exception):
                await writer.drain()
            await link.close()

    try:
        _run_loop(opts, amain)
    except BaseException:
        traceback.print_exc()
        return 3
    return 0


# --------------------------------------------------------------------------------------------
# the parent: orchestration, faults, flow control, watchdog
# --------------------------------------------------------------------------------------------
def _open_log(path: str) -> BinaryIO:
    return open(path, "wb")


def _segment_files(name: str) -> list[str]:
    """The segment ``name`` and its wake-up semaphore, if they exist in /dev/shm."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names if n == name or n.startswith(f"sem.{name}."))


@dataclasses.dataclass(eq=False)
class Child:
    role: str
    token: str
    proc: asyncio.subprocess.Process
    log_path: str
    pos: int = -1
    gen: int = 0
    name: str = ""
    link: Link | None = None
    connected: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    eof: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    handle_msg: dict[str, Any] | None = None
    got_handle: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    last_hb: float = 0.0
    stopped: bool = False
    busy: bool = False  # a fault is acting on it
    killed_by_us: bool = False
    attached_gen: int = 0
    rc_seen: bool = False
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    replies: dict[str, asyncio.Future[dict[str, Any]]] = dataclasses.field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: dict[str, Any]) -> None:
        if self.link is not None:
            self.link.send(msg)

    def send_raw(self, frame: bytes) -> None:
        if self.link is not None:
            self.link.send_raw(frame)


class Violations:
    def __init__(self) -> None:
        self.items: list[str] = []
        self.counts: Counter[str] = Counter()

    def add(self, who: str, text: str) -> None:
        key = text.split(":")[0][:80]
        self.counts[key] += 1
        if len(self.items) < 200:
            self.items.append(f"[{who}] {text}")

    def __len__(self) -> int:
        return sum(self.counts.values())


class Orchestrator:
    def __init__(self, opts: StressOptions) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.run_id = secrets.token_hex(4)
        self.prefix = f"{SEGMENT_PREFIX}stress-{self.run_id}-"
        self.tmp = tempfile.mkdtemp(prefix="aioshm-stress-")
        # an abstract Unix socket (Linux): no file to clean up, no path length limit
        self.sock = f"@aioshm-stress-{self.run_id}-{os.getpid()}"
        self.violations = Violations()
        self.children: dict[str, Child] = {}
        self.readers: list[Child | None] = [None] * opts.readers
        self.writer: Child | None = None
        self.writer_gen = 0
        self.pending: dict[tuple[int, int], set[str]] = {}
        self.stats: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.probes: Counter[str] = Counter()
        self.err_texts: dict[str, str] = {}
        self.writer_stats: dict[int, dict[str, Any]] = {}
        self.dead_gens: dict[int, str] = {}  # gen -> "killed" | "closed"
        self.wgone_gens: set[int] = set()
        self.old_refs: deque[dict[str, Any]] = deque(maxlen=64)
        self.cur_refs: deque[dict[str, Any]] = deque(maxlen=64)
        self.topology = asyncio.Lock()
        self.faults_paused = False
        self.fault_active = 0
        self.fault_idle = asyncio.Event()
        self.fault_idle.set()
        self.resume = asyncio.Event()
        self.paused = asyncio.Event()
        self.no_pending = asyncio.Event()
        self.no_pending.set()
        self.t_start = 0.0
        self.run_elapsed = 0.0
        self.inst = 0
        self.finals: list[dict[str, Any]] = []
        self.server: asyncio.AbstractServer | None = None
        self.phase = "start"
        self.interrupted = False

    # --- bookkeeping ----------------------------------------------------------------------
    def violation(self, who: str, text: str) -> None:
        self.violations.add(who, text)

    def delivery_for(self, gen: int) -> str:
        d = self.opts.delivery
        if d == "alternate":
            return "broadcast" if gen % 2 else "one_of_n"
        return d

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def live_readers(self) -> list[Child]:
        return [
            c for c in self.readers if c is not None and c.link is not None and not c.eof.is_set()
        ]

    # --- processes ------------------------------------------------------------------------
    async def spawn(self, role: str, spec: dict[str, Any]) -> Child:
        self.inst += 1
        token = f"{role[0]}{self.inst}"
        spec["opts"] = self.opts.child_dict()
        log_path = os.path.join(self.tmp, f"{token}.log")
        with _open_log(log_path) as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "aioshmcache._stress",
                role,
                self.sock,
                token,
                json.dumps(spec),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        child = Child(role, token, proc, log_path)
        child.last_hb = time.monotonic()
        self.children[token] = child
        return child

    async def wait_connected(self, child: Child, within: float = 30.0) -> bool:
        with anyio.move_on_after(within):
            await child.connected.wait()
            return True
        self.violation(child.token, f"{child.role} process did not connect within {within} s")
        await self.hard_kill(child)
        return False

    async def hard_kill(self, child: Child) -> int | None:
        child.killed_by_us = True
        with contextlib.suppress(ProcessLookupError):
            child.proc.send_signal(signal.SIGKILL)
        with anyio.move_on_after(10):
            return await child.proc.wait()
        self.violation(child.token, "a SIGKILLed process did not exit within 10 s")
        return None

    async def start_writer(self, prev: dict[str, Any] | None) -> bool:
        self.writer_gen += 1
        gen = self.writer_gen
        name = f"{self.prefix}g{gen}"
        delivery = self.delivery_for(gen)
        child = await self.spawn("writer", {"gen": gen, "name": name, "delivery": delivery})
        child.gen, child.name = gen, name
        self.writer = child
        if not await self.wait_connected(child):
            return False
        with anyio.move_on_after(30):
            await child.got_handle.wait()
        if child.handle_msg is None:
            self.violation(child.token, "writer did not publish its handle within 30 s")
            await self.hard_kill(child)
            return False
        self.stats[f"writer_gens_{delivery}"] += 1
        msg = dict(child.handle_msg)
        msg["prev"] = prev
        frame = pack(msg)
        for r in self.live_readers():
            r.send_raw(frame)
        return True

    async def start_reader(self, pos: int) -> None:
        child = await self.spawn("reader", {"seed": self.rng.randrange(1 << 30)})
        child.pos = pos
        if await self.wait_connected(child):
            self.stats["readers_started"] += 1

    def register(self, child: Child) -> None:
        """A reader said hello: it receives every request from now on (then the handle)."""
        if child.role == "reader":
            self.readers[child.pos] = child
            w = self.writer
            if w is not None and w.handle_msg is not None and not w.eof.is_set():
                child.send(dict(w.handle_msg, prev=None))

    # --- the socket server ------------------------------------------------------------------
    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(reader, writer)
        child: Child | None = None
        try:
            hello = await link.recv()
            if (
                hello is None
                or hello.get("t") != "hello"
                or hello.get("token") not in self.children
            ):
                await link.close()
                return
            child = self.children[str(hello["token"])]
            child.link = link
            child.last_hb = time.monotonic()
            self.register(child)
            child.connected.set()
            while True:
                got = await read_frame(reader)
                if got is None:
                    break
                msg, raw = got
                child.last_hb = time.monotonic()
                if child.role == "writer":
                    self.on_writer(child, msg, raw)
                else:
                    self.on_reader(child, msg)
        except Exception as exc:
            who = child.token if child is not None else "?"
            self.violation(who, f"harness: bad frame from child: {exc!r}")
        finally:
            if child is not None:
                child.eof.set()
                if child.role == "reader":
                    self.forget_reader(child)
                for fut in child.replies.values():
                    if not fut.done():
                        fut.set_result({"t": "eof"})
            await link.close()

    def on_writer(self, w: Child, msg: dict[str, Any], raw: bytes) -> None:
        kind = msg["t"]
        if kind == "req":
            self.forward(w, msg, raw)
        elif kind == "probe":
            targets = self.live_readers()
            if targets:
                self.rng.choice(targets).send_raw(raw)
                self.probes["sent"] += 1
        elif kind == "hb":
            w.stats = msg["stats"]
            self.writer_stats[w.gen] = w.stats
        elif kind == "handle":
            w.handle_msg = msg
            w.got_handle.set()
        elif kind in ("stopped", "final"):
            if "stats" in msg:
                w.stats = msg["stats"]
                self.writer_stats[w.gen] = w.stats
            fut = w.replies.get(kind)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif kind == "violation":
            self.violation(str(msg["who"]), str(msg["text"]))

    def forward(self, w: Child, msg: dict[str, Any], raw: bytes) -> None:
        gen, rid = int(msg["gen"]), int(msg["rid"])
        self.stats["requests"] += 1
        self.stats["features"] += len(msg["f"])
        for f in msg["f"]:
            if f[1] is not None:
                self.cur_refs.append(f[1])
        readers = self.live_readers()
        if self.delivery_for(gen) == "one_of_n" and readers:
            readers = [self.rng.choice(readers)]
        waiting = set()
        for r in readers:
            r.send_raw(raw)
            self.stats["deliveries"] += 1
            if not r.stopped:
                waiting.add(r.token)
        if waiting:
            self.pending[(gen, rid)] = waiting
            self.no_pending.clear()
        else:
            self.credit(gen)

    def credit(self, gen: int) -> None:
        w = self.writer
        if w is not None and w.gen == gen and not w.eof.is_set():
            w.send({"t": "credit", "n": 1})

    def resolve(self, token: str, key: tuple[int, int]) -> None:
        waiting = self.pending.get(key)
        if waiting is None:
            return
        waiting.discard(token)
        if not waiting:
            del self.pending[key]
            self.credit(key[0])
            if not self.pending:
                self.no_pending.set()

    def write_off(self, token: str) -> None:
        for key in list(self.pending):
            self.resolve(token, key)

    def forget_reader(self, child: Child) -> None:
        self.write_off(child.token)

    def on_reader(self, r: Child, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "done":
            res = str(msg["r"])
            self.stats["reads"] += 1
            self.stats[f"read_{res}"] += 1
            self.stats["items_verified"] += int(msg.get("n", 0))
            self.stats["bytes_verified"] += int(msg.get("b", 0))
            if res == "miss":
                self.errors["CacheMissError (stale genuine refs)"] += int(msg.get("stale", 0))
                for why, n in dict(msg.get("why", {})).items():
                    self.stats["stale_explained"] += int(n)
                    self.stats[f"stale_explained_{why}"] += int(n)
            elif res in ("ReaderEvictedError", "WriterGoneError"):
                self.errors[res] += 1
                if res == "WriterGoneError":
                    self.wgone_gens.add(int(msg["gen"]))
            self.resolve(r.token, (int(msg["gen"]), int(msg["rid"])))
        elif kind == "probe_done":
            res = str(msg["r"])
            self.probes[f"{msg['kind']}:{res}"] += 1
            self.probes["answered"] += 1
            if res == "skip":
                self.probes["skipped"] += 1
        elif kind == "err":
            self.errors[f"{msg['kind']} ({msg['where']})"] += 1
            if msg.get("text"):
                self.err_texts[f"{msg['kind']} ({msg['where']})"] = str(msg["text"])
            w = self.writer
            if (
                msg["kind"] == "SegmentNotFoundError"
                and w is not None
                and int(msg["gen"]) == w.gen
                and w.proc.returncode is None
                and not w.killed_by_us
                and not _segment_files(w.name)
            ):
                self.violation(
                    "environment",
                    f"the live writer's segment {w.name} was unlinked by another process "
                    "(someone's /dev/shm cleanup or a buggy sweep); rerun with --private-shm",
                )
            if msg["kind"] == "WriterGoneError":
                self.wgone_gens.add(int(msg["gen"]))
        elif kind == "attached":
            r.attached_gen = int(msg["gen"])
        elif kind == "hb":
            r.stats = msg
        elif kind == "synced":
            fut = r.replies.get(str(msg["token"]))
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif kind == "violation":
            self.violation(str(msg["who"]), str(msg["text"]))

    async def ask(
        self, child: Child, msg: dict[str, Any], reply: str, within: float
    ) -> dict[str, Any] | None:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        child.replies[reply] = fut
        child.send(msg)
        try:
            with anyio.move_on_after(within):
                got = await fut
                return None if got.get("t") == "eof" else got
            return None
        finally:
            child.replies.pop(reply, None)

    # --- faults -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def fault_action(self) -> Any:
        self.fault_active += 1
        self.fault_idle.clear()
        try:
            yield
        finally:
            self.fault_active -= 1
            if not self.fault_active:
                self.fault_idle.set()

    async def fault_sleep(self, mean: float) -> bool:
        """Sleep ~``mean`` seconds (exponential); False once the run is over."""
        await asyncio.sleep(self.rng.uniform(0.5, 1.5) * mean if mean > 0 else 1.0)
        while self.faults_paused and not self.done_running():
            await self.resume.wait()
        return not self.done_running()

    def done_running(self) -> bool:
        return self.phase != "run"

    def pick_reader(self) -> Child | None:
        cands = [c for c in self.live_readers() if not c.busy and not c.stopped]
        return self.rng.choice(cands) if cands else None

    async def kill_readers_loop(self) -> None:
        while await self.fault_sleep(self.opts.reader_kill_every):
            async with self.fault_action():
                if self.faults_paused:
                    continue
                c = self.pick_reader()
                if c is None:
                    continue
                c.busy = True
                c.killed_by_us = True
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGKILL)
                with anyio.move_on_after(10):
                    await c.proc.wait()
                    await c.eof.wait()
                self.stats["reader_kills"] += 1
                self.write_off(c.token)
                if self.readers[c.pos] is c:
                    self.readers[c.pos] = None
                await self.start_reader(c.pos)

    async def stop_readers_loop(self) -> None:
        evict = self.opts.evict_after
        while await self.fault_sleep(self.opts.reader_stop_every):
            async with self.fault_action():
                if self.faults_paused:
                    continue
                c = self.pick_reader()
                if c is None:
                    continue
                c.busy = True
                top = 2 * evict if evict > 0 else 2.0
                dur = self.rng.uniform(0.3, min(top, self.opts.hang_timeout / 3))
                c.stopped = True
                self.write_off(c.token)
                try:
                    c.proc.send_signal(signal.SIGSTOP)
                    self.stats["reader_stops"] += 1
                    with anyio.move_on_after(dur):
                        await self.until_paused()
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.send_signal(signal.SIGCONT)
                    c.last_hb = time.monotonic()
                    c.stopped = False
                    c.busy = False

    async def until_paused(self) -> None:
        await self.paused.wait()

    async def kill_writer_loop(self) -> None:
        while await self.fault_sleep(self.opts.writer_kill_every):
            async with self.fault_action():
                if self.faults_paused:
                    continue
                await self.kill_writer()

    async def kill_writer(self) -> None:
        async with self.topology:
            w = self.writer
            if w is None:
                return
            w.killed_by_us = True
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGKILL)
            with anyio.move_on_after(10):
                await w.proc.wait()
                await w.eof.wait()
            dead_at = time.monotonic()
            self.stats["writer_kills"] += 1
            self.dead_gens[w.gen] = "killed"
            for key in [k for k in self.pending if k[0] == w.gen]:
                del self.pending[key]
            if not self.pending:
                self.no_pending.set()
            self.old_refs.extend(self.cur_refs)
            self.cur_refs.clear()
            self.sweep_dead(w)
            await self.start_writer({"gen": w.gen, "dead_at": dead_at, "how": "killed"})
            if "forge" in self.opts.faults:
                self.probe_old_refs()

    def sweep_dead(self, w: Child) -> None:
        """The dead writer's segment must be an orphan to ``sweep``; remove ours only."""
        alone = bool(os.environ.get(IN_PRIVATE_SHM))
        candidates = sweep(dry_run=not alone)
        mine = [n for n in candidates if n.startswith((self.prefix, "sem." + self.prefix))]
        if w.name not in candidates:
            if w.name in _segment_files(w.name):
                self.violation("sweep", f"sweep does not list the dead writer's segment {w.name}")
            else:  # another process on this machine ran sweep() first: fine
                self.stats["swept_by_others"] += 1
        for n in mine:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, n))
            self.stats["swept"] += 1
        left = _segment_files(w.name)
        if left:
            self.violation("sweep", f"left after sweeping the dead writer: {left}")

    def probe_old_refs(self) -> None:
        """References of a dead writer, shown to the new one: InvalidReferenceError (nonce)."""
        w = self.writer
        if w is None:
            return
        readers = self.live_readers()
        for ref in list(self.old_refs)[-8:]:
            if not readers:
                break
            self.rng.choice(readers).send(
                {
                    "t": "probe",
                    "gen": w.gen,
                    "kind": "old_writer",
                    "via": "features",
                    "h": "old",
                    "ref": ref,
                    "expect": ["InvalidReferenceError"],
                }
            )
            self.probes["sent"] += 1
        self.old_refs.clear()

    async def pause_faults(self) -> None:
        self.faults_paused = True
        self.paused.set()
        self.resume.clear()
        with anyio.move_on_after(self.opts.hang_timeout + 30):
            await self.fault_idle.wait()
            return
        self.violation("harness", "fault actions did not finish")

    def resume_faults(self) -> None:
        self.faults_paused = False
        self.paused.clear()
        self.resume.set()

    # --- watchdog and progress --------------------------------------------------------------
    async def watchdog(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for c in list(self.children.values()):
                if c.eof.is_set() or c.stopped or c.killed_by_us or c.link is None:
                    continue
                if c.proc.returncode is not None:
                    continue
                if now - c.last_hb > self.opts.hang_timeout:
                    self.violation(
                        c.token, f"{c.role} pid {c.pid} silent for {now - c.last_hb:.1f} s (hang)"
                    )
                    c.last_hb = now
                    await self.hard_kill(c)
            for c in list(self.children.values()):
                rc = c.proc.returncode
                if rc is not None and not c.killed_by_us and not c.rc_seen:
                    c.rc_seen = True
                    if rc != 0 and self.phase != "exit":
                        self.violation(c.token, f"{c.role} exited with {rc}: {self.log_tail(c)}")

    def log_tail(self, c: Child, n: int = 1200) -> str:
        try:
            with open(c.log_path, "rb") as f:
                data = f.read()
        except OSError:
            return ""
        return data[-n:].decode(errors="replace").strip()

    def writer_totals(self) -> Counter[str]:
        tot: Counter[str] = Counter()
        for s in self.writer_stats.values():
            for k, v in s.items():
                if isinstance(v, int) and not isinstance(v, bool) and not k.startswith("lag"):
                    tot[k] += v
        return tot

    def progress_line(self) -> str:
        st, er = self.stats, self.errors
        wt = self.writer_totals()
        el = self.elapsed()
        total = self.opts.duration
        hits, misses = wt.get("hits", 0), wt.get("misses", 0)
        hr = hits / (hits + misses) if hits + misses else 0.0
        lim = f"/{total:.0f}s" if total else f" ops {st['requests']}/{self.opts.ops}"
        wgone = sum(v for k, v in er.items() if k.startswith("WriterGoneError"))
        return (
            f"[{el:6.1f}s{lim}] g{self.writer_gen} {self.delivery_for(self.writer_gen)} "
            f"readers {len(self.live_readers())}/{self.opts.readers} | req {st['requests']} "
            f"({st['requests'] / max(el, 1e-9):.0f}/s) verified {st['items_verified']} "
            f"{_fmt_bytes(st['bytes_verified'])} hit {hr:.0%} evict {wt.get('evictions', 0)} "
            f"inline {wt.get('inline', 0)} | kills r{st['reader_kills']} w{st['writer_kills']} "
            f"stops {st['reader_stops']} wgone {wgone} revoked {er['ReaderEvictedError']} "
            f"miss {er['CacheMissError (stale genuine refs)']} probes {self.probes['answered']} "
            f"| violations {len(self.violations)}"
        )

    async def progress(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if not self.opts.quiet:
                print(self.progress_line(), file=sys.stderr, flush=True)

    # --- quiescence and checks --------------------------------------------------------------
    async def ensure_readers(self) -> None:
        for pos, c in enumerate(self.readers):
            if c is None or c.eof.is_set():
                await self.start_reader(pos)

    async def quiesce_and_check(self, why: str) -> None:
        """No faults, writer stopped, every request read, then the drain check."""
        w = self.writer
        if w is None or w.eof.is_set():
            return
        await self.ensure_readers()
        got = await self.ask(w, {"t": "stop"}, "stopped", self.opts.op_deadline + 20)
        if got is None:
            self.violation(w.token, f"{why}: the writer did not stop")
            return
        with anyio.move_on_after(60) as sc:
            await self.no_pending.wait()
        if sc.cancelled_caught:
            self.violation(
                "quiesce", f"{why}: {len(self.pending)} requests never reported by readers"
            )
            self.pending.clear()
            self.no_pending.set()
        for c in self.live_readers():
            tok = secrets.token_hex(4)
            got = await self.ask(c, {"t": "sync", "token": tok}, tok, 60)
            if got is None:
                self.violation(c.token, f"{why}: reader did not catch up (sync)")
            elif not got.get("attached") or int(got["gen"]) != w.gen:
                self.violation(c.token, f"{why}: reader not attached to g{w.gen} at quiescence")
        within = 5.0
        if self.delivery_for(w.gen) == "one_of_n":
            within += self.opts.handout_ttl
        final = await self.ask(w, {"t": "check", "within": within}, "final", within + 30)
        if final is None:
            self.violation(w.token, f"{why}: the writer did not answer the drain check")
            return
        final["why"] = why
        self.finals.append(final)
        if final.get("n_not_freeable"):
            self.violation(
                w.token,
                f"{why}: cache does not drain: {final['n_not_freeable']} of {final['items']} items "
                f"never freeable (e.g. {final['not_freeable'][:5]}); slots {final['slots']}",
            )
        elif final.get("after_items") or final.get("after_bytes"):
            self.violation(
                w.token,
                f"{why}: after freeing everything the ring still holds {final['after_items']} "
                f"items / {final['after_bytes']} bytes",
            )

    async def close_writer(self, why: str) -> float:
        w = self.writer
        if w is None:
            return time.monotonic()
        w.send({"t": "exit"})
        rc = None
        with anyio.move_on_after(30):
            rc = await w.proc.wait()
        closed_at = time.monotonic()
        if rc is None:
            self.violation(w.token, f"{why}: writer did not exit within 30 s")
            await self.hard_kill(w)
        elif rc != 0:
            self.violation(w.token, f"{why}: writer exited with {rc}: {self.log_tail(w)}")
        w.killed_by_us = True
        self.dead_gens[w.gen] = "closed"
        left = _segment_files(w.name)
        if left:
            self.violation(w.token, f"{why}: aclose left {left} in {SHM_DIR}")
        return closed_at

    async def rotate_writer(self) -> None:
        async with self.topology:
            await self.quiesce_and_check("rotation")
            w = self.writer
            closed_at = await self.close_writer("rotation")
            self.stats["writer_rotations"] += 1
            if w is not None:
                self.old_refs.extend(self.cur_refs)
                self.cur_refs.clear()
                await self.start_writer({"gen": w.gen, "dead_at": closed_at, "how": "closed"})
                if "forge" in self.opts.faults:
                    self.probe_old_refs()

    # --- the run ------------------------------------------------------------------------------
    def interrupt(self, task: asyncio.Task[Any]) -> None:
        """SIGINT / SIGTERM: stop the run, then clean up as usual (a second signal is ignored)."""
        if not self.interrupted:
            self.interrupted = True
            task.cancel()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        if me is not None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self.interrupt, me)
        self.server = await asyncio.start_unix_server(self.serve, path=_sock_path(self.sock))
        bg: list[asyncio.Task[None]] = [
            asyncio.ensure_future(self.watchdog()),
            asyncio.ensure_future(self.progress()),
        ]
        faults: list[asyncio.Task[None]] = []
        try:
            self.t_start = time.monotonic()
            if await self.start_writer(None):
                await self.body(faults)
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
            self.run_elapsed = self.run_elapsed or self.elapsed()
        finally:
            for t in faults + bg:
                t.cancel()
            await asyncio.gather(*faults, *bg, return_exceptions=True)
            await self.kill_all()
            self.server.close()
            with anyio.move_on_after(5):
                await self.server.wait_closed()
        return self.finish()

    async def body(self, faults: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*(self.start_reader(i) for i in range(self.opts.readers)))
        self.phase = "run"
        f = self.opts.faults
        if "kill-readers" in f:
            faults.append(asyncio.ensure_future(self.kill_readers_loop()))
        if "stop-readers" in f:
            faults.append(asyncio.ensure_future(self.stop_readers_loop()))
        if "kill-writer" in f:
            faults.append(asyncio.ensure_future(self.kill_writer_loop()))
        await self.main_phase()
        self.run_elapsed = self.elapsed()
        self.phase = "quiesce"
        self.resume.set()
        await self.pause_faults()
        for t in faults:
            t.cancel()
        await asyncio.gather(*faults, return_exceptions=True)
        async with self.topology:
            await self.quiesce_and_check("end of run")
        self.phase = "exit"
        await self.shutdown_children()

    async def main_phase(self) -> None:
        o = self.opts
        rotate_at: float | None = None
        rotate_ops: int | None = None
        if o.delivery == "alternate":  # both modes in every run, and a mid-run drain check
            if o.duration:
                rotate_at = o.duration / 2
            elif o.ops:
                rotate_ops = o.ops // 2
        while True:
            await asyncio.sleep(0.05)
            if o.duration is not None and self.elapsed() >= o.duration:
                return
            if o.ops is not None and self.stats["requests"] >= o.ops:
                return
            due = (rotate_at is not None and self.elapsed() >= rotate_at) or (
                rotate_ops is not None and self.stats["requests"] >= rotate_ops
            )
            if due:
                rotate_at = rotate_ops = None
                await self.pause_faults()
                await self.rotate_writer()
                self.resume_faults()

    async def shutdown_children(self) -> None:
        for c in self.live_readers():
            c.send({"t": "exit"})
        for c in list(self.children.values()):
            if c.role != "reader" or (c.proc.returncode is not None and c.killed_by_us):
                continue
            rc = None
            with anyio.move_on_after(30):
                rc = await c.proc.wait()
            if rc is None:
                self.violation(c.token, "reader did not exit within 30 s of 'exit'")
                await self.hard_kill(c)
            elif rc != 0 and not c.killed_by_us:
                self.violation(c.token, f"reader exited with {rc}: {self.log_tail(c)}")
        w = self.writer
        if w is not None and not w.eof.is_set():
            await self.close_writer("end of run")

    async def kill_all(self) -> None:
        for c in self.children.values():
            if c.proc.returncode is None:
                c.killed_by_us = True
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGCONT)
                    c.proc.send_signal(signal.SIGKILL)
        for c in self.children.values():
            with anyio.move_on_after(10):
                await c.proc.wait()

    # --- the final report ---------------------------------------------------------------------
    def leftovers(self) -> list[str]:
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            return []
        mine = (self.prefix, "sem." + self.prefix)
        if os.environ.get(IN_PRIVATE_SHM):  # alone in this /dev/shm: anything of ours counts
            mine = (SEGMENT_PREFIX, "sem." + SEGMENT_PREFIX)
        return sorted(n for n in names if n.startswith(mine))

    @staticmethod
    def child_pids() -> list[int]:
        """Live (non-zombie) processes whose parent is this one, from /proc/*/stat."""
        me, pids = os.getpid(), []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2 :].split()
            if len(fields) > 1 and int(fields[1]) == me and fields[0] != b"Z":
                pids.append(int(d))
        return pids

    def finish(self) -> int:
        left = self.leftovers()
        if left and not self.interrupted:  # an interrupted run killed its writer: orphans
            self.violation("end", f"left in {SHM_DIR}: {left}")
        if left:
            for n in left:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, n))
        kids = self.child_pids()
        if kids:
            self.violation("end", f"child processes left: {kids}")
        stray = self.wgone_gens - set(self.dead_gens)
        if stray and not self.interrupted:
            self.violation("end", f"WriterGoneError for live writer generations {sorted(stray)}")
        for _gen, how in sorted(self.dead_gens.items()):
            self.stats[f"dead_gen_{how}"] += 1
        report = self.summary()
        print(report, file=sys.stderr if self.opts.quiet else sys.stdout, flush=True)
        if not self.opts.quiet:
            pass
        if self.opts.json_path:
            with open(self.opts.json_path, "w") as f:
                json.dump(self.as_json(), f, indent=1, sort_keys=True, default=str)
        failed = len(self.violations) > 0
        if not failed and not self.opts.keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)
        elif failed:
            print(f"children's logs kept in {self.tmp}", file=sys.stderr)
        if self.interrupted:
            return 2
        return 1 if failed else 0

    def as_json(self) -> dict[str, Any]:
        return {
            "options": self.opts.child_dict(),
            "elapsed": self.run_elapsed,
            "stats": dict(self.stats),
            "errors": dict(self.errors),
            "error_texts": self.err_texts,
            "probes": dict(self.probes),
            "writer": dict(self.writer_totals()),
            "writer_lag_max": max(
                (s.get("lag_max", 0.0) for s in self.writer_stats.values()), default=0.0
            ),
            "finals": self.finals,
            "violations": self.violations.items,
            "violation_count": len(self.violations),
            "dead_gens": self.dead_gens,
        }

    def summary(self) -> str:
        o, st, er, wt = self.opts, self.stats, self.errors, self.writer_totals()
        el = max(self.run_elapsed, 1e-9)
        lag = max((s.get("lag_max", 0.0) for s in self.writer_stats.values()), default=0.0)
        op_max = max((s.get("op_max", 0.0) for s in self.writer_stats.values()), default=0.0)
        hits, misses = wt.get("hits", 0), wt.get("misses", 0)
        rows: list[tuple[str, str, str]] = []

        def row(name: str, value: float | str, rate: bool = False) -> None:
            if isinstance(value, str):
                rows.append((name, value, ""))
            else:
                rows.append((name, f"{value:,.0f}", f"{value / el:,.1f}/s" if rate else ""))

        row("writer requests", st["requests"], True)
        row("  features", st["features"], True)
        row("  hits / misses", f"{hits:,} / {misses:,} ({hits / max(hits + misses, 1):.1%} hit)")
        row("  handed out (refs)", wt.get("refs", 0), True)
        row(
            "  inline: full / too large / busy",
            f"{wt.get('inline_full', 0):,} / "
            f"{wt.get('inline_too_large', 0):,} / {wt.get('inline_busy', 0):,}",
        )
        row("  sender CacheMissError resends", wt.get("sender_cache_miss", 0))
        row("  evictions", wt.get("evictions", 0), True)
        row(
            "  cancelled (Task.cancel / move_on_after)",
            f"{wt.get('cancelled_task', 0):,} / {wt.get('cancelled_scope', 0):,}"
            f" (+{wt.get('cancel_too_late', 0):,} completed first)",
        )
        row("reader requests", st["reads"], True)
        row("  items verified (crc32)", st["items_verified"], True)
        row(
            "  bytes verified",
            f"{_fmt_bytes(st['bytes_verified'])} ({st['bytes_verified'] / el / 2**20:,.0f} MiB/s)",
        )
        row(
            "  cancelled (Task.cancel / move_on_after)",
            f"{st['read_cancelled_task']:,} / {st['read_cancelled_scope']:,}",
        )
        row("  skipped (writer gone)", st["read_skip"])
        row("faults: reader SIGKILL / SIGSTOP", f"{st['reader_kills']:,} / {st['reader_stops']:,}")
        row(
            "faults: writer SIGKILL / rotations",
            f"{st['writer_kills']:,} / {st['writer_rotations']:,}",
        )
        gens = ", ".join(
            f"{k[12:]} {v}" for k, v in sorted(st.items()) if k.startswith("writer_gens_")
        )
        row("writer generations", f"{self.writer_gen} ({gens})")
        for k, v in sorted(er.items()):
            row(f"error {k}", v)
        causes = ", ".join(
            f"{k[16:]} {v:,}" for k, v in sorted(st.items()) if k.startswith("stale_explained_")
        )
        row("  stale genuine refs explained", f"{st['stale_explained']:,} ({causes or '-'})")
        probe_ok = sum(
            v for k, v in self.probes.items() if ":" in k and not k.endswith((":skip", ":DATA"))
        )
        row(
            "forged/stale probes sent / answered",
            f"{self.probes['sent']:,} / {self.probes['answered']:,}",
        )
        row("  rejected with a typed error / skipped", f"{probe_ok:,} / {self.probes['skipped']:,}")
        by_exc: Counter[str] = Counter()
        for k, v in self.probes.items():
            if ":" in k:
                by_exc[k.split(":", 1)[1]] += v
        row("  by outcome", ", ".join(f"{k} {v}" for k, v in sorted(by_exc.items())) or "-")
        row("writer loop lag max / slowest op", f"{lag * 1000:.0f} ms / {op_max:.2f} s")
        drains = ", ".join(
            f"{f['why']}: {f.get('items', '?')} items, {f.get('n_not_freeable', '?')} stuck"
            for f in self.finals
        )
        row("drain checks", drains or "-")
        row("violations", len(self.violations))
        w1 = max(len(r[0]) for r in rows)
        w2 = max([len(r[1]) for r in rows if r[2] or r[1][:1].isdigit()] + [8])
        faults = ",".join(sorted(o.faults)) or "none"
        lim = f"{self.run_elapsed:.1f} s" + (f" (ops limit {o.ops})" if o.ops else "")
        head = (
            f"aioshmcache stress: {lim}, delivery {o.delivery}, {o.readers} readers x "
            f"{o.reader_concurrency}, {o.writers} writer tasks, ring {_fmt_bytes(o.capacity)},\n"
            f"  items {_fmt_bytes(o.min_item)}..{_fmt_bytes(o.max_item)}, faults {faults}, "
            f"seed {o.seed}"
        )
        lines = [head, "-" * (w1 + w2 + 14)]
        for a, b, c in rows:
            numeric = bool(c) or b.replace(",", "").isdigit()
            lines.append((f"{a:<{w1}}  {b:>{w2}}  {c}" if numeric else f"{a:<{w1}}  {b}").rstrip())
        if self.violations.items:
            lines.append("")
            lines.append(f"VIOLATIONS ({len(self.violations)}):")
            for k, v in self.violations.counts.most_common():
                lines.append(f"  {v:5d} x {k}")
            lines.append("first ones in full:")
            lines += [f"  - {t}" for t in self.violations.items[:30]]
        verdict = "FAIL" if self.violations.items else "OK"
        lines.append(
            "RESULT: " + (f"INTERRUPTED ({verdict} so far)" if self.interrupted else verdict)
        )
        return "\n".join(lines)


def _run_in_private_shm(size: int, argv: list[str]) -> int:
    """Re-run this command in a new mount namespace with its own tmpfs on /dev/shm."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        print("--private-shm needs root and unshare(1)", file=sys.stderr)
        return 2
    script = 'mount -t tmpfs -o size="$0" tmpfs /dev/shm && exec "$@"'
    cmd = [unshare, "-m", "--propagation", "private", "sh", "-c", script, str(size)]
    cmd += [sys.executable, "-m", "aioshmcache", "stress", *argv]
    env = dict(os.environ, **{IN_PRIVATE_SHM: "1"})
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 2


def main(argv: list[str]) -> int:
    """``python -m aioshmcache stress [options]``; exit 0 clean, 1 violations, 2 usage/harness."""
    try:
        opts = _parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    if opts.private_shm and not os.environ.get(IN_PRIVATE_SHM):
        return _run_in_private_shm(opts.private_shm, argv)
    orch = Orchestrator(opts)
    try:
        if opts.loop == "uvloop":
            import uvloop

            return int(uvloop.run(orch.run()))
        return asyncio.run(orch.run())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print(f"harness failure; logs in {orch.tmp}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))

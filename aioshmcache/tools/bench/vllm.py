"""The ``vllm`` suite: vLLM's own ``shm_object_storage.py`` side by side with aioshmcache.

Runs only when asked for (``--suite vllm``) and when vLLM's store can be had: from an installed
``vllm``, or from the file named by ``--vllm-file PATH`` (``pip download vllm==0.33.0 --no-deps``,
then unzip ``vllm/distributed/device_communicators/shm_object_storage.py``); it is never
vendored. Loaded from a file, its imports are stood in for: ``init_logger`` (a plain logger),
``torch.Tensor`` (numpy arrays, without torch) and the msgpack tensor encoder / decoder (a
header plus the raw bytes, decoded as a copy: ``share_mem=False``, as its caches use it).

Both stores are used as their caches use them: vLLM's sender puts and signs the handle
(HMAC-SHA256), its receiver verifies and reads with its reader lock; ours is
``ShmObjectStore.put`` / ``SenderCache.get_and_update_item`` against the reader store and a
``ReceiverCache``. Readers are in this process; every round runs each subject in turn, with a
rotating ``np.copyto`` into warm shared memory as the limit. Times are this thread's CPU time
(``time.thread_time``: what the call costs, not how long the machine's other programs held the
CPU).

The report is the compiled-core issue's table (``ISSUE_CELLS``): each cell is OUR time ÷ vLLM's
(or ÷ the copy's) in the same run, so below 1 we are faster, and its target is the issue's goal
(``ratio ≤ goal``). This is the reverse of the other suites' ratios (baseline ÷ subject): the
section title says so, and the table block repeats it in its column name.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import logging
import math
import multiprocessing
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from aioshmcache import ReceiverCache, SenderCache, ShmObjectStore
from aioshmcache.store import StoreReader, StoreWriter

from ..progress import Progress
from ..units import KiB, MiB, fmt_bytes
from . import timing as tm
from .params import Params, bench_config, segment_prefix
from .report import Report, Target, md_table
from .vllm_shapes import image_updates

__all__ = ["ISSUE_CELLS", "VLLM_MODULE", "IssueCell", "load_vllm_store", "run_vllm_suite"]

VLLM_MODULE = "vllm.distributed.device_communicators.shm_object_storage"
S_TIMES = "vLLM suite: every subject's time per operation (in-process readers)"

_names = itertools.count()
#: every subject runs in this thread (readers too), so its time is this thread's CPU time: on a
#: shared machine, time spent descheduled is not the call's (wall time moved 1 KiB cells by 3x
#: between rounds here, CPU time by a few percent)
_clock = time.thread_time


# --- stand-ins for the file's imports ---------------------------------------------------------


def _as_tensor(arr: np.ndarray[Any, Any]) -> Any:
    """What vLLM's sender cache stores: a tensor (a numpy array where torch stands in)."""
    torch = sys.modules.get("torch")
    return arr if torch is None or torch.Tensor is np.ndarray else torch.from_numpy(arr)


class _TensorEncoder:
    """``vllm.v1.serial_utils.MsgpackEncoder``'s tensor path: a header and the raw buffer."""

    def encode(self, value: Any) -> list[Any]:
        arr = value if isinstance(value, np.ndarray) else value.numpy()
        arr = np.ascontiguousarray(arr)
        header = msgpack.packb((arr.dtype.str, arr.shape))
        return [header, arr.reshape(-1).view(np.uint8).data]


class _TensorDecoder:
    """``MsgpackDecoder(torch.Tensor, share_mem=False)``: a copy out of shared memory."""

    def __init__(self, t: Any = None, share_mem: bool = True) -> None:
        self.share_mem = share_mem

    def decode(self, bufs: list[Any]) -> Any:
        dtype, shape = msgpack.unpackb(bytes(bufs[0]))
        arr = np.frombuffer(bufs[1], dtype=np.dtype(dtype)).reshape(shape)
        return _as_tensor(arr if self.share_mem else arr.copy())


def _stand_ins() -> dict[str, types.ModuleType]:
    """The modules the file imports, for those not importable here."""
    serde = {"MsgpackEncoder": _TensorEncoder, "MsgpackDecoder": _TensorDecoder}
    members: dict[str, dict[str, Any]] = {"vllm": {}, "vllm.multimodal": {}, "vllm.v1": {}}
    members |= {"vllm.logger": {"init_logger": logging.getLogger}, "vllm.v1.serial_utils": serde}
    item = type("MultiModalKwargsItem", (), {})  # the file imports it; no call made here uses it
    members["vllm.multimodal.inputs"] = {"MultiModalKwargsItem": item}
    # (a stand-in of an earlier load is in ``sys.modules`` without a spec: find_spec would raise)
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        members["torch"] = {"Tensor": np.ndarray}
    mods = {name: types.ModuleType(name) for name in members}
    for name, attrs in members.items():
        vars(mods[name]).update(attrs)
    return mods


def load_vllm_store(path: Path | None) -> types.ModuleType | None:
    """vLLM's ``shm_object_storage`` module: from ``path``, else from an installed vLLM.

    ``None`` when no path is given and vLLM is not importable (the suite is skipped);
    ``FileNotFoundError`` / ``ValueError`` for a path that is missing or not that file. Loaded
    from a file, the stand-ins of its imports stay in ``sys.modules`` (its serde imports them
    when a store is made).
    """
    if path is None:
        try:
            return importlib.import_module(VLLM_MODULE)
        except ImportError:
            return None
    if not path.is_file():
        raise FileNotFoundError(f"--vllm-file {path}: no such file")
    for name, mod in _stand_ins().items():
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = mod
    spec = importlib.util.spec_from_file_location("_vllm_shm_object_storage", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--vllm-file {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for needed in ("SingleWriterShmRingBuffer", "SingleWriterShmObjectStorage"):
        if not hasattr(module, needed):
            raise ValueError(f"--vllm-file {path}: no {needed} (not vLLM's shm_object_storage.py)")
    return module


# --- the two stores as their caches use them ------------------------------------------------


@dataclass
class _Stores:
    """vLLM's writer store and a reader of it; ours: a writer store, a sender cache, readers."""

    vllm_writer: Any
    vllm_reader: Any
    sender: SenderCache
    writer: StoreWriter
    receiver: ReceiverCache
    reader: StoreReader

    def vllm_put(self, key: str, value: Any) -> tuple[str, Any]:
        """Its sender cache's put: store, then sign the handle (freeing as it does on full)."""
        address, mid = self.vllm_writer.put(key, value)
        return key, (address, mid, self.vllm_writer.get_signature(key))

    def vllm_get(self, kh: tuple[str, Any]) -> Any:
        """Its receiver's verified read (with its reader lock)."""
        address, mid, signature = kh[1]
        return self.vllm_reader.get(address, mid, signature, kh[0])


@contextlib.contextmanager
def _stores(mod: types.ModuleType, capacity: int, max_object: int) -> Iterator[_Stores]:
    with contextlib.ExitStack() as stack:
        name = f"aioshm-{segment_prefix()}vllm{next(_names)}"
        ring = mod.SingleWriterShmRingBuffer(capacity, name=name, create=True)
        # warm, as ours is prefaulted at creation: every page of the ring touched once (the
        # signing secret in its first bytes is left alone)
        np.frombuffer(ring.shared_memory.buf, dtype=np.uint8)[ring.DATA_OFFSET :] = 0
        writer = mod.SingleWriterShmObjectStorage(max_object, 1, ring)
        stack.callback(writer.close)
        handle = writer.handle()
        handle.reader_lock = multiprocessing.Lock()
        reader = mod.SingleWriterShmObjectStorage.create_from_handle(handle)
        stack.callback(reader.close)
        sender = stack.enter_context(SenderCache(bench_config(capacity, max_object)))
        store = stack.enter_context(ShmObjectStore.create(bench_config(capacity, max_object)))
        rx = stack.enter_context(ReceiverCache.attach(sender.handle()))
        rd = stack.enter_context(ShmObjectStore.from_handle(store.handle()))
        yield _Stores(writer, reader, sender, store, rx, rd)


# --- the suite ------------------------------------------------------------------------------


def _batch(
    n: int,
    args: Callable[[], list[Any]],
    op: Callable[[Any], Any],
    kept: list[Any] | None = None,
    *,
    drop: bool = False,
) -> tm.Cell:
    """A cell: ``op`` over a batch of ``args()`` (made untimed); one sample, the time per op.

    The results are kept until the batch ends; ``kept`` receives them for the reads of the next
    cell. A batch of big reads kept alive is new memory for vLLM's copies (numpy's allocation:
    glibc gives the freed batch back to the kernel, so each copy faults its pages in), but not
    all of it for ours: our reader maps a big copy's pages itself and keeps up to 16 freed
    mappings (64 MiB) for the next reads, so the first 64 MiB of each batch land in warm pages
    (every copy of a 16 MiB batch of 4, 16 of a 1 MiB batch of 63). With ``drop`` each result
    is dropped before the next call: both sides' copies then land in warm pages (glibc reuses
    the freed block, ours the freed mapping).
    """

    def cell(out: list[float]) -> None:
        batch = args()
        if drop:
            t0 = _clock()
            for a in batch:
                op(a)
            out.append((_clock() - t0) / n)
            return
        t0 = _clock()
        results = [op(a) for a in batch]
        out.append((_clock() - t0) / n)
        if kept is not None:
            kept[:] = results

    return cell


def _batch_size(size: int, quick: bool) -> int:
    """Items per round of one size: as many as fill about 64 MiB, 4 to 256 (fewer when quick)."""
    batch = max(4, min(256, (256 * MiB) // (size + 4 * KiB) // 4))
    return max(2, batch // 8) if quick else batch


def _cells(st: _Stores, src: Any, n: int, target: tm.ShmBuffer, span: int) -> dict[str, tm.Cell]:
    """Every subject of one item size, in the order each round runs them."""
    item, tensor, size = {"data": src}, _as_tensor(src), len(src)
    keys, slots = itertools.count(), itertools.count()
    v: list[Any] = []
    s: list[Any] = []
    c: list[Any] = []

    def new(prefix: str) -> Callable[[], list[str]]:
        return lambda: [f"{prefix}{next(keys)}" for _ in range(n)]

    def places() -> list[Any]:
        return [target.rotating(size, next(slots), span=span) for _ in range(n)]

    def reads() -> list[Any]:  # the same places every round
        return [target.rotating(size, i, span=span) for i in range(n)]

    def cached(k: str) -> tuple[str, Any]:
        return k, st.sender.get_and_update_item((item, ()), k)[0]

    return {
        "np.copyto": _batch(n, places, lambda dst: np.copyto(dst, src)),
        "copy out": _batch(n, reads, np.copy),
        "vLLM put + sign": _batch(n, new("v"), lambda k: st.vllm_put(k, tensor), v),
        "vLLM get (verify, copy)": _batch(n, lambda: v, st.vllm_get),
        "ours ShmObjectStore.put": _batch(n, new("s"), lambda k: st.writer.put(k, item), s),
        "ours ShmObjectStore.get (reader)": _batch(n, lambda: s, st.reader.get),
        "ours SenderCache.get_and_update_item": _batch(n, new("c"), cached, c),
        "ours ReceiverCache.get_and_update_item": _batch(
            n, lambda: c, lambda kr: st.receiver.get_and_update_item(kr[1], kr[0])
        ),
    }


def _churn(mod: types.ModuleType, rounds: int, n: int) -> dict[str, tm.Stat]:
    """64 MiB rings, 1 MiB items: put then read back (acknowledge) each, lap after lap."""
    src = tm.source_array(1 * MiB)
    item, tensor, keys = {"data": src}, _as_tensor(src), itertools.count()
    with _stores(mod, 64 * MiB, 2 * MiB) as st:

        def vllm_lap(k: str) -> None:
            st.vllm_get(st.vllm_put(k, tensor))

        def ours_lap(k: str) -> None:
            ref, _ = st.sender.get_and_update_item((item, ()), k)
            st.receiver.get_and_update_item(ref, k)

        new = lambda: [f"k{next(keys)}" for _ in range(n)]  # noqa: E731
        cells = {"vllm": _batch(n, new, vllm_lap), "ours": _batch(n, new, ours_lap)}
        return tm.interleave(rounds, cells, warmup=1)


def _with_updates(mod: types.ModuleType, rounds: int, closure: bool) -> dict[str, tm.Stat]:
    """1 KiB items passed with a vLLM-shaped prompt update, put and read back in each round;
    with ``closure``, its ``is_embed`` a closure made per item by vLLM's ``select_token_id``
    (37 of vLLM 0.33's 84 models with prompt updates make them so).

    The table's put cells pass no prompt updates (``()``). vLLM's sender cache keeps a caller's
    updates by reference (``_p0_cache[mm_hash] = mm_item[1]``: one dict store); ours keeps them
    packed (``aioshmcache._kept``), which costs per put. Both sides here: vLLM's put + sign + that
    dict store, our ``SenderCache.get_and_update_item`` miss given the same updates; each round's
    items read back as in the table's cells (vLLM's verified get, our ``ReceiverCache``). Then
    each item is looked up again as a sender cache's hit: vLLM's ``is_cached``, ``get_cached``,
    ``get_signature`` and its ``_p0_cache`` look-up (its ``get_and_update_item`` of a cached
    item, but for the small item object it makes), ours a look-up (``None``) that restores the
    kept updates. Both leave their hand-out owed (vLLM's writer flag raised, ours in the
    ledger); ours are then given back in a cell of their own (``release``), which the table
    leaves out.
    """
    size, n = 1 * KiB, 256
    src = tm.source_array(size)
    item, tensor, keys = {"data": src}, _as_tensor(src), itertools.count()
    kept: dict[str, Any] = {}  # vLLM's ``_p0_cache``
    v: list[Any] = []
    c: list[Any] = []
    hits: list[Any] = []
    with _stores(mod, 2 * n * (size + 4 * KiB) + 8 * MiB, size + 64 * KiB) as st:  # as 1 KiB's

        def new(prefix: str) -> Callable[[], list[tuple[str, Any]]]:
            return lambda: [
                (f"{prefix}{i}", image_updates(i, closure)) for i in itertools.islice(keys, n)
            ]

        def vllm_put(ku: tuple[str, Any]) -> tuple[str, Any]:
            kh = st.vllm_put(ku[0], tensor)
            kept[ku[0]] = ku[1]
            return kh

        def ours_put(ku: tuple[str, Any]) -> tuple[str, Any]:
            return ku[0], st.sender.get_and_update_item((item, ku[1]), ku[0])[0]

        def vllm_hit(kh: tuple[str, Any]) -> Any:
            w = st.vllm_writer
            if w.is_cached(kh[0]):
                address, mid = w.get_cached(kh[0])
                return address, mid, w.get_signature(kh[0]), kept[kh[0]]
            return None

        def ours_hit(kr: tuple[str, Any]) -> Any:
            return st.sender.get_and_update_item(None, kr[0])

        cells = {
            PUT_U: _batch(n, new("v"), vllm_put, v),
            GET: _batch(n, lambda: v, st.vllm_get),
            SENDER_U: _batch(n, new("c"), ours_put, c),
            RECEIVER: _batch(
                n, lambda: c, lambda kr: st.receiver.get_and_update_item(kr[1], kr[0])
            ),
            HIT_U: _batch(n, lambda: v, vllm_hit),
            SENDER_HIT_U: _batch(n, lambda: c, ours_hit, hits),
            RELEASE: _batch(n, lambda: hits, lambda h: st.sender.release(h[0])),
        }
        return tm.interleave(rounds, cells, warmup=1)


def _dropped(mod: types.ModuleType, size: int, rounds: int, n: int) -> dict[str, tm.Stat]:
    """Items of ``size`` put as in the table's cells, then read back one at a time, each copy
    dropped before the next read (``_batch(drop=True)``): the gets with warm destination pages
    on both sides, where the table's get cells give vLLM's copies fresh pages and ours mostly
    warm ones."""
    src = tm.source_array(size)
    item, tensor, keys = {"data": src}, _as_tensor(src), itertools.count()
    v: list[Any] = []
    c: list[Any] = []
    with _stores(mod, 2 * n * (size + 4 * KiB) + 8 * MiB, size + 64 * KiB) as st:

        def new(prefix: str) -> Callable[[], list[str]]:
            return lambda: [f"{prefix}{next(keys)}" for _ in range(n)]

        def cached(k: str) -> tuple[str, Any]:
            return k, st.sender.get_and_update_item((item, ()), k)[0]

        cells = {
            PUT: _batch(n, new("v"), lambda k: st.vllm_put(k, tensor), v),
            GET_DROP: _batch(n, lambda: v, st.vllm_get, drop=True),
            SENDER: _batch(n, new("c"), cached, c),
            RECEIVER_DROP: _batch(
                n, lambda: c, lambda kr: st.receiver.get_and_update_item(kr[1], kr[0]), drop=True
            ),
        }
        return tm.interleave(rounds, cells, warmup=1)


PUT, GET = "vLLM put + sign", "vLLM get (verify, copy)"
GET_DROP = "vLLM get (verify, copy), each copy dropped"
RECEIVER_DROP = "ours ReceiverCache.get_and_update_item, each copy dropped"
PUT_U = "vLLM put + sign, updates kept by reference"
SENDER_U = "ours SenderCache.get_and_update_item, updates packed"
HIT_U = "vLLM look-up (is_cached, get_cached, sign), updates by reference"
SENDER_HIT_U = "ours SenderCache.get_and_update_item look-up, updates restored"
RELEASE = "ours SenderCache.release of each look-up's hand-out"
#: ``by_size`` key of the measurement with prompt updates (0 is the churn's)
UPDATES = -1
#: the same, the update's ``is_embed`` a closure made per item (vLLM's ``select_token_id``)
UPDATES_FN = -2
#: sizes whose gets are also measured with each copy dropped (``by_size`` key: ``-size``)
DROPPED = (1 * MiB, 16 * MiB)
SENDER, RECEIVER = "ours SenderCache.get_and_update_item", "ours ReceiverCache.get_and_update_item"
STORE_PUT, STORE_GET = "ours ShmObjectStore.put", "ours ShmObjectStore.get (reader)"


@dataclass(frozen=True)
class IssueCell:
    """One cell of the compiled-core issue's table: ``ours`` ÷ ``theirs`` (lower is better)."""

    what: str
    size: int  # the item size, or 0 for churn
    ours: str
    theirs: str
    goal: float | None  # the issue's goal: ours ÷ theirs at most this


#: the issue's table, in its order. "put" is the sender cache's miss (a put through
#: ``SenderCache.get_and_update_item``) against vLLM's put + signature, "get" the receiver
#: cache's read against vLLM's verified get; the store's own calls are shown beside them. The
#: last four rows have no goal: the 1 and 16 MiB gets with each copy dropped before the next
#: read (``_dropped``: warm destination pages on both sides, which the get cells above do not
#: give vLLM's copies), and a 1 KiB put and a look-up given a vLLM-shaped prompt update
#: (``_with_updates``: the put cells above pass none).
ISSUE_CELLS = (
    IssueCell("put 1 KiB, SenderCache.get_and_update_item miss", 1 * KiB, SENDER, PUT, 0.3),
    IssueCell("put 1 KiB, ShmObjectStore.put alone", 1 * KiB, STORE_PUT, PUT, None),
    IssueCell("get 1 KiB, ReceiverCache.get_and_update_item", 1 * KiB, RECEIVER, GET, 0.2),
    IssueCell("get 1 KiB, ShmObjectStore.get alone", 1 * KiB, STORE_GET, GET, None),
    IssueCell("put 64 KiB", 64 * KiB, SENDER, PUT, 0.6),
    IssueCell("get 64 KiB", 64 * KiB, RECEIVER, GET, None),
    IssueCell("put 1 MiB", 1 * MiB, SENDER, PUT, 0.6),
    IssueCell("put 1 MiB ÷ a rotating np.copyto", 1 * MiB, SENDER, "np.copyto", 0.8),
    IssueCell("vLLM put 1 MiB ÷ a rotating np.copyto", 1 * MiB, PUT, "np.copyto", None),
    IssueCell("get 1 MiB", 1 * MiB, RECEIVER, GET, 0.9),
    IssueCell("put 16 MiB", 16 * MiB, SENDER, PUT, 0.75),
    IssueCell("put 16 MiB ÷ a rotating np.copyto", 16 * MiB, SENDER, "np.copyto", None),
    IssueCell("get 16 MiB", 16 * MiB, RECEIVER, GET, 0.95),
    IssueCell("churn 1 MiB, reader acknowledging", 0, "ours", "vllm", 0.85),
    IssueCell(
        "get 1 MiB, each copy dropped before the next read", -MiB, RECEIVER_DROP, GET_DROP, None
    ),
    IssueCell(
        "get 16 MiB, each copy dropped before the next read",
        -16 * MiB,
        RECEIVER_DROP,
        GET_DROP,
        None,
    ),
    IssueCell("put 1 KiB with one vLLM-shaped prompt update", UPDATES, SENDER_U, PUT_U, None),
    IssueCell(
        "look-up 1 KiB with one vLLM-shaped prompt update", UPDATES, SENDER_HIT_U, HIT_U, None
    ),
    IssueCell(
        "put 1 KiB with one select_token_id update (a closure per item)",
        UPDATES_FN,
        SENDER_U,
        PUT_U,
        None,
    ),
    IssueCell(
        "look-up 1 KiB with one select_token_id update",
        UPDATES_FN,
        SENDER_HIT_U,
        HIT_U,
        None,
    ),
)
S_ISSUE = (
    "vLLM 0.33 side by side: the compiled-core issue's table (ratio = OUR time ÷ vLLM's or the"
    " copy's: below 1 we are faster; targets are the issue's goals)"
)


def issue_rows(by_size: dict[int, dict[str, tm.Stat]], report: Report) -> list[list[str]]:
    """The issue's cells measured in this run as rows (ratio ours ÷ theirs) and table lines."""
    add = report.section(S_ISSUE)
    lines = []
    for c in ISSUE_CELLS:
        stats = by_size.get(c.size)
        if stats is None:
            continue
        ours, theirs = stats[c.ours], stats[c.theirs]
        ratio = ours.median / theirs.median if theirs.median else math.nan
        tgt = None if c.goal is None else Target("<=", c.goal, "ratio")
        label = c.theirs if c.theirs != "vllm" else "vLLM put + sign + get"
        row = add(c.what, ours, param="", baseline=label, ratio=ratio, target=tgt)
        goal = "" if c.goal is None else f"≤ {c.goal:g}"
        us = f"{ours.median * 1e6:,.1f} µs", f"{theirs.median * 1e6:,.1f} µs"
        lines.append([c.what, *us, f"**{ratio:.2f}**", goal, row.verdict])
    return lines


def _param(size: int) -> str:
    """The times section's param of one ``by_size`` key."""
    if size == UPDATES:
        return "1 KiB, one prompt update"
    if size == UPDATES_FN:
        return "1 KiB, one select_token_id update"
    if size < 0:
        return f"{fmt_bytes(-size)}, copies dropped"
    return fmt_bytes(size) if size else "churn, 1 MiB"


def run_vllm_suite(p: Params, report: Report, progress: Progress) -> None:
    """The suite (skipped, with a line in the report, when vLLM's store is not available)."""
    try:
        mod = load_vllm_store(p.vllm_file)
    except (OSError, ValueError, ImportError) as exc:
        report.skip(f"vllm: {exc}")
        return
    if mod is None:
        report.skip("vllm: not importable and no --vllm-file PATH given")
        return
    by_size: dict[int, dict[str, tm.Stat]] = {}
    for size in p.vllm_sizes:
        batch = _batch_size(size, p.quick)
        progress(f"vllm: {fmt_bytes(size)} x {batch}, {p.vllm_rounds} interleaved rounds")
        cap = 2 * batch * (size + 4 * KiB) + 8 * MiB
        with _stores(mod, cap, size + 64 * KiB) as st, tm.ShmBuffer(cap) as target:
            cells = _cells(st, tm.source_array(size), batch, target, cap)
            by_size[size] = tm.interleave(p.vllm_rounds, cells, warmup=1)  # round 0 warms up
    progress(f"vllm: churn, 1 MiB items through 64 MiB rings ({p.vllm_churn} per round)")
    by_size[0] = _churn(mod, p.vllm_rounds, p.vllm_churn)
    for size in (s for s in p.vllm_sizes if s in DROPPED):
        progress(f"vllm: {fmt_bytes(size)} gets, each copy dropped before the next read")
        by_size[-size] = _dropped(mod, size, p.vllm_rounds, _batch_size(size, p.quick))
    progress("vllm: 1 KiB puts with a vLLM-shaped prompt update")
    by_size[UPDATES] = _with_updates(mod, p.vllm_rounds, False)
    progress("vllm: 1 KiB puts with a select_token_id update (a closure per item)")
    by_size[UPDATES_FN] = _with_updates(mod, p.vllm_rounds, True)
    lines = issue_rows(by_size, report)
    head = ("cell", "ours", "vLLM (or the copy)", "ours ÷ theirs (lower: we win)", "goal", "holds")
    report.blocks.append((S_ISSUE + ": the table", md_table(head, lines)))
    for size, stats in by_size.items():  # every subject's time, as measured
        add = report.section(S_TIMES, _param(size))
        for name, st_ in stats.items():
            add(name, st_)

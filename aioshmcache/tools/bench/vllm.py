"""The ``vllm`` suite: vLLM's own ``shm_object_storage.py`` side by side with aioshmcache.

Runs only when asked for (``--suite vllm``) and when vLLM's store can be had: from an
installed ``vllm``, or from the file itself named by ``--vllm-file PATH`` (get it with
``pip download vllm==0.33.0 --no-deps`` and unzip
``vllm/distributed/device_communicators/shm_object_storage.py``). The file is never vendored.
Loaded from a file, its few imports are stood in for: ``vllm.logger.init_logger`` (a plain
logger), ``torch.Tensor`` (numpy arrays, when torch is not installed), and the msgpack tensor
encoder / decoder of ``vllm.v1.serial_utils``: a header (dtype, shape) plus the array's raw bytes
as a second buffer, decoded as a copy — what vLLM's encoder does for a tensor, with
``share_mem=False`` as its sender and receiver caches use it.

Both stores are used as the two caches use them: vLLM's sender puts, then signs the handle
(``get_signature``, HMAC-SHA256); its receiver verifies the signature and reads
(``get(address, id, signature, key)``) with its reader lock. Ours: ``ShmObjectStore.put`` and
``SenderCache.get_and_update_item`` against a ``ReceiverCache.get_and_update_item`` (verified,
acknowledged). Readers are in this process (per-operation timing). Every cell runs its
subjects in turn in each round (interleaved), with a rotating ``np.copyto`` into a warm shared
mapping as the physical limit. Ratios are vLLM's time ÷ ours (above 1: ours is faster).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import multiprocessing
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from aioshmcache import CacheConfig, ReceiverCache, SenderCache, ShmObjectStore, ShmRef

from ..progress import Progress
from ..units import KiB, MiB, fmt_bytes
from .params import Params, segment_prefix
from .report import Report, Row, Target
from .timing import Samples, ShmBuffer, source_array

__all__ = ["VLLM_MODULE", "load_vllm_store", "run_vllm_suite"]

VLLM_MODULE = "vllm.distributed.device_communicators.shm_object_storage"
S_VLLM = "vLLM 0.33 shm_object_storage side by side (in-process reader; ratio: vLLM ÷ ours)"
S_LIMIT = (
    "vLLM suite: put vs a rotating np.copyto into warm shm, get vs a copy out of shm into a new"
    " array (ratio: copy ÷ ours)"
)

_names = itertools.count()
_clock = time.perf_counter


# --- stand-ins for the file's imports ---------------------------------------------------------


def _real_torch() -> Any:
    """torch if it is installed, else None."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


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


class _MultiModalKwargsItem:
    """Stands in for ``vllm.multimodal.inputs.MultiModalKwargsItem`` (not used here)."""


def _stand_ins() -> dict[str, types.ModuleType]:
    """The modules the file imports, for those not importable here."""
    mods: dict[str, types.ModuleType] = {}
    logger_mod = types.ModuleType("vllm.logger")
    logger_mod.init_logger = logging.getLogger  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.multimodal.inputs")
    inputs.MultiModalKwargsItem = _MultiModalKwargsItem  # type: ignore[attr-defined]
    serial = types.ModuleType("vllm.v1.serial_utils")
    serial.MsgpackEncoder = _TensorEncoder  # type: ignore[attr-defined]
    serial.MsgpackDecoder = _TensorDecoder  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.multimodal", "vllm.v1"):
        mods[name] = types.ModuleType(name)
    mods["vllm.logger"] = logger_mod
    mods["vllm.multimodal.inputs"] = inputs
    mods["vllm.v1.serial_utils"] = serial
    if _real_torch() is None:
        torch = mods["torch"] = types.ModuleType("torch")
        torch.Tensor = np.ndarray  # type: ignore[attr-defined]
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


class _VllmPair:
    """vLLM's writer store and one reader store of it, in this process."""

    def __init__(self, mod: types.ModuleType, capacity: int, max_object: int) -> None:
        name = f"aioshm-{segment_prefix()}vllm{next(_names)}"
        ring = mod.SingleWriterShmRingBuffer(capacity, name=name, create=True)
        # warm, as ours is prefaulted at creation: every page of the ring touched once (the
        # signing secret in its first bytes is left alone)
        data = np.frombuffer(ring.shared_memory.buf, dtype=np.uint8)[ring.DATA_OFFSET :]
        data[:] = 0
        del data
        self.writer = mod.SingleWriterShmObjectStorage(max_object, 1, ring)
        try:
            handle = self.writer.handle()
            handle.reader_lock = multiprocessing.Lock()
            self.reader = mod.SingleWriterShmObjectStorage.create_from_handle(handle)
        except BaseException:
            self.writer.close()
            raise
        self.mod = mod

    def put(self, key: str, value: Any) -> tuple[int, int, list[int]]:
        """Its sender cache's put: store, then sign the handle (freeing as it does on full)."""
        address, mid = self.writer.put(key, value)
        return address, mid, self.writer.get_signature(key)

    def get(self, key: str, handle: tuple[int, int, list[int]]) -> Any:
        address, mid, signature = handle
        return self.reader.get(address, mid, signature, key)

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


class _OursPair:
    """Our writer (store and sender cache) and one reader, in this process."""

    def __init__(self, capacity: int, max_object: int) -> None:
        def config() -> CacheConfig:
            return CacheConfig(
                capacity, max_object, 1, name=f"{segment_prefix()}vllm-ours{next(_names)}"
            )

        self.sender = SenderCache(config())
        self.writer_store = ShmObjectStore.create(config())
        try:
            self.receiver = ReceiverCache.attach(self.sender.handle())
            self.reader_store = ShmObjectStore.from_handle(self.writer_store.handle())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for x in ("reader_store", "receiver"):
            if hasattr(self, x):
                getattr(self, x).close()
        self.writer_store.close()
        self.sender.close()


# --- the suite ------------------------------------------------------------------------------


def _per_op(fn: Callable[[], object], n: int) -> float:
    t0 = _clock()
    fn()
    return (_clock() - t0) / n


class _Cell:
    """One item size: both stores, the copy target, and one round of every subject."""

    def __init__(self, mod: types.ModuleType, size: int, batch: int) -> None:
        self.src = source_array(size)
        self.item, self.tensor = {"data": self.src}, _as_tensor(self.src)
        self.size, self.batch = size, batch
        self.cap = 2 * batch * (size + 4 * KiB) + 8 * MiB
        max_obj = size + 64 * KiB
        self.vllm = _VllmPair(mod, self.cap, max_obj)
        try:
            self.ours = _OursPair(self.cap, max_obj)
        except BaseException:
            self.vllm.close()
            raise
        self.target = ShmBuffer(self.cap)
        self.keys = itertools.count()
        self.slot = 0

    def _copyto(self) -> None:
        stride = self.size + 4 * KiB
        for _ in range(self.batch):
            off = (self.slot % (self.cap // stride - 1)) * stride
            np.copyto(self.target.view(self.size, off), self.src)
            self.slot += 1

    def _copy_out(self) -> None:
        # kept until the batch ends, as the reads keep theirs: each lands in fresh memory
        stride = self.size + 4 * KiB
        kept = [
            self.target.view(self.size, (i % (self.cap // stride - 1)) * stride).copy()
            for i in range(self.batch)
        ]
        del kept

    def round(self) -> dict[str, float]:
        """Seconds per operation of every subject, in turn."""
        n, vllm, ours = self.batch, self.vllm, self.ours
        out = {"np.copyto": _per_op(self._copyto, n), "copy out": _per_op(self._copy_out, n)}
        vkeys = [f"v{next(self.keys)}" for _ in range(n)]
        vh: list[Any] = []
        out["vLLM put + sign"] = _per_op(
            lambda: vh.extend(vllm.put(k, self.tensor) for k in vkeys), n
        )
        out["vLLM get (verify, copy)"] = _per_op(
            lambda: [vllm.get(k, h) for k, h in zip(vkeys, vh)], n
        )
        skeys = [f"s{next(self.keys)}" for _ in range(n)]
        sr: list[ShmRef] = []
        out["ours ShmObjectStore.put"] = _per_op(
            lambda: sr.extend(ours.writer_store.put(k, self.item) for k in skeys), n
        )
        out["ours ShmObjectStore.get (reader)"] = _per_op(
            lambda: [ours.reader_store.get(ref) for ref in sr], n
        )
        ckeys = [f"c{next(self.keys)}" for _ in range(n)]
        cr: list[Any] = []
        out["ours SenderCache.get_and_update_item"] = _per_op(
            lambda: cr.extend(
                ours.sender.get_and_update_item((self.item, ()), k)[0] for k in ckeys
            ),
            n,
        )
        out["ours ReceiverCache.get_and_update_item"] = _per_op(
            lambda: [ours.receiver.get_and_update_item(r, k) for k, r in zip(ckeys, cr)], n
        )
        return out

    def close(self) -> None:
        self.vllm.close()
        self.ours.close()
        self.target.close()


def _cell(mod: types.ModuleType, size: int, batch: int, rounds: int) -> dict[str, Samples]:
    """One item size: every subject once per round, in turn; seconds per operation."""
    cell = _Cell(mod, size, batch)
    out: dict[str, Samples] = {}
    try:
        for r in range(rounds + 1):  # round 0 warms every path up
            measured = cell.round()
            if r:
                for name, t in measured.items():
                    out.setdefault(name, Samples()).add_run([t])
    finally:
        cell.close()
    return out


def _churn(mod: types.ModuleType, rounds: int, n: int) -> tuple[Samples, Samples]:
    """64 MiB rings, 1 MiB items: put then read back (acknowledge) each, lap after lap."""
    size = 1 * MiB
    src = source_array(size)
    item, tensor = {"data": src}, _as_tensor(src)
    vllm, ours = _VllmPair(mod, 64 * MiB, 2 * MiB), _OursPair(64 * MiB, 2 * MiB)
    theirs, mine = Samples(), Samples()
    keys = itertools.count()
    try:

        def vllm_lap() -> None:
            for _ in range(n):
                k = f"v{next(keys)}"
                vllm.get(k, vllm.put(k, tensor))

        def ours_lap() -> None:
            for _ in range(n):
                k = f"c{next(keys)}"
                ref, _u = ours.sender.get_and_update_item((item, ()), k)
                ours.receiver.get_and_update_item(ref, k)

        for r in range(rounds + 1):
            tv, to = _per_op(vllm_lap, n), _per_op(ours_lap, n)
            if r:
                theirs.add_run([tv])
                mine.add_run([to])
    finally:
        vllm.close()
        ours.close()
    return theirs, mine


_READS = (
    "vLLM get (verify, copy)",
    "ours ShmObjectStore.get (reader)",
    "ours ReceiverCache.get_and_update_item",
)
_PAIRS = (
    ("vLLM put + sign", "ours ShmObjectStore.put", "put"),
    ("vLLM put + sign", "ours SenderCache.get_and_update_item", "put"),
    ("vLLM get (verify, copy)", "ours ShmObjectStore.get (reader)", "get"),
    ("vLLM get (verify, copy)", "ours ReceiverCache.get_and_update_item", "get"),
)
#: ours ÷ vLLM targets of issue 20, as a ratio vLLM ÷ ours: put ≤ 0.6x and get ≤ 0.3x for
#: 1 KiB; ≤ 0.95x for 1 MiB and more
_TARGETS = {("put", 1 * KiB): 1 / 0.6, ("get", 1 * KiB): 1 / 0.3}


def run_vllm_suite(p: Params, report: Report, progress: Progress, vllm_file: Path | None) -> None:
    """The suite (skipped, with a line in the report, when vLLM's store is not available)."""
    try:
        mod = load_vllm_store(vllm_file)
    except (OSError, ValueError, ImportError) as exc:
        report.skip(f"vllm: {exc}")
        return
    if mod is None:
        report.skip("vllm: not importable and no --vllm-file PATH given")
        return
    rounds = 3 if p.quick else 9
    sizes = [1 * KiB, 1 * MiB] if p.quick else [1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]
    for size in sizes:
        batch = max(4, min(256, (256 * MiB) // (size + 4 * KiB) // 4))
        if p.quick:
            batch = max(2, batch // 8)
        progress(f"vllm: {fmt_bytes(size)} x {batch}, {rounds} interleaved rounds")
        cells = _cell(mod, size, batch, rounds)
        stats = {name: s.stat() for name, s in cells.items()}
        param = fmt_bytes(size)
        for theirs, mine, op in _PAIRS:
            limit = _TARGETS.get((op, size), 1 / 0.95 if size >= MiB else None)
            report.add(
                Row(
                    S_VLLM,
                    mine,
                    param,
                    stats[mine].median,
                    stat=stats[mine],
                    baseline=theirs,
                    ratio=stats[theirs].median / stats[mine].median,
                    target=None if limit is None else Target("ratio", ">=", limit),
                )
            )
        for name in ("vLLM put + sign", "vLLM get (verify, copy)"):
            report.add(Row(S_VLLM, name, param, stats[name].median, stat=stats[name]))
        for name, st in stats.items():
            if name in ("np.copyto", "copy out"):
                continue
            big = size >= MiB and name.startswith("ours")
            base = "copy out" if name in _READS else "np.copyto"
            report.add(
                Row(
                    S_LIMIT,
                    name,
                    param,
                    st.median,
                    stat=st,
                    baseline=base,
                    ratio=stats[base].median / st.median,
                    target=Target("ratio", ">=", 1 / 1.1) if big else None,
                )
            )
        copy, out = stats["np.copyto"], stats["copy out"]
        report.add(
            Row(S_LIMIT, "np.copyto into warm shm (rotating)", param, copy.median, stat=copy)
        )
        report.add(Row(S_LIMIT, "copy out of shm into a new array", param, out.median, stat=out))
    n = 16 if p.quick else 64
    progress(f"vllm: churn, 1 MiB items through 64 MiB rings ({n} per round)")
    churn_theirs, churn_ours = _churn(mod, rounds, n)
    ts, ms = churn_theirs.stat(), churn_ours.stat()
    report.add(
        Row(
            S_VLLM,
            "churn: put + read back + acknowledge, per item (ours: SenderCache + ReceiverCache)",
            "1 MiB",
            ms.median,
            stat=ms,
            baseline="vLLM put + sign + get",
            ratio=ts.median / ms.median,
            target=Target("ratio", ">=", 1.1),
        )
    )
    report.add(Row(S_VLLM, "churn: vLLM put + sign + get, per item", "1 MiB", ts.median, stat=ts))

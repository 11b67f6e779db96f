"""The read section of the pure-Python core: the reference of ``aioshmcache/_core_read.c``.

``read_item(ctx, ref)`` is a reader's read of one plain item in one call: the checks of
``ReadPath.get`` (reference, chunk), the decode of a payload whose structure header is one map of
str keys to plain non-empty arrays or simple scalars (nil, bool, int, float, str), the copies,
the re-check after them (reclaimed meanwhile: ``StaleReferenceError``) and the acknowledgement.
It returns the item, or ``None`` with nothing done for anything else: the caller then takes
the general Python path, which raises the typed error or reads what this does not handle.
The C section's comment lists the steps; this module is their reference, step for step.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Final

import numpy as np

from . import _layout as L
from ._types import ShmRef, reference_tag

__all__ = ["DTYPES", "READ_LAYOUT", "ReadCtx", "dtype_table", "read_item", "read_layout"]

_U64: Final = (1 << 64) - 1
_SIZE_MAX: Final = (1 << 62) - 1
_MAX_NDIM_FORMAT: Final = 32
_MAX_ARRAYS_HERE: Final = 64
#: copies of at least this many bytes in all run with the GIL released (in the C section)
NOGIL_COPY: Final = 64 * 1024
#: from this many bytes the C section copies an array into pages of its own (mapped and
#: populated in one system call; huge pages from ``HUGE_PAGES``); the reference, whose arrays
#: are numpy's own, gives the same values
OWN_PAGES: Final = 256 * 1024
HUGE_PAGES: Final = 4 * 1024 * 1024
#: the constants the read section adds to the core's ``LAYOUT``
READ_LAYOUT: Final[dict[str, int]] = {
    "H_STATE": L.H_STATE,
    "STATE_LIVE": L.STATE_LIVE,
    "WS_REVOKED": L.WS_REVOKED,
    "NOGIL_COPY": NOGIL_COPY,
    "OWN_PAGES": OWN_PAGES,
    "HUGE_PAGES": HUGE_PAGES,
}
#: the dtypes the compiled read handles (any other goes to the Python path)
DTYPES: Final = (
    "|u1",
    "|i1",
    "|b1",
    "<u2",
    "<i2",
    "<f2",
    "<u4",
    "<i4",
    "<f4",
    "<u8",
    "<i8",
    "<f8",
    "<c8",
    "<c16",
)
_Q: Final = struct.Struct("<Q")
_ARR: Final = struct.Struct("<QQBBB")
_PREFIX: Final = struct.Struct("<4sHHIQ")


def read_layout() -> dict[str, int]:
    """The layout constants the read section is built with."""
    return dict(READ_LAYOUT)


def dtype_table() -> dict[bytes, tuple[np.dtype[Any], int]]:
    """``ReadCtx``'s ``dtypes``: descriptor string -> (dtype, itemsize)."""
    table = {}
    for s in DTYPES:
        dt = np.dtype(s)
        table[s.encode("ascii")] = (dt, dt.itemsize)
    return table


class ReadCtx:
    """What :func:`read_item` needs of one reader: the segment, its slot, the serde."""

    __slots__ = (
        "capacity",
        "dtypes",
        "lock",
        "log_entries",
        "mem",
        "nonce",
        "np_empty",
        "overflow",
        "ref_type",
        "ring_off",
        "secret",
        "serde",
        "session",
        "slot",
        "slot_off",
        "stale",
    )

    def __init__(
        self,
        mem: memoryview,
        ref_type: type,
        serde: Any,
        slot: Any,
        np_empty: Any,
        dtypes: dict[bytes, tuple[np.dtype[Any], int]],
        stale: type[Exception],
        nonce: int,
        secret: int,
        ring_off: int,
        capacity: int,
        slot_off: int,
    ) -> None:
        if type(dtypes) is not dict:
            raise TypeError("ReadCtx: dtypes must be a dict")
        self.mem, self.ref_type, self.serde, self.slot = mem, ref_type, serde, slot
        self.np_empty, self.dtypes, self.stale = np_empty, dtypes, stale
        words = (nonce, secret, ring_off, capacity, slot_off)
        for x in words:
            if not isinstance(x, int):
                raise TypeError(f"expected an int, not {type(x).__name__}")
            if not 0 <= x <= _U64:
                raise OverflowError("a 64-bit word must be an int in [0, 2**64)")
        self.nonce, self.secret, self.ring_off, self.capacity, self.slot_off = words
        self.lock: threading.Lock = slot._ack_lock
        self.overflow: list[Any] = slot._overflow
        self.session = int(slot.session)
        self.log_entries = int(slot.table.log_entries)
        if type(self.overflow) is not list:
            raise TypeError("the slot's overflow must be a list")
        if (
            (ring_off | capacity | slot_off) & 7
            or not 0 < self.log_entries <= 1 << 40
            or max(capacity, ring_off, slot_off) > 1 << 56
        ):
            raise ValueError("ReadCtx: offsets must be 8-aligned and in range")


def _word(mem: memoryview, off: int) -> int:
    value: int = _Q.unpack_from(mem, off)[0]
    return value


class _Pass(Exception):
    """Not handled here: the caller takes the Python path (nothing was done)."""


class _Walk:
    __slots__ = (
        "copies",
        "ctx",
        "cursor",
        "data_len",
        "data_off",
        "max_arrays",
        "max_ndim",
        "n_arrays",
        "ro",
    )

    def __init__(self, ctx: ReadCtx, data_off: int, data_len: int, ro: memoryview | None) -> None:
        serde = ctx.serde
        self.ctx = ctx
        self.ro = ro  # views (a lease): the payload, read-only; None: copies
        self.n_arrays = 0
        self.data_off, self.data_len, self.cursor = data_off, data_len, 0
        self.max_arrays: int = serde.max_arrays
        self.max_ndim: int = serde.max_ndim
        self.copies: list[tuple[int, int, np.ndarray[Any, Any]]] = []


def _take(h: bytes, pos: list[int], k: int) -> bytes:
    if k > len(h) - pos[0]:
        raise _Pass
    out = h[pos[0] : pos[0] + k]
    pos[0] += k
    return out


def _be(b: bytes) -> int:
    return int.from_bytes(b, "big")


def _read_str(h: bytes, pos: list[int]) -> str:
    t = _take(h, pos, 1)[0]
    if t & 0xE0 == 0xA0:
        n = t & 0x1F
    elif t in (0xD9, 0xDA, 0xDB):
        n = _be(_take(h, pos, {0xD9: 1, 0xDA: 2, 0xDB: 4}[t]))
    else:
        raise _Pass
    try:
        return _take(h, pos, n).decode("utf-8")
    except UnicodeDecodeError:
        raise _Pass from None


def _read_array(w: _Walk, rec: bytes) -> np.ndarray[Any, Any]:
    if len(rec) < _ARR.size:
        raise _Pass
    off, nbytes, flags, ndim, dlen = _ARR.unpack_from(rec)
    if (
        flags
        or ndim > _MAX_NDIM_FORMAT
        or ndim > w.max_ndim
        or len(rec) != _ARR.size + 8 * ndim + dlen
        or w.n_arrays >= _MAX_ARRAYS_HERE
        or w.n_arrays >= w.max_arrays
    ):
        raise _Pass
    dstart = _ARR.size + 8 * ndim
    entry = w.ctx.dtypes.get(rec[dstart:])
    if type(entry) is not tuple or len(entry) != 2:
        raise _Pass
    dt, itemsize = entry
    shape = struct.unpack_from(f"<{ndim}Q", rec, _ARR.size)
    count = 1
    for d in shape:
        if d == 0 or d > _SIZE_MAX or count > _SIZE_MAX // d:
            raise _Pass
        count *= d
    if itemsize == 0 or count > _SIZE_MAX // itemsize or count * itemsize != nbytes:
        raise _Pass
    expected = (w.cursor + 63) & ~63
    if off != expected or nbytes > w.data_len or off > w.data_len - nbytes:
        raise _Pass
    w.cursor = off + nbytes
    w.n_arrays += 1
    if w.ro is not None:  # a read-only view of the payload, as the serde's ``copy=False``
        view: np.ndarray[Any, Any] = np.frombuffer(w.ro, dt, count, w.data_off + off)
        return view if ndim == 1 else view.reshape(shape)
    arr: np.ndarray[Any, Any] = w.ctx.np_empty(shape, dt)
    if arr.nbytes != nbytes:
        raise _Pass
    w.copies.append((w.data_off + off, nbytes, arr))
    return arr


def _read_value(w: _Walk, h: bytes, pos: list[int]) -> Any:
    t = _take(h, pos, 1)[0]
    if t <= 0x7F:
        return t
    if t >= 0xE0:
        return t - 256
    if t == 0xC0:
        return None
    if t in (0xC2, 0xC3):
        return t == 0xC3
    if 0xCC <= t <= 0xCF:
        return _be(_take(h, pos, 1 << (t - 0xCC)))
    if 0xD0 <= t <= 0xD3:
        return int.from_bytes(_take(h, pos, 1 << (t - 0xD0)), "big", signed=True)
    if t == 0xCA:
        return float(struct.unpack(">f", _take(h, pos, 4))[0])
    if t == 0xCB:
        return float(struct.unpack(">d", _take(h, pos, 8))[0])
    if t & 0xE0 == 0xA0 or t in (0xD9, 0xDA, 0xDB):
        pos[0] -= 1
        return _read_str(h, pos)
    if t in (0xC7, 0xC8):  # ext 8 / ext 16: an ARRAY record
        rlen = _be(_take(h, pos, 1 if t == 0xC7 else 2))
        if _take(h, pos, 1)[0] != 1:
            raise _Pass
        return _read_array(w, _take(h, pos, rlen))
    raise _Pass


def _decode(ctx: ReadCtx, pl: memoryview, ro: memoryview | None) -> tuple[dict[str, Any], _Walk]:
    """The payload as a dict with the arrays allocated and their copies planned."""
    size = len(pl)
    if size < _PREFIX.size:
        raise _Pass
    magic, version, pflags, hlen, data_len = _PREFIX.unpack_from(pl)
    serde = ctx.serde
    max_header: int = serde.max_header_bytes
    if magic != b"ASHM" or version != 1 or pflags != 0 or not 0 < hlen <= max_header:
        raise _Pass
    data_off = (_PREFIX.size + hlen + 63) & ~63
    if data_off > size or data_len != size - data_off:
        raise _Pass
    w = _Walk(ctx, data_off, data_len, ro)
    h = bytes(pl[_PREFIX.size : _PREFIX.size + hlen])
    pos = [0]
    t = _take(h, pos, 1)[0]
    if t & 0xF0 == 0x80:
        n = t & 0x0F
    elif t == 0xDE:
        n = _be(_take(h, pos, 2))
    else:
        raise _Pass
    out: dict[str, Any] = {}
    for i in range(n):
        key = _read_str(h, pos)
        out[key] = _read_value(w, h, pos)
        if len(out) != i + 1:
            raise _Pass  # a duplicate key: the Python path decides
    if pos[0] != len(h) or w.cursor != data_len:
        raise _Pass
    return out, w


def read_item(ctx: ReadCtx, ref: object, copy: bool = True) -> Any:
    """The item of ``ref`` (a verified, acknowledged copy; with ``copy`` false read-only views,
    not acknowledged: a lease), or ``None``: not handled here, nothing done.
    ``StaleReferenceError`` if the chunk was reclaimed during the copy."""
    if type(ctx) is not ReadCtx:
        raise TypeError("read_item: ctx must be a ReadCtx")
    if type(ref) is not ctx.ref_type:
        return None
    r: ShmRef = ref  # type: ignore[assignment]
    if any(type(x) is not int or not 0 <= x <= _U64 for x in r):
        return None
    nonce, epoch, address, cid, length, tag, position, seq = r
    if nonce != ctx.nonce or tag != reference_tag(
        ctx.secret, epoch, address, cid, length, position, seq
    ):
        return None
    mem = ctx.mem
    try:
        total = len(mem)
        if mem.readonly:
            return None
    except ValueError:  # released (closed): the Python path raises the typed error
        return None
    cap, ring_off, slot_off, n_log = ctx.capacity, ctx.ring_off, ctx.slot_off, ctx.log_entries
    if (
        total < L.HEADER_SIZE
        or ring_off > total
        or cap > total - ring_off
        or slot_off > total
        or L.SLOT_HEADER + L.LOG_ENTRY_BYTES * n_log > total - slot_off
    ):
        return None
    if (
        _word(mem, 8 * L.H_STATE) != L.STATE_LIVE
        or _word(mem, 8 * L.H_EPOCH) != epoch
        or _word(mem, slot_off + 8 * L.WS_REVOKED) == ctx.session
        or ctx.overflow
    ):
        return None
    if (
        address & 63
        or cap < L.CHUNK_HEADER
        or address > cap - L.CHUNK_HEADER
        or length > cap - L.CHUNK_HEADER - address
    ):
        return None
    ch = ring_off + address
    if (
        _word(mem, ch + 8 * L.C_ID) != cid
        or _word(mem, ch + 8 * L.C_LENGTH) != length
        or _word(mem, ch + 8 * L.C_CHECK) != cid ^ length ^ L.CHUNK_MAGIC
        or _word(mem, ch + 8 * L.C_STATE) != L.COMMITTED
        or position % cap != address
        or _word(mem, 8 * L.H_HEAD_POS) > position
    ):
        return None
    pl_off = ch + L.CHUNK_HEADER
    payload = mem[pl_off : pl_off + length]
    try:
        value, w = _decode(ctx, payload, None if copy else payload.toreadonly())
    except _Pass:
        return None
    for start, nbytes, arr in w.copies:
        arr.reshape(-1).view(np.uint8)[:] = np.frombuffer(mem, np.uint8, nbytes, pl_off + start)
    if (
        _word(mem, 8 * L.H_HEAD_POS) > position
        or _word(mem, ch + 8 * L.C_ID) != cid
        or _word(mem, ch + 8 * L.C_STATE) != L.COMMITTED
    ):
        raise ctx.stale(f"chunk {cid} was reclaimed during the read")
    if _word(mem, slot_off + 8 * L.WS_REVOKED) == ctx.session:
        return None  # revoked meanwhile: the Python path raises it (nothing acknowledged)
    if not copy:
        return value  # a lease: acknowledged when it is settled (``ReadPath.ack``)
    if not _acknowledge(ctx, mem, cid, seq):
        return None
    return value


def _acknowledge(ctx: ReadCtx, mem: memoryview, cid: int, seq: int) -> bool:
    """``ReaderSlot.ack``'s usual case; False if it is not (the log full, the slot closed)."""
    with ctx.lock:
        if ctx.slot.closed is not False or ctx.overflow:
            return False
        so = ctx.slot_off
        head = _word(mem, so + 8 * L.RS_HEAD)
        if (head - _word(mem, so + 8 * L.WS_CONSUMED)) & _U64 >= ctx.log_entries:
            return False  # full (a consumed mark past the head, garbled, wraps: full too)
        e = so + L.SLOT_HEADER + L.LOG_ENTRY_BYTES * (head % ctx.log_entries)
        _Q.pack_into(mem, e, cid)
        _Q.pack_into(mem, e + 8, seq)
        _Q.pack_into(mem, so + 8 * L.RS_HEAD, (head + 1) & _U64)
    return True

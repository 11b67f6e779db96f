"""The encode side of `MsgpackSerde`: plan (walk, pack, lay out) and the encoder.

`MsgpackSerde` and the `Serde` protocol live in :mod:`aioshmcache._serde`, the decode side in
:mod:`.decode`; the payload format (every byte, and what the reader accepts) in :mod:`.format`.

An item is encoded in two steps so that the store can size (and refuse) it before touching shared
memory: :meth:`MsgpackSerde.plan` walks the value, packs a small msgpack *structure header*
(arrays appear in it as descriptors: dtype, shape, offset) and computes the exact size; no array
byte is copied; the plan holds the payload's first bytes (prefix, header, padding) ready and the
slot of every array. :meth:`MsgpackSerde.write` then writes those bytes into the allocated chunk
with one slice assignment, zeroes the padding between arrays and copies each array in, in C
order (a large C-contiguous one by the core's ``copy_into``, which releases the GIL and uses
streaming stores from 64 KiB where the CPU has them (see ``docs/core.md``); any other large
one into an ``np.frombuffer`` view of the chunk, which releases the GIL too and makes a
non-contiguous array contiguous by that same copy, with no intermediate ``ascontiguousarray``).
Every byte of the payload is written: a chunk holds an earlier item's bytes, and the reader
accepts only the canonical layout (:mod:`.format`).
:meth:`MsgpackSerde.read` rebuilds the value, with arrays either copied out by numpy
(``copy=True``: nothing keeps exporting the buffer afterwards, so the caller may release it) or
as read-only zero-copy views (``copy=False``: the views export the buffer while they live).

Deliberate choices (and where they differ from the first sketch):

* The copy into the chunk is ``dst[...] = src`` rather than ``np.copyto(dst, src)``: both run
  numpy's same assign loop, which drops the GIL for large arrays (measured: a 64 MiB copy in a
  thread left the main thread running in both cases; a memoryview slice assignment did not), but
  ``np.copyto`` pays the array-function dispatch (0.54 vs 0.24 us for 1 KiB). Source and
  destination have the same dtype and shape, so nothing is cast or broadcast. Smaller arrays
  skip numpy's view (holding the GIL for a copy that short costs nothing): up to
  :data:`_BYTES_COPY` bytes, ``src.tobytes()`` goes in by a slice assignment (two copies, but
  the least fixed cost, and any memory layout or dtype: 0.23 against 0.29 us for 1 KiB; the
  second copy outweighs that between 4 and 16 KiB), and up to :data:`_SMALL_COPY` bytes a
  C-contiguous array's raw bytes go in by a memoryview slice assignment (0.3 against 0.55 us
  for numpy's copy at 1 KiB).
* Views are built with positional ``np.frombuffer(buf, dtype, count, offset)``: measured 2.5x
  faster than the keyword form here. ``np.ndarray(shape, dtype, buffer=...)`` is faster still but
  records the underlying mmap as the base, which lets a caller flip a read-only view back to
  writable; a ``frombuffer`` view of a read-only memoryview refuses that.
* Flat items (a dict of str keys to plain ndarrays) are cached by shape: keys, dtypes and shapes
  in order (exact ``str`` and ``ndarray`` types only, checked before anything is hashed) map to
  the layout a walk produced (prefix, header and padding bytes, array slots as ready ``slice``
  objects, padding runs), so a repeated shape skips the walk and the packing, and its plan costs
  one pass over the dict. Only layouts that passed every check are kept; changing a limit
  replaces the cache (and the read templates' cache) with an empty one, and a walk captures the
  cache it fills before it reads the limits, so a walk racing a limit change cannot leave a
  layout checked against the old limits where later plans look. ``write`` checks the buffer
  by casting it to uint8 (refusing a non-contiguous one), then writability and length; a
  source array whose size changed since ``plan`` is refused rather than leaving old bytes. A
  plan is made by ``object.__new__`` and three attribute stores, with no ``__init__`` call (a
  NamedTuple built by ``tuple.__new__`` runs fewer opcodes but measured slower to build and
  to read).
* Validated dtypes and array descriptors are cached by their exact bytes (bounded caches; only
  records that passed validation are stored). Items of one kind share their descriptors, since
  offsets are relative to the data section, so a typical read skips the parsing.
* Values come back as their base type: bytearray / memoryview as bytes, dict / list / tuple / str /
  int / float subclasses (OrderedDict, namedtuple, StrEnum, IntEnum) as the plain type, ndarray
  subclasses as ndarray, arrays always C-contiguous. ``np.ma.MaskedArray`` is refused (its mask
  would be lost silently), and so is a numpy ``str_`` / ``bytes_`` scalar ending in NUL (numpy's
  fixed-width text drops trailing NULs: it would read back shorter). Python ``complex``, sets and
  any other object are refused.
* Torch (optional; never imported unless a tensor is encoded or decoded): CPU strided tensors
  round-trip with their dtype and shape; ``bfloat16`` travels as its uint16 bit pattern. Torch has
  no read-only tensors, so with ``copy=False`` a tensor shares the (writable) shared memory and
  must not be written to; if the buffer is read-only, the tensor is a copy instead (sharing would
  make ``torch.from_numpy`` warn).
* Thread safety: a ``MsgpackSerde`` may be shared between threads (one ``msgpack.Packer`` per
  thread). A plan keeps references to the source arrays, not copies: do not mutate them between
  ``plan`` and ``write``.
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack
import numpy as np

from ..errors import SerdeError
from .format import (
    ALIGN,
    ALIGN_MASK,
    ARR_STRUCTS,
    BYTES_DESC,
    DTYPE_CACHE_MAX,
    EXT_ARRAY,
    EXT_BYTES,
    EXT_SCALAR,
    EXT_TUPLE,
    FLAG_BF16,
    FLAG_TORCH,
    HLEN,
    HLEN_OFFSET,
    INLINE_BYTES_MAX,
    INT_MAX,
    INT_MIN,
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    SCALAR_HEAD,
    TOO_MANY_CONTAINERS,
    VERSION,
    allowed_kind,
    check_dtype_string,
)

# --- tunables of the encoder ------------------------------------------------------------------

_FLAT_MAX = 64  # flat items with at most this many fields have their headers cached by shape
_FLAT_SHAPES_MAX = 256  # shapes remembered per serde (cleared when full)

_TUPLE_MARK = msgpack.ExtType(EXT_TUPLE, b"")
_ZEROS = memoryview(bytes(ALIGN))
_BYTES_COPY = 4 << 10  # arrays up to this size are copied by tobytes (see the docstring)
_SMALL_COPY = 64 << 10  # arrays up to this size are copied by memoryview (see the docstring)
_ExtType = msgpack.ExtType
# ExtType.__new__ re-validates its (constant, known-good) arguments in Python; tuple.__new__
# builds the same namedtuple in a fifth of the time (measured 0.67 -> 0.1 us).
_new_tuple = tuple.__new__
_new_object = object.__new__
_ndarray = np.ndarray
_generic = np.generic
_uint8 = np.dtype(np.uint8)
_frombuffer = np.frombuffer

# dtype -> its encoded descriptor string (the decode side's cache is in .format). Only dtypes
# that passed validation are cached; the cache is bounded.
_ENC_DTYPES: dict[np.dtype[Any], bytes] = {}


def _encode_dtype(dt: np.dtype[Any]) -> bytes:
    """The descriptor string of an array's dtype; ``SerdeError`` if we do not carry it."""
    enc = _ENC_DTYPES.get(dt)
    if enc is not None:
        return enc
    if not allowed_kind(dt):
        raise SerdeError(f"arrays of dtype {dt!r} are not supported (only numeric/str/datetime)")
    enc = dt.str.encode("ascii")
    # Never write what the reader would refuse.
    if check_dtype_string(enc) != dt:
        raise SerdeError(f"arrays of dtype {dt!r} are not supported")
    if len(_ENC_DTYPES) < DTYPE_CACHE_MAX:
        _ENC_DTYPES[dt] = enc
    return enc


# --- encoding ---------------------------------------------------------------------------------


#: What a plan writes, fixed by the item's structure alone (items of one shape share it):
#: (nbytes, head, blob, slots, gaps). ``blob`` is the payload's first bytes (prefix, header, zero
#: padding up to the data section) and ``head`` the slice they go to. ``slots`` has one
#: (slice, tiny, small) per source array in header order, absolute in the payload: ``tiny`` if
#: it is non-empty and goes by ``tobytes``, else ``small`` if it is non-empty and may go by
#: memoryview (see the module docstring). ``gaps`` has (slice, zeros) for each run of padding
#: between two slots (there is none after the last one). The slices are made once, here: a
#: store through a ready slice object is the cheapest write.
_Layout = tuple[
    int, slice, bytes, tuple[tuple[slice, bool, bool], ...], tuple[tuple[slice, memoryview], ...]
]


def _layout(
    header: bytes, chunks: list[tuple[int, np.ndarray[Any, Any]]], data_len: int
) -> _Layout:
    """Lay out a packed header and its data items (offsets relative to the data section)."""
    hend = PREFIX_SIZE + len(header)
    data_off = (hend + ALIGN_MASK) & ~ALIGN_MASK
    prefix = PREFIX.pack(MAGIC, VERSION, 0, len(header), data_len)
    blob = b"".join((prefix, header, _ZEROS[: data_off - hend]))
    slots: list[tuple[slice, bool, bool]] = []
    gaps: list[tuple[slice, memoryview]] = []
    prev = data_off
    for off, src in chunks:
        start = data_off + off
        if start != prev:
            gaps.append((slice(prev, start), _ZEROS[: start - prev]))
        size = src.nbytes
        prev = start + size
        slots.append((slice(start, prev), 0 < size <= _BYTES_COPY, 0 < size <= _SMALL_COPY))
    return data_off + data_len, slice(0, data_off), blob, tuple(slots), tuple(gaps)


class MsgpackPlan:
    """An encoded value: its layout (prefix and header packed) and the source arrays, not copied."""

    __slots__ = ("_layout", "_sources", "nbytes")

    nbytes: int
    _layout: _Layout
    # the arrays in header order (bytes values as uint8 arrays), one per slot of the layout
    _sources: tuple[np.ndarray[Any, Any], ...]

    def __repr__(self) -> str:
        header = HLEN.unpack_from(self._layout[2], HLEN_OFFSET)[0]
        return f"<serde plan nbytes={self.nbytes} header={header} arrays={len(self._sources)}>"


def _new_plan(layout: _Layout, sources: tuple[np.ndarray[Any, Any], ...]) -> MsgpackPlan:
    plan = _new_object(MsgpackPlan)
    plan.nbytes = layout[0]
    plan._layout = layout
    plan._sources = sources
    return plan


def _fit(buf: memoryview, nbytes: int) -> memoryview:
    """A uint8 view that is not writable or not ``nbytes`` long: refuse it, or cut it to size."""
    if buf.readonly:
        raise SerdeError("write needs a writable buffer")
    if len(buf) < nbytes:
        raise SerdeError(f"buffer of {len(buf)} bytes is smaller than plan.nbytes={nbytes}")
    return buf[:nbytes]  # nothing past nbytes can be written, whatever happens next


class _Encoder:
    """State of one :meth:`MsgpackSerde.plan` walk."""

    __slots__ = ("chunks", "cursor", "max_arrays", "max_depth", "max_ndim", "nodes_left")

    def __init__(self, max_depth: int, max_ndim: int, max_arrays: int, max_containers: int) -> None:
        self.max_depth = max_depth
        self.max_ndim = max_ndim
        self.max_arrays = max_arrays
        self.nodes_left = max_containers  # counted as the reader counts (see .format)
        self.cursor = 0
        self.chunks: list[tuple[int, np.ndarray[Any, Any]]] = []

    def node(self, n: int = 1) -> None:
        """Count ``n`` containers (or scalar records); ``SerdeError`` past ``max_containers``."""
        self.nodes_left -= n
        if self.nodes_left < 0:
            raise SerdeError(TOO_MANY_CONTAINERS)

    def conv(self, obj: Any, depth: int) -> Any:
        """Return the msgpack-packable stand-in of ``obj`` (exact builtin types and ExtTypes)."""
        t = type(obj)
        if t is str or t is float or t is bool or obj is None:
            return obj
        if t is int:
            if INT_MIN <= obj <= INT_MAX:
                return obj
            raise SerdeError(f"int {obj} is outside msgpack's range [-2**63, 2**64)")
        if t is _ndarray:
            return self.array(obj, 0)
        if t is dict:
            return self.mapping(obj, depth + 1)
        if t is list:
            depth += 1
            if depth > self.max_depth:
                raise SerdeError(f"nesting deeper than max_depth={self.max_depth}")
            self.node()
            return [self.conv(v, depth) for v in obj]
        if t is tuple:
            depth += 1
            if depth > self.max_depth:
                raise SerdeError(f"nesting deeper than max_depth={self.max_depth}")
            self.node(2)  # a msgpack array and its tuple marker
            out = [_TUPLE_MARK]
            out.extend([self.conv(v, depth) for v in obj])
            return out
        if t is bytes:
            return self.blob(obj)
        return self.conv_other(obj, depth)

    def conv_other(self, obj: object, depth: int) -> object:
        """The slow path: numpy scalars, subclasses of builtins, torch tensors, refusals."""
        if isinstance(obj, _generic):
            return self.scalar(obj)
        if isinstance(obj, _ndarray):
            if isinstance(obj, np.ma.MaskedArray):
                raise SerdeError("masked arrays are not supported (the mask would be lost)")
            return self.array(obj.view(_ndarray), 0)
        if isinstance(obj, int):
            return self.conv(int.__int__(obj), depth)
        if isinstance(obj, float):
            return float.__float__(obj)
        if isinstance(obj, str):
            return str.__str__(obj)
        if isinstance(obj, (bytes, bytearray)):
            return self.blob(bytes(obj) if len(obj) <= INLINE_BYTES_MAX else obj)
        if isinstance(obj, memoryview):
            if not obj.c_contiguous or obj.nbytes <= INLINE_BYTES_MAX:
                return self.blob(obj.tobytes())
            return self.blob(obj.cast("B"))
        if isinstance(obj, dict):
            return self.mapping(obj, depth + 1)
        if isinstance(obj, (list, tuple)):
            return self.conv(tuple(obj) if isinstance(obj, tuple) else list(obj), depth)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        raise SerdeError(f"values of type {type(obj).__qualname__} are not supported")

    def mapping(self, obj: dict[Any, Any], depth: int) -> dict[str | bytes, object]:
        if depth > self.max_depth:
            raise SerdeError(f"nesting deeper than max_depth={self.max_depth}")
        self.node()
        out: dict[str | bytes, object] = {}
        conv = self.conv
        for k, v in obj.items():
            tk = type(k)
            if tk is not str and tk is not bytes:
                if isinstance(k, str):  # StrEnum, np.str_: come back as str
                    k = str.__str__(k)
                elif isinstance(k, bytes):
                    k = bytes(k)
                else:
                    raise SerdeError(f"dict keys must be str or bytes, not {type(k).__qualname__}")
            out[k] = conv(v, depth)
        if len(out) != len(obj):
            raise SerdeError("dict keys collide after conversion to str / bytes")
        return out

    def _slot(self, nbytes: int) -> int:
        if len(self.chunks) >= self.max_arrays:
            raise SerdeError(f"more than max_arrays={self.max_arrays} arrays / large bytes")
        off = (self.cursor + ALIGN_MASK) & ~ALIGN_MASK
        self.cursor = off + nbytes
        return off

    def array(self, arr: np.ndarray[Any, Any], flags: int) -> msgpack.ExtType:
        dt = arr.dtype
        dts = _ENC_DTYPES.get(dt)
        if dts is None:
            dts = _encode_dtype(dt)
        shape = arr.shape
        ndim = len(shape)
        if ndim > self.max_ndim:
            raise SerdeError(f"array has {ndim} dimensions, more than max_ndim={self.max_ndim}")
        nbytes = arr.nbytes
        off = self._slot(nbytes)
        self.chunks.append((off, arr))
        desc = ARR_STRUCTS[ndim].pack(off, nbytes, flags, ndim, len(dts), *shape) + dts
        return _new_tuple(_ExtType, (EXT_ARRAY, desc))

    def blob(self, data: bytes | bytearray | memoryview) -> object:
        n = len(data)
        if n <= INLINE_BYTES_MAX:
            return data
        off = self._slot(n)
        self.chunks.append((off, _frombuffer(data, _uint8)))
        return _new_tuple(_ExtType, (EXT_BYTES, BYTES_DESC.pack(off, n)))

    def scalar(self, obj: np.generic[Any]) -> msgpack.ExtType:
        self.node()
        arr = np.asarray(obj)
        if arr.dtype.kind in "SU" and arr[()] != obj:
            # numpy's fixed-width text drops trailing NULs: np.str_("a\0") would read as "a"
            raise SerdeError(
                f"a numpy {type(obj).__name__} ending in NUL does not round-trip "
                "(numpy drops trailing NULs); pass it as a str or bytes"
            )
        dts = _encode_dtype(arr.dtype)
        return _new_tuple(_ExtType, (EXT_SCALAR, SCALAR_HEAD.pack(len(dts)) + dts + arr.tobytes()))

    def tensor(self, obj: Any) -> msgpack.ExtType:
        torch = sys.modules["torch"]
        if obj.device.type != "cpu":
            raise SerdeError(f"only CPU tensors are supported, not {obj.device}; call .cpu()")
        if obj.layout != torch.strided or obj.is_quantized:
            raise SerdeError(f"only dense strided tensors are supported, not {obj.layout}")
        t = obj.detach().resolve_conj().resolve_neg()
        flags = FLAG_TORCH
        try:
            if t.dtype == torch.bfloat16:
                flags |= FLAG_BF16
                arr = t.view(torch.uint16).numpy()
            else:
                arr = t.numpy()
        except (TypeError, RuntimeError) as exc:
            raise SerdeError(f"tensors of dtype {t.dtype} are not supported") from exc
        return self.array(arr, flags)

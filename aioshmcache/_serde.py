"""Serialization straight into shared memory: `MsgpackSerde` and the `Serde` protocol.

An item is encoded in two steps so that the store can size (and refuse) it before touching shared
memory: :meth:`MsgpackSerde.plan` walks the value, packs a small msgpack *structure header*
(arrays appear in it as descriptors: dtype, shape, offset) and computes the exact size; no array
byte is copied; the plan holds the payload's first bytes (prefix, header, padding) ready and the
slot of every array. :meth:`MsgpackSerde.write` then writes those bytes into the allocated chunk
with one slice assignment, zeroes the padding between arrays and copies each array in, in C
order (a large one into an ``np.frombuffer`` view of the chunk, which releases the GIL; a
non-contiguous array is made contiguous by that same copy, with no intermediate
``ascontiguousarray``). Every byte of the payload is written: a chunk holds an earlier item's
bytes, and the reader accepts only the canonical layout below.
:meth:`MsgpackSerde.read` rebuilds the value, with arrays either copied out by numpy
(``copy=True``: nothing keeps exporting the buffer afterwards, so the caller may release it) or
as read-only zero-copy views (``copy=False``: the views export the buffer while they live).

Payload layout (integers little-endian; offsets relative to the payload start, which the store
places at a 64-byte aligned address, so every array starts 64-byte aligned in memory)::

    0       4         6         8            12                    20
    +-------+---------+---------+------------+---------------------+
    | magic | version |  flags  | header_len |      data_len       |  prefix, struct "<4sHHIQ"
    | ASHM  | u16 = 1 | u16 = 0 |    u32     |         u64         |
    +-------+---------+---------+------------+---------------------+
    20                             20 + header_len       data_off = align64(20 + header_len)
    +------------------------------+---------------------+
    | msgpack structure header     | zero padding (< 64) |
    +------------------------------+---------------------+
    data_off                                                         data_off + data_len
    +-----------+--------+-----------+--------+-----------+
    |  array 0  |  pad   |  array 1  |  pad   |  array 2  |   data section
    +-----------+--------+-----------+--------+-----------+
    nbytes = data_off + data_len   (the payload is exactly nbytes long)

The structure header is one msgpack object: maps (str/bytes keys), arrays, str, bin, int, float,
bool, nil, and these ``ExtType`` records (all fields little-endian)::

    code 1  ARRAY   "<QQBBB" offset, nbytes, flags, ndim, dtype_len
                    + ndim x "<Q" dims + dtype string (numpy ``dtype.str``, ASCII)
                    flags: 1 = torch tensor, 2 = torch bfloat16 (stored as its "<u2" bit pattern)
    code 2  SCALAR  "<B" dtype_len + dtype string + the item's raw bytes (a numpy scalar)
    code 3  TUPLE   empty; only as the first element of a msgpack array: that array is a tuple
    code 4  BYTES   "<QQ" offset, nbytes: a bytes value of >= 1 KiB kept in the data section

``offset`` is relative to ``data_off``, so the header can be packed before its own length (and
therefore ``data_off``) is known. The layout is canonical: data items are placed in header order
(depth-first, dict insertion order), each at ``align64(end of the previous one)``. The reader
recomputes that layout and accepts nothing else, which implies 64-byte alignment, no overlap
with each other or with the header, bounds inside the payload and no unreferenced bytes.

Decoding treats the payload as hostile (a writable segment can be written by anyone who can open
it). No pickle, no hook that decodes anything (the hooks below only count): the header length
is checked against ``max_header_bytes`` before unpacking (this plays the role of msgpack's
``max_buffer_size``, which ``unpackb`` does not take), ``msgpack.unpackb`` runs with
``raw=False, strict_map_key=True`` and explicit ``max_*_len`` limits (trailing bytes are an
error), and the result is walked with a depth limit,
converting ``ExtType`` records after validating each descriptor: dtype string against a whitelist
regex, then ``np.dtype`` and a check that it round-trips to the same canonical string with an
allowed kind; ``ndim``; ``prod(shape) * itemsize == nbytes`` in Python integers; the canonical
offset. Every failure is a :class:`~aioshmcache.errors.SerdeError`.

Decoding cost is bounded by the payload's size, not only its validity. One byte of msgpack can be
a whole Python container (``0x80`` is an empty map, ``0x90`` an empty list): a 1 MiB header of
them unpacked into a million dicts cost ~0.5 GiB and seconds of CPU while staying inside every
length limit. So ``max_containers`` (default 32,768) bounds the *nodes* of a header: maps,
msgpack arrays (lists and tuples) and extension records other than ``ARRAY`` and ``BYTES``
(numpy scalars, tuple markers; arrays and large bytes are bounded by ``max_arrays``). They are
counted *while* msgpack unpacks (its ``object_hook`` / ``list_hook`` / ``ext_hook`` count and
return what they are given, converting nothing), so a hostile header is refused after at most
``max_containers`` containers were built, whatever its length; ``plan`` counts the same way and
refuses to produce a header that ``read`` would refuse. msgpack also allocates each array as
its header *announces* it, before reading its elements: a header that may leave such arrays
open (more than a few ``array 16/32`` type bytes) is first checked to be one complete object
(``Unpacker.skip``, in C, building nothing), so what is allocated is backed by input bytes
(``_check_complete``). Plain values cost at most a few times
their encoded size: a list or map whose values are all plain (no container, no record) is
compiled into one copy of it, not one node per element.

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
  would be lost silently). Python ``complex``, sets and any other object are refused.
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

import math
import re
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import msgpack
import numpy as np

from .errors import SerdeError

__all__ = ["EncodePlan", "MsgpackSerde", "Serde"]


@runtime_checkable
class EncodePlan(Protocol):
    """What :meth:`Serde.plan` returns: everything :meth:`Serde.write` needs, sized exactly."""

    @property
    def nbytes(self) -> int:
        """Exact number of bytes the encoded value occupies."""
        ...


@runtime_checkable
class Serde(Protocol):
    """A pluggable serializer: size first (``plan``), then write into shared memory, then read."""

    def plan(self, obj: object) -> EncodePlan:
        """Walk ``obj`` and size its encoding; copies no array bytes. Raises ``SerdeError``."""
        ...

    def write(self, plan: EncodePlan, buf: memoryview) -> None:
        """Write ``plan`` into ``buf[0:plan.nbytes]`` (a writable, 64-byte aligned uint8 view)."""
        ...

    def read(self, buf: memoryview, *, copy: bool = True) -> object:
        """Decode exactly one payload; arrays are copies, or read-only views with ``copy=False``."""
        ...


# --- format constants -------------------------------------------------------------------------

_MAGIC = b"ASHM"
_VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")
_PREFIX_SIZE = _PREFIX.size  # 20
_HLEN = struct.Struct("<I")  # the prefix's header_len alone
_HLEN_OFFSET = 8
_ALIGN = 64
_ALIGN_MASK = _ALIGN - 1

_EXT_ARRAY = 1
_EXT_SCALAR = 2
_EXT_TUPLE = 3
_EXT_BYTES = 4

_FLAG_TORCH = 1
_FLAG_BF16 = 2
_KNOWN_FLAGS = _FLAG_TORCH | _FLAG_BF16

_ARR_HEAD = struct.Struct("<QQBBB")
_ARR_HEAD_SIZE = _ARR_HEAD.size  # 19
_MAX_NDIM_FORMAT = 64  # numpy's own limit (NPY_MAXDIMS in numpy 2)
_ARR_STRUCTS = tuple(struct.Struct(f"<QQBBB{n}Q") for n in range(_MAX_NDIM_FORMAT + 1))
_SHAPE_STRUCTS = tuple(struct.Struct(f"<{n}Q") for n in range(_MAX_NDIM_FORMAT + 1))
_BYTES_DESC = struct.Struct("<QQ")
_U8 = struct.Struct("<B")

_INLINE_BYTES_MAX = 1023  # bytes values longer than this go to the data section
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1
_SIZE_MAX = (1 << 62) - 1  # bound on any array's element count / byte size (fits npy_intp)

_ALLOWED_KINDS = frozenset("biufcSUmM")
_DTYPE_RE = re.compile(
    rb"[<>|](?:[biufc][1-9][0-9]?|[SU][1-9][0-9]{0,8}"
    rb"|[mM]8(?:\[(?:[1-9][0-9]{0,8})?(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?)"
)
_DTYPE_CACHE_MAX = 512
_FLAT_MAX = 64  # flat items with at most this many fields have their headers cached by shape
_FLAT_SHAPES_MAX = 256  # shapes remembered per serde (cleared when full)

_TUPLE_MARK = msgpack.ExtType(_EXT_TUPLE, b"")
_ZEROS = memoryview(bytes(_ALIGN))
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

# dtype -> its encoded descriptor string (encode side); descriptor bytes -> dtype (decode side).
# Only dtypes that passed validation are cached; both caches are bounded.
_ENC_DTYPES: dict[np.dtype[Any], bytes] = {}
_DEC_DTYPES: dict[bytes, np.dtype[Any]] = {}


def _check_dtype_string(raw: bytes) -> np.dtype[Any]:
    """Validate a dtype descriptor string (hostile input) and return the dtype it names."""
    dt = _DEC_DTYPES.get(raw)
    if dt is not None:
        return dt
    if _DTYPE_RE.fullmatch(raw) is None:
        raise SerdeError(f"dtype {raw[:40]!r} is not an allowed dtype")
    text = raw.decode("ascii")
    try:
        dt = np.dtype(text)
    except Exception as exc:  # numpy raises TypeError / ValueError / DeprecationWarning
        raise SerdeError(f"dtype {text!r} is not understood by numpy") from exc
    if (
        dt.str != text
        or dt.kind not in _ALLOWED_KINDS
        or dt.hasobject
        or dt.fields is not None
        or dt.subdtype is not None
        or dt.itemsize <= 0
    ):
        raise SerdeError(f"dtype {text!r} is not an allowed dtype")
    if len(_DEC_DTYPES) < _DTYPE_CACHE_MAX:
        _DEC_DTYPES[raw] = dt
    return dt


def _encode_dtype(dt: np.dtype[Any]) -> bytes:
    """The descriptor string of an array's dtype; ``SerdeError`` if we do not carry it."""
    enc = _ENC_DTYPES.get(dt)
    if enc is not None:
        return enc
    if dt.hasobject or dt.fields is not None or dt.kind not in _ALLOWED_KINDS:
        raise SerdeError(f"arrays of dtype {dt!r} are not supported (only numeric/str/datetime)")
    enc = dt.str.encode("ascii")
    # Never write what the reader would refuse.
    if _check_dtype_string(enc) != dt:
        raise SerdeError(f"arrays of dtype {dt!r} are not supported")
    if len(_ENC_DTYPES) < _DTYPE_CACHE_MAX:
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
    hend = _PREFIX_SIZE + len(header)
    data_off = (hend + _ALIGN_MASK) & ~_ALIGN_MASK
    prefix = _PREFIX.pack(_MAGIC, _VERSION, 0, len(header), data_len)
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


class _Plan:
    """An encoded value: its layout (prefix and header packed) and the source arrays, not copied."""

    __slots__ = ("_layout", "_sources", "nbytes")

    nbytes: int
    _layout: _Layout
    # the arrays in header order (bytes values as uint8 arrays), one per slot of the layout
    _sources: tuple[np.ndarray[Any, Any], ...]

    def __repr__(self) -> str:
        header = _HLEN.unpack_from(self._layout[2], _HLEN_OFFSET)[0]
        return f"<serde plan nbytes={self.nbytes} header={header} arrays={len(self._sources)}>"


def _new_plan(layout: _Layout, sources: tuple[np.ndarray[Any, Any], ...]) -> _Plan:
    plan = _new_object(_Plan)
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
        self.nodes_left = max_containers  # counted as the reader counts (module docstring)
        self.cursor = 0
        self.chunks: list[tuple[int, np.ndarray[Any, Any]]] = []

    def node(self, n: int = 1) -> None:
        """Count ``n`` containers (or scalar records); ``SerdeError`` past ``max_containers``."""
        self.nodes_left -= n
        if self.nodes_left < 0:
            raise SerdeError(_too_many_containers())

    def conv(self, obj: Any, depth: int) -> Any:
        """Return the msgpack-packable stand-in of ``obj`` (exact builtin types and ExtTypes)."""
        t = type(obj)
        if t is str or t is float or t is bool or obj is None:
            return obj
        if t is int:
            if _INT_MIN <= obj <= _INT_MAX:
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
            return self.blob(bytes(obj) if len(obj) <= _INLINE_BYTES_MAX else obj)
        if isinstance(obj, memoryview):
            if not obj.c_contiguous or obj.nbytes <= _INLINE_BYTES_MAX:
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
        off = (self.cursor + _ALIGN_MASK) & ~_ALIGN_MASK
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
        desc = _ARR_STRUCTS[ndim].pack(off, nbytes, flags, ndim, len(dts), *shape) + dts
        return _new_tuple(_ExtType, (_EXT_ARRAY, desc))

    def blob(self, data: bytes | bytearray | memoryview) -> object:
        n = len(data)
        if n <= _INLINE_BYTES_MAX:
            return data
        off = self._slot(n)
        self.chunks.append((off, _frombuffer(data, _uint8)))
        return _new_tuple(_ExtType, (_EXT_BYTES, _BYTES_DESC.pack(off, n)))

    def scalar(self, obj: np.generic[Any]) -> msgpack.ExtType:
        self.node()
        arr = np.asarray(obj)
        dts = _encode_dtype(arr.dtype)
        return _new_tuple(_ExtType, (_EXT_SCALAR, _U8.pack(len(dts)) + dts + arr.tobytes()))

    def tensor(self, obj: Any) -> msgpack.ExtType:
        torch = sys.modules["torch"]
        if obj.device.type != "cpu":
            raise SerdeError(f"only CPU tensors are supported, not {obj.device}; call .cpu()")
        if obj.layout != torch.strided or obj.is_quantized:
            raise SerdeError(f"only dense strided tensors are supported, not {obj.layout}")
        t = obj.detach().resolve_conj().resolve_neg()
        flags = _FLAG_TORCH
        try:
            if t.dtype == torch.bfloat16:
                flags |= _FLAG_BF16
                arr = t.view(torch.uint16).numpy()
            else:
                arr = t.numpy()
        except (TypeError, RuntimeError) as exc:
            raise SerdeError(f"tensors of dtype {t.dtype} are not supported") from exc
        return self.array(arr, flags)


# --- decoding ---------------------------------------------------------------------------------

_ArrayDesc = tuple[int, int, int, np.dtype[Any], tuple[int, ...], int]

# Validated array descriptors (exact bytes -> parsed fields): items of one kind share their
# descriptors (offsets are relative to the data section), so most reads skip the parsing. Only
# descriptors that passed validation are stored, and the cache is bounded (cleared when full).
_ARRAY_DESCS: dict[bytes, _ArrayDesc] = {}
_ARRAY_DESCS_MAX = 1024


def _parse_array_descriptor(data: bytes) -> _ArrayDesc:
    """Validate an ARRAY record: (offset, nbytes, flags, dtype, shape, element count).

    Everything that depends only on the record's bytes is checked here; the serde's ``max_ndim``
    and the canonical offset are checked by the caller.
    """
    n = len(data)
    if n < _ARR_HEAD_SIZE:
        raise SerdeError("malformed array descriptor")
    off, nbytes, flags, ndim, dlen = _ARR_HEAD.unpack_from(data)
    if ndim > _MAX_NDIM_FORMAT:
        raise SerdeError(f"array has {ndim} dimensions")
    dstart = _ARR_HEAD_SIZE + 8 * ndim
    if n != dstart + dlen or flags & ~_KNOWN_FLAGS:
        raise SerdeError("malformed array descriptor")
    dt = _check_dtype_string(data[dstart:])
    shape: tuple[int, ...] = _SHAPE_STRUCTS[ndim].unpack_from(data, _ARR_HEAD_SIZE)
    count = math.prod(shape)
    if count == 0:
        if math.prod([d or 1 for d in shape]) * dt.itemsize > _SIZE_MAX:
            raise SerdeError("zero-size array with an impossible shape")
    elif count > _SIZE_MAX:
        raise SerdeError("array too large")
    if count * dt.itemsize != nbytes:
        raise SerdeError("array nbytes does not match its shape and dtype")
    return off, nbytes, flags, dt, shape, count


# A read rebuilds the value from a *template*: the structure header unpacked and walked once,
# every check of the format applied, and compiled into builders that only make what must be new
# for each read (arrays, as copies or views at offsets the template fixed, bytes values, mutable
# containers); immutable parts (str, numbers, numpy scalars, tuples of those) are shared. Each
# serde caches templates by the header's exact bytes (and the data length they imply), so a read
# of an item shaped like an earlier one skips the unpacking and the walk. Only templates that
# passed validation are stored, and the cache is bounded (cleared when full).
_TEMPLATE_HEADER_MAX = 4096  # longer headers (e.g. big str values) are not worth keeping
_TEMPLATE_KEY_MAX = _PREFIX_SIZE + _TEMPLATE_HEADER_MAX
_TEMPLATES_MAX = 256
_LIMITS = frozenset(("max_arrays", "max_containers", "max_depth", "max_header_bytes", "max_ndim"))
#: what a plain value of an unpacked header may be (anything else is a node to compile)
_NODE_TYPES = frozenset((dict, list, _ExtType))


def _too_many_containers() -> str:
    return "more containers (maps, lists, tuples, numpy scalars) than max_containers allows"


class _NodeCounter:
    """msgpack's hooks for one unpacking: count containers and scalar records, convert nothing.

    Called as msgpack builds each map (``object_hook``), array (``list_hook``) and extension
    record (``ext_hook``), so the count stops a hostile header before it is all built.
    """

    __slots__ = ("left", "max")

    def __init__(self, max_containers: int) -> None:
        self.left = self.max = max_containers

    def container(self, obj: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise SerdeError(f"{_too_many_containers()} ({self.max})")
        return obj

    def ext(self, code: int, data: bytes) -> msgpack.ExtType:
        if code != _EXT_ARRAY and code != _EXT_BYTES:  # those are bounded by max_arrays
            self.left -= 1
            if self.left < 0:
                raise SerdeError(f"{_too_many_containers()} ({self.max})")
        return _ExtType(code, data)


def _check_complete(header: bytes | memoryview) -> None:
    """``SerdeError`` unless ``header`` is exactly one complete msgpack object, checked
    *before* it is unpacked when it could announce more than it holds.

    msgpack allocates each array as its header announces it, before reading one element, and
    nests up to 1,024 levels: 1,000 ``array 32`` headers of 5 bytes, left open, cost ~40-80 MiB
    for a 5 KiB header (issue 19 item 4 bounds the cost per input byte). In a *complete*
    object every announced element is there (at least one byte each), so what msgpack
    allocates is bounded by the header's size; ``Unpacker.skip`` checks completeness in C
    without building anything. Only ``array 16`` / ``array 32`` announce more than 15 slots:
    a header with at most :data:`_OPEN_ARRAYS_OK` of their type bytes (counted at C speed)
    cannot waste more than a few bytes per input byte, and is not skipped over first.
    """
    data = header if type(header) is bytes else bytes(header)
    if data.count(0xDC) + data.count(0xDD) <= _OPEN_ARRAYS_OK:
        return
    size = max(len(data), 1)
    unpacker = msgpack.Unpacker(max_buffer_size=size, read_size=size)
    unpacker.feed(data)
    try:
        unpacker.skip()
    except msgpack.OutOfData:
        raise SerdeError("malformed structure header: incomplete input") from None
    except Exception as exc:  # StackError (nesting past msgpack's own limit), FormatError
        raise SerdeError(f"malformed structure header: {type(exc).__name__} {exc}") from None
    if unpacker.tell() != len(data):
        raise SerdeError("malformed structure header: bytes after the object")


#: ``array 16`` / ``array 32`` type bytes a header may hold without the completeness check
#: (each, left open, may cost 8 bytes per header byte)
_OPEN_ARRAYS_OK = 3


def _copy_list_builder(values: list[Any]) -> _Builder:
    """A list of plain values (no container, no record): a fresh copy on each read."""

    def build(buf: memoryview, ro: memoryview, copy: bool) -> Any:
        return list(values)

    return build


def _copy_dict_builder(mapping: dict[Any, Any]) -> _Builder:
    """A map of plain values (no container, no record): a fresh copy on each read."""

    def build(buf: memoryview, ro: memoryview, copy: bool) -> Any:
        return dict(mapping)

    return build


#: builds one node of a value: (buffer, read-only buffer, copy) -> value
_Builder = Callable[[memoryview, memoryview, bool], Any]
#: a compiled node: (builder, None), or (None, a value every read may share)
_Node = tuple["_Builder | None", Any]
#: a compiled header: its root node and the payload size its layout implies
_Template = tuple["_Builder | None", Any, int]


def _is_shared(nodes: list[_Node]) -> bool:
    return all(b is None for b, _ in nodes)


def _container_builder(kind: type, nodes: list[_Node]) -> _Builder:
    """Build a fresh list or tuple of ``nodes`` on each read."""

    def build(buf: memoryview, ro: memoryview, copy: bool) -> Any:
        return kind([v if b is None else b(buf, ro, copy) for b, v in nodes])

    return build


def _dict_builder(items: list[tuple[Any, _Builder | None, Any]]) -> _Builder:
    """Build a fresh dict of ``items`` (key, builder, shared value) on each read."""

    def build(buf: memoryview, ro: memoryview, copy: bool) -> Any:
        return {k: v if b is None else b(buf, ro, copy) for k, b, v in items}

    return build


#: one array of a flat dict: key, dtype, element count, absolute start, shape (None: 1-D)
_FlatArray = tuple[Any, np.dtype[Any], int, int, "tuple[int, ...] | None"]


def _flat_dict_builder(arrays: list[_FlatArray]) -> _Builder:
    """The usual item, a dict of plain non-empty arrays: every array made in one loop."""
    if len(arrays) == 1:
        [(key, dt, count, start, shape)] = arrays
        if shape is None:
            # the commonest item of all, one 1-D array: no loop, no reshape
            def one(buf: memoryview, ro: memoryview, copy: bool) -> Any:
                arr = _frombuffer(ro, dt, count, start)
                return {key: arr.copy() if copy else arr}

            return one

    def build(buf: memoryview, ro: memoryview, copy: bool) -> Any:
        out = {}
        for k, dt, count, start, shape in arrays:
            arr = _frombuffer(ro, dt, count, start)
            if shape is not None:
                arr = arr.reshape(shape)
            out[k] = arr.copy() if copy else arr
        return out

    return build


def _array_builder(dt: np.dtype[Any], shape: tuple[int, ...], count: int, start: int) -> _Builder:
    """Build one array: a copy, or a read-only view of the read-only buffer."""
    if count == 0:

        def empty(buf: memoryview, ro: memoryview, copy: bool) -> Any:
            out = np.empty(shape, dt)
            if not copy:
                out.flags.writeable = False
            return out

        return empty
    if len(shape) == 1:

        def flat(buf: memoryview, ro: memoryview, copy: bool) -> Any:
            arr = _frombuffer(ro, dt, count, start)
            return arr.copy() if copy else arr

        return flat

    def shaped(buf: memoryview, ro: memoryview, copy: bool) -> Any:
        arr = _frombuffer(ro, dt, count, start).reshape(shape)
        return arr.copy() if copy else arr

    return shaped


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise SerdeError(
            "this value holds a torch tensor, but torch is not importable here; "
            "install torch (pip install 'aioshmcache[torch]') to read it"
        ) from exc
    return torch


def _tensor_builder(
    dt: np.dtype[Any], shape: tuple[int, ...], count: int, start: int, bf16: bool
) -> _Builder:
    def build(buf: memoryview, ro: memoryview, copy: bool) -> Any:
        torch = _import_torch()
        if count == 0:
            arr = np.empty(shape, dt)
        else:
            # torch has no read-only tensors: share a writable buffer, otherwise copy
            # (torch.from_numpy of a read-only array warns).
            share = not copy and not buf.readonly
            arr = _frombuffer(buf if share else ro, dt, count, start).reshape(shape)
            if not share:
                arr = arr.copy()
        tensor = torch.from_numpy(arr)
        if bf16:
            tensor = tensor.view(torch.bfloat16)
        return tensor

    return build


class _Compiler:
    """One walk of an unpacked structure header: validates it and compiles its template."""

    __slots__ = ("count", "cursor", "data_len", "data_off", "max_arrays", "max_depth", "max_ndim")

    def __init__(
        self, data_off: int, data_len: int, max_depth: int, max_ndim: int, max_arrays: int
    ) -> None:
        self.data_off = data_off
        self.data_len = data_len
        self.max_depth = max_depth
        self.max_ndim = max_ndim
        self.max_arrays = max_arrays
        self.cursor = 0
        self.count = 0

    def conv(self, obj: Any, depth: int) -> _Node:
        """Compile one node of the unpacked header: ExtType records become array builders etc."""
        t = type(obj)
        if t is _ExtType:
            return self.ext(obj)
        if t is dict:
            depth += 1
            if depth > self.max_depth:
                raise SerdeError(f"nesting deeper than max_depth={self.max_depth}")
            if _NODE_TYPES.isdisjoint(map(type, obj.values())):
                return _copy_dict_builder(obj), None  # plain values only: one node, not one each
            conv = self.conv
            flat: list[_FlatArray] | None = []
            items: list[tuple[Any, _Builder | None, Any]] = []
            for k, v in obj.items():
                if flat is not None and type(v) is _ExtType and v.code == _EXT_ARRAY:
                    dt, shape, count, start, flags = desc = self.array_desc(v.data)
                    if not flags and count:
                        flat.append((k, dt, count, start, None if len(shape) == 1 else shape))
                    items.append((k, self.array_builder(desc), None))
                    if flags or not count:
                        flat = None
                    continue
                flat = None
                items.append((k, *conv(v, depth)))
            if flat is not None and flat:
                return _flat_dict_builder(flat), None
            return _dict_builder(items), None
        if t is list:
            depth += 1
            if depth > self.max_depth:
                raise SerdeError(f"nesting deeper than max_depth={self.max_depth}")
            conv = self.conv
            values: list[Any] = obj
            if values:
                first = values[0]
                if type(first) is _ExtType and first.code == _EXT_TUPLE:
                    if first.data:
                        raise SerdeError("malformed tuple marker")
                    rest = values[1:]
                    if _NODE_TYPES.isdisjoint(map(type, rest)):
                        return None, tuple(rest)  # plain values only: shared, immutable
                    nodes = [conv(v, depth) for v in rest]
                    if _is_shared(nodes):
                        return None, tuple([v for _, v in nodes])
                    return _container_builder(tuple, nodes), None
                if _NODE_TYPES.isdisjoint(map(type, values)):
                    return _copy_list_builder(values), None  # plain values: one node, not one each
            return _container_builder(list, [conv(v, depth) for v in values]), None
        if t is str or t is int or t is float or t is bool or t is bytes or obj is None:
            return None, obj
        raise SerdeError(f"unexpected {type(obj).__qualname__} in the structure header")

    def _slot(self, off: int, nbytes: int) -> int:
        """Check ``off`` is the canonical slot of the next data item; return its absolute start."""
        self.count += 1
        if self.count > self.max_arrays:
            raise SerdeError(f"more than max_arrays={self.max_arrays} arrays")
        expected = (self.cursor + _ALIGN_MASK) & ~_ALIGN_MASK
        if off != expected:
            raise SerdeError(f"array offset {off} is not the canonical offset {expected}")
        end = off + nbytes
        if end > self.data_len:
            raise SerdeError("array extends past the end of the data section")
        self.cursor = end
        return self.data_off + off

    def ext(self, rec: msgpack.ExtType) -> _Node:
        code = rec.code
        data: bytes = rec.data
        if code == _EXT_ARRAY:
            return self.array_builder(self.array_desc(data)), None
        if code == _EXT_SCALAR:
            return None, self.scalar(data)
        if code == _EXT_BYTES:
            if len(data) != _BYTES_DESC.size:
                raise SerdeError("malformed bytes descriptor")
            off, nbytes = _BYTES_DESC.unpack(data)
            start = self._slot(off, nbytes)
            end = start + nbytes
            return (lambda buf, ro, copy: buf[start:end].tobytes()), None
        if code == _EXT_TUPLE:
            raise SerdeError("tuple marker outside the first element of an array")
        raise SerdeError(f"unknown ExtType code {code}")

    def array_desc(self, data: bytes) -> tuple[np.dtype[Any], tuple[int, ...], int, int, int]:
        """Validate an ARRAY record in walk order: (dtype, shape, count, absolute start, flags)."""
        desc = _ARRAY_DESCS.get(data)
        if desc is None:
            desc = _parse_array_descriptor(data)
            if len(_ARRAY_DESCS) >= _ARRAY_DESCS_MAX:
                _ARRAY_DESCS.clear()
            _ARRAY_DESCS[data] = desc
        off, nbytes, flags, dt, shape, count = desc
        ndim = len(shape)
        if ndim > self.max_ndim:
            raise SerdeError(f"array has {ndim} dimensions, more than max_ndim={self.max_ndim}")
        start = self._slot(off, nbytes)
        if flags:
            self.check_tensor(dt, flags)
        return dt, shape, count, start, flags

    @staticmethod
    def array_builder(desc: tuple[np.dtype[Any], tuple[int, ...], int, int, int]) -> _Builder:
        dt, shape, count, start, flags = desc
        if flags:
            return _tensor_builder(dt, shape, count, start, bool(flags & _FLAG_BF16))
        return _array_builder(dt, shape, count, start)

    @staticmethod
    def scalar(data: bytes) -> object:
        if not data:
            raise SerdeError("malformed scalar descriptor")
        dlen = data[0]
        dt = _check_dtype_string(data[1 : 1 + dlen])
        if len(data) != 1 + dlen + dt.itemsize:
            raise SerdeError("scalar byte length does not match its dtype")
        return _frombuffer(data, dt, 1, 1 + dlen)[0]  # immutable: shared by every read

    @staticmethod
    def check_tensor(dt: np.dtype[Any], flags: int) -> None:
        if not flags & _FLAG_TORCH:
            raise SerdeError("malformed array flags")
        if flags & _FLAG_BF16 and dt.str != "<u2":
            raise SerdeError("a bfloat16 tensor must be stored as '<u2'")
        if dt.kind not in "biufc" or dt.byteorder == ">":
            raise SerdeError(f"dtype {dt.str!r} cannot be a torch tensor")
        _import_torch()  # fail here, in walk order, as an uncompiled read would


# --- the serde --------------------------------------------------------------------------------


class MsgpackSerde:
    """The default :class:`Serde`: a msgpack structure header plus raw, 64-byte aligned arrays.

    The limits bound what :meth:`read` accepts (and :meth:`plan` refuses to produce anything the
    reader would refuse): the structure header's size, the number of arrays (and large bytes
    values), the dimensions of one array, the nesting depth of containers and the number of
    containers (``max_containers``: maps, lists, tuples and numpy scalars, which bounds the
    memory and time a hostile header can cost; see the module docstring).
    """

    __slots__ = (
        "_local",
        "_shapes",
        "_templates",
        "max_arrays",
        "max_containers",
        "max_depth",
        "max_header_bytes",
        "max_ndim",
    )

    def __init__(
        self,
        *,
        max_header_bytes: int = 1 << 20,
        max_arrays: int = 4096,
        max_ndim: int = 32,
        max_depth: int = 64,
        max_containers: int = 1 << 15,
    ) -> None:
        for name, value, hi in (
            ("max_header_bytes", max_header_bytes, (1 << 32) - 1),
            ("max_arrays", max_arrays, 1 << 32),
            ("max_ndim", max_ndim, _MAX_NDIM_FORMAT),
            ("max_depth", max_depth, 256),
            ("max_containers", max_containers, 1 << 32),
        ):
            if type(value) is not int or not 1 <= value <= hi:
                raise ValueError(f"{name} must be an int in [1, {hi}], got {value!r}")
        self.max_header_bytes = max_header_bytes
        self.max_arrays = max_arrays
        self.max_ndim = max_ndim
        self.max_depth = max_depth
        self.max_containers = max_containers
        self._local = threading.local()
        # Layouts of flat items (a dict of str -> plain ndarray), by item shape (keys, dtypes,
        # shapes in order): the header depends on nothing else, so a repeated shape skips the
        # walk and the msgpack packing. Only layouts that passed every check are kept.
        self._shapes: dict[tuple[object, ...], _Layout] = {}
        self._templates: dict[bytes, _Template] = {}

    def __setattr__(self, name: str, value: object) -> None:
        # Cached layouts and templates were validated against the limits: changing one forgets
        # them. The caches are replaced, not cleared, after the limit is set: a walk captures its
        # cache before it reads the limits, so one that read the old limits stores into a cache
        # that is no longer used.
        object.__setattr__(self, name, value)
        if name in _LIMITS and hasattr(self, "_templates"):
            object.__setattr__(self, "_shapes", {})
            object.__setattr__(self, "_templates", {})

    def __repr__(self) -> str:
        return (
            f"MsgpackSerde(max_header_bytes={self.max_header_bytes}, "
            f"max_arrays={self.max_arrays}, max_ndim={self.max_ndim}, max_depth={self.max_depth}, "
            f"max_containers={self.max_containers})"
        )

    def _packer(self) -> msgpack.Packer:
        packer: msgpack.Packer | None = getattr(self._local, "packer", None)
        if packer is None:
            packer = msgpack.Packer(use_bin_type=True, strict_types=True, datetime=False)
            self._local.packer = packer
        return packer

    def plan(self, obj: object) -> EncodePlan:
        """Walk ``obj``, pack its structure header and size the payload (no array bytes copied).

        A flat item (a dict of str keys to plain ndarrays, as preprocessed features are) whose
        shape was planned before reuses that layout: the same keys, dtypes and shapes in the
        same order give the very same header and array offsets.
        """
        if type(obj) is dict:
            shape: list[object] = []
            for k, v in obj.items():
                if type(k) is not str or type(v) is not _ndarray:
                    return self._plan(obj)
                shape += (k, v.dtype, v.shape)
            key = tuple(shape)
            try:
                layout = self._shapes[key]
            except KeyError:
                return self._plan_flat(obj, key)
            # A hit passed every check under the current limits (a change forgets them all).
            # This is _new_plan, inlined: no call on the put path.
            plan = _new_object(_Plan)
            plan.nbytes = layout[0]
            plan._layout = layout
            plan._sources = tuple(obj.values())
            return plan
        return self._plan(obj)

    def _plan_flat(self, obj: dict[str, np.ndarray[Any, Any]], key: tuple[object, ...]) -> _Plan:
        """Plan a flat item of a shape not seen yet (under these limits), and remember it."""
        shapes = self._shapes  # before the walk reads the limits: see __setattr__
        plan = self._plan(obj)
        if len(obj) <= _FLAT_MAX:
            if len(shapes) >= _FLAT_SHAPES_MAX:
                shapes.clear()
            shapes[key] = plan._layout
        return plan

    def _plan(self, obj: object) -> _Plan:
        enc = _Encoder(self.max_depth, self.max_ndim, self.max_arrays, self.max_containers)
        try:
            structure = enc.conv(obj, 0)
            header: bytes = self._packer().pack(structure)
        except SerdeError:
            raise
        except MemoryError:
            raise
        except Exception as exc:  # e.g. a surrogate in a str, a hostile __iter__
            raise SerdeError(f"cannot encode value: {exc}") from exc
        if len(header) > self.max_header_bytes:
            raise SerdeError(
                f"structure header of {len(header)} bytes exceeds "
                f"max_header_bytes={self.max_header_bytes} (large str values live in the header)"
            )
        chunks = enc.chunks
        return _new_plan(_layout(header, chunks, enc.cursor), tuple([src for _o, src in chunks]))

    def write(self, plan: EncodePlan, buf: memoryview) -> None:
        """Write ``plan`` into ``buf[0:plan.nbytes]``: every byte of it, and nothing else."""
        if type(plan) is not _Plan and not isinstance(plan, _Plan):
            raise SerdeError(f"not a plan made by MsgpackSerde: {plan!r}")
        try:  # one frame on the put path: the checks and copies, errors made typed
            nbytes, head, blob, slots, gaps = plan._layout
            if type(buf) is not memoryview:
                buf = memoryview(buf)
            # uint8 and one-dimensional: the store's view already is, so this costs little; a
            # buffer that is not C-contiguous is refused here (TypeError)
            buf = buf.cast("B")
            if buf.readonly or len(buf) != nbytes:
                buf = _fit(buf, nbytes)
            buf[head] = blob  # prefix, header and its padding
            for gap, zeros in gaps:  # every byte is written: the chunk held other data
                buf[gap] = zeros
            for (slot, tiny, small), src in zip(slots, plan._sources):
                if tiny:  # C order whatever the layout; a size changed since plan fails here
                    buf[slot] = src.tobytes()
                    continue
                if small:
                    try:  # the raw bytes of a C-contiguous array, without making a numpy view
                        buf[slot] = src.data.cast("B")
                        continue
                    except (TypeError, ValueError, NotImplementedError):
                        pass  # not C-contiguous, or a dtype with no buffer format: numpy's copy
                start: int = slot.start
                if src.nbytes != slot.stop - start:
                    raise SerdeError("a source array changed size since it was planned")
                if src.nbytes:
                    dst = _frombuffer(buf, src.dtype, src.size, start)
                    if src.ndim != 1:
                        dst = dst.reshape(src.shape)
                    dst[...] = src  # see the module docstring: np.copyto's loop, less overhead
        except SerdeError:
            raise
        except MemoryError:
            raise
        except Exception as exc:  # not a writable contiguous buffer; a source changed since plan
            raise SerdeError(f"cannot write plan: {exc}") from exc

    def _compile(self, header: bytes | memoryview, data_off: int, data_len: int) -> _Template:
        """Unpack and validate a structure header into a template (``SerdeError`` if invalid)."""
        hlen = len(header)
        _check_complete(header)
        counter = _NodeCounter(self.max_containers)
        try:
            structure = msgpack.unpackb(
                header,
                raw=False,
                strict_map_key=True,
                use_list=True,
                max_str_len=hlen,
                max_bin_len=hlen,
                max_array_len=hlen,
                max_map_len=hlen,
                max_ext_len=hlen,
                object_hook=counter.container,
                list_hook=counter.container,
                ext_hook=counter.ext,
            )
        except SerdeError:
            raise
        except Exception as exc:
            raise SerdeError(f"malformed structure header: {exc}") from exc
        comp = _Compiler(data_off, data_len, self.max_depth, self.max_ndim, self.max_arrays)
        build, value = comp.conv(structure, 0)
        if comp.cursor != data_len:
            raise SerdeError("data section holds bytes no array refers to")
        return build, value, data_off + data_len

    def read(self, buf: memoryview, *, copy: bool = True) -> object:
        """Decode one payload (exactly ``nbytes`` long). Anything not in our format: SerdeError."""
        try:
            if type(buf) is not memoryview or buf.format != "B" or buf.ndim != 1:
                buf = (buf if type(buf) is memoryview else memoryview(buf)).cast("B")
            size = len(buf)
            if size >= _PREFIX_SIZE:
                # A template is keyed by the prefix and the header: a hit (of the same payload
                # size) implies every check below passed when it was compiled.
                hend = _PREFIX_SIZE + _HLEN.unpack_from(buf, _HLEN_OFFSET)[0]
                if hend <= _TEMPLATE_KEY_MAX:
                    tmpl = self._templates.get(buf[:hend].tobytes())
                    if tmpl is not None and tmpl[2] == size:
                        build = tmpl[0]
                        if build is None:
                            return tmpl[1]
                        return build(buf, buf if copy or buf.readonly else buf.toreadonly(), copy)
            return self._read(buf, size, copy)
        except SerdeError:
            raise
        except MemoryError:
            raise
        except Exception as exc:
            raise SerdeError(f"cannot decode payload: {exc}") from exc

    def _read(self, buf: memoryview, size: int, copy: bool) -> object:
        """``read`` without a template at hand: check the prefix, compile (and keep) one."""
        templates = self._templates  # before the limits are read: see __setattr__
        if size < _PREFIX_SIZE:
            raise SerdeError(f"truncated payload ({size} bytes)")
        magic, version, pflags, hlen, data_len = _PREFIX.unpack_from(buf)
        if magic != _MAGIC:
            raise SerdeError("not an aioshmcache payload (bad magic)")
        if version != _VERSION or pflags != 0:
            raise SerdeError(f"unsupported payload version {version} / flags {pflags}")
        if not 0 < hlen <= self.max_header_bytes:
            raise SerdeError(
                f"header length {hlen} outside (0, max_header_bytes={self.max_header_bytes}]"
            )
        hend = _PREFIX_SIZE + hlen
        data_off = (hend + _ALIGN_MASK) & ~_ALIGN_MASK
        if data_off + data_len != size:
            raise SerdeError(
                f"payload is {size} bytes, its prefix says {data_off + data_len} "
                "(truncated or trailing bytes)"
            )
        if hlen > _TEMPLATE_HEADER_MAX:
            build, value, _ = self._compile(buf[_PREFIX_SIZE:hend], data_off, data_len)
        else:
            # the key is a private copy, and the template is compiled from that copy: bytes
            # changing in shared memory meanwhile cannot give a key another header's template
            key = buf[:hend].tobytes()
            if _PREFIX.unpack_from(key) != (magic, version, pflags, hlen, data_len):
                raise SerdeError("payload prefix changed while it was read")
            tmpl = self._compile(memoryview(key)[_PREFIX_SIZE:], data_off, data_len)
            if len(templates) >= _TEMPLATES_MAX:
                templates.clear()
            templates[key] = tmpl
            build, value, _ = tmpl
        if build is None:
            return value
        # copies may come from the writable view; views must come from a read-only one
        return build(buf, buf if copy or buf.readonly else buf.toreadonly(), copy)

"""The decode side of `MsgpackSerde`: validated descriptors, headers compiled into builders.

The format and what the reader accepts are described in :mod:`.format`; :mod:`.encode` is the
other half. :func:`unpack_bounded` is the one bounded msgpack unpacking of hostile bytes (the
serde's structure header; other parsers of the package call it too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from .._core_api import core
from ..errors import SerdeError
from .format import (
    ALIGN_MASK,
    ARR_HEAD,
    ARR_HEAD_SIZE,
    BYTES_DESC,
    EXT_ARRAY,
    EXT_BYTES,
    EXT_SCALAR,
    EXT_TUPLE,
    FLAG_BF16,
    FLAG_TORCH,
    KNOWN_FLAGS,
    MAX_NDIM_FORMAT,
    PREFIX_SIZE,
    SHAPE_STRUCTS,
    SIZE_MAX,
    TOO_MANY_CONTAINERS,
    check_dtype_string,
)

__all__ = ["NodeCounter", "check_complete", "unpack_bounded"]

_ExtType = msgpack.ExtType
#: a BYTES value's copy out of the chunk: the core's (a big one without the GIL)
_bytes_of = core.bytes_of
_frombuffer = np.frombuffer

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
    if n < ARR_HEAD_SIZE:
        raise SerdeError("malformed array descriptor")
    off, nbytes, flags, ndim, dlen = ARR_HEAD.unpack_from(data)
    if ndim > MAX_NDIM_FORMAT:
        raise SerdeError(f"array has {ndim} dimensions")
    dstart = ARR_HEAD_SIZE + 8 * ndim
    if n != dstart + dlen or flags & ~KNOWN_FLAGS:
        raise SerdeError("malformed array descriptor")
    dt = check_dtype_string(data[dstart:])
    shape: tuple[int, ...] = SHAPE_STRUCTS[ndim].unpack_from(data, ARR_HEAD_SIZE)
    count = math.prod(shape)
    if count == 0:
        if math.prod([d or 1 for d in shape]) * dt.itemsize > SIZE_MAX:
            raise SerdeError("zero-size array with an impossible shape")
    elif count > SIZE_MAX:
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
_TEMPLATE_KEY_MAX = PREFIX_SIZE + _TEMPLATE_HEADER_MAX
_TEMPLATES_MAX = 256
#: what a plain value of an unpacked header may be (anything else is a node to compile, or
#: refused: msgpack unpacks a timestamp record, code -1, into a ``msgpack.Timestamp`` without
#: calling the ext hook, and the format has no such value)
_PLAIN_TYPES = frozenset((str, int, float, bool, bytes, type(None)))


class NodeCounter:
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
            raise SerdeError(f"{TOO_MANY_CONTAINERS} ({self.max})")
        return obj

    def ext(self, code: int, data: bytes) -> msgpack.ExtType:
        if code != EXT_ARRAY and code != EXT_BYTES:  # those are bounded by max_arrays
            self.left -= 1
            if self.left < 0:
                raise SerdeError(f"{TOO_MANY_CONTAINERS} ({self.max})")
        return _ExtType(code, data)


def check_complete(header: bytes | memoryview) -> None:
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


def unpack_bounded(
    data: bytes,
    *,
    max_containers: int,
    maps: bool = True,
    binary: bool = True,
    records: bool = True,
) -> Any:
    """Unpack exactly one msgpack object from hostile ``data``, at a cost bounded by its size.

    The object must be complete (:func:`check_complete`, before msgpack allocates what array
    headers announce); at most ``max_containers`` maps, arrays and extension records other than
    the serde's ARRAY and BYTES are built (:class:`NodeCounter`, counted while msgpack unpacks);
    no string or container may announce more elements than ``data`` has bytes; map keys are
    str or bytes; nothing is converted (extension records come back as ``msgpack.ExtType``).
    ``maps``, ``binary`` and ``records`` False refuse non-empty maps, bin values and extension
    records. ``data`` must be a private copy (``bytes``): it is read twice.

    Raises ``SerdeError`` (incomplete, too many containers) or msgpack's own exceptions
    (``ValueError`` and its kin) for anything else malformed: the caller types those for its
    format.
    """
    check_complete(data)
    n = len(data)
    hooks: dict[str, Any] = {}
    if n > max_containers or records:
        # Each container takes at least a byte: no shorter object can hold too many of them,
        # and one is unpacked without a Python call per container.
        counter = NodeCounter(max_containers)
        hooks = {"object_hook": counter.container, "list_hook": counter.container}
        hooks["ext_hook"] = counter.ext
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        use_list=True,
        max_str_len=n,
        max_bin_len=n if binary else 0,
        max_array_len=n,
        max_map_len=n if maps else 0,
        max_ext_len=n if records else 0,
        **hooks,
    )


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


#: the largest code point a str may hold (numpy makes a ``U`` element above it into a str that
#: breaks CPython's own invariant: ``SystemError`` from ``ord``, invalid UTF-8 from ``encode``)
_MAX_CODE_POINT = 0x10FFFF

#: a ``U`` dtype's code units by its byte order (``=`` is native, ``|`` never a ``U``'s)
_UCS4 = {
    "<": np.dtype(np.uint32).newbyteorder("<"),
    ">": np.dtype(np.uint32).newbyteorder(">"),
    "=": np.dtype(np.uint32),
}


def _check_code_points(raw: np.ndarray[Any, Any]) -> None:
    """``SerdeError`` unless every code point of a C-contiguous ``U`` array is one a str holds."""
    dt = raw.dtype
    codes = raw.reshape(-1).view(_UCS4[dt.byteorder])
    if codes.size and codes.max() > _MAX_CODE_POINT:
        raise SerdeError(f"a {dt.str!r} value holds a code point above U+10FFFF")


def _array_builder(dt: np.dtype[Any], shape: tuple[int, ...], count: int, start: int) -> _Builder:
    """Build one array: a copy, or a read-only view; a ``U`` array's code points are checked."""
    build = _raw_array_builder(dt, shape, count, start)
    if dt.kind != "U" or count == 0:
        return build

    def text(buf: memoryview, ro: memoryview, copy: bool) -> Any:
        arr = build(buf, ro, copy)
        _check_code_points(arr)  # the copy itself, or the view handed out
        return arr

    return text


def _raw_array_builder(
    dt: np.dtype[Any], shape: tuple[int, ...], count: int, start: int
) -> _Builder:
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
            "install torch (pip install -e '.[torch]' in a clone of aioshmcache) to read it"
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
            if _PLAIN_TYPES.issuperset(map(type, obj.values())):
                return _copy_dict_builder(obj), None  # plain values only: one node, not one each
            conv = self.conv
            flat: list[_FlatArray] | None = []
            items: list[tuple[Any, _Builder | None, Any]] = []
            for k, v in obj.items():
                if flat is not None and type(v) is _ExtType and v.code == EXT_ARRAY:
                    dt, shape, count, start, flags = desc = self.array_desc(v.data)
                    # the flat builder makes plain arrays only: no tensor, no empty array, no
                    # ``U`` array (whose code points its own builder checks)
                    plain = not flags and count and dt.kind != "U"
                    if plain:
                        flat.append((k, dt, count, start, None if len(shape) == 1 else shape))
                    items.append((k, self.array_builder(desc), None))
                    if not plain:
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
                if type(first) is _ExtType and first.code == EXT_TUPLE:
                    if first.data:
                        raise SerdeError("malformed tuple marker")
                    rest = values[1:]
                    if _PLAIN_TYPES.issuperset(map(type, rest)):
                        return None, tuple(rest)  # plain values only: shared, immutable
                    nodes = [conv(v, depth) for v in rest]
                    if _is_shared(nodes):
                        return None, tuple([v for _, v in nodes])
                    return _container_builder(tuple, nodes), None
                if _PLAIN_TYPES.issuperset(map(type, values)):
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
        expected = (self.cursor + ALIGN_MASK) & ~ALIGN_MASK
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
        if code == EXT_ARRAY:
            return self.array_builder(self.array_desc(data)), None
        if code == EXT_SCALAR:
            return None, self.scalar(data)
        if code == EXT_BYTES:
            if len(data) != BYTES_DESC.size:
                raise SerdeError("malformed bytes descriptor")
            off, nbytes = BYTES_DESC.unpack(data)
            start = self._slot(off, nbytes)
            end = start + nbytes
            return (lambda buf, ro, copy: _bytes_of(buf[start:end])), None
        if code == EXT_TUPLE:
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
            return _tensor_builder(dt, shape, count, start, bool(flags & FLAG_BF16))
        return _array_builder(dt, shape, count, start)

    @staticmethod
    def scalar(data: bytes) -> object:
        if not data:
            raise SerdeError("malformed scalar descriptor")
        dlen = data[0]
        dt = check_dtype_string(data[1 : 1 + dlen])
        if len(data) != 1 + dlen + dt.itemsize:
            raise SerdeError("scalar byte length does not match its dtype")
        raw = _frombuffer(data, dt, 1, 1 + dlen)
        if dt.kind == "U":
            _check_code_points(raw)
        return raw[0]  # immutable: shared by every read

    @staticmethod
    def check_tensor(dt: np.dtype[Any], flags: int) -> None:
        if not flags & FLAG_TORCH:
            raise SerdeError("malformed array flags")
        if flags & FLAG_BF16 and dt.str != "<u2":
            raise SerdeError("a bfloat16 tensor must be stored as '<u2'")
        if dt.kind not in "biufc" or dt.byteorder == ">":
            raise SerdeError(f"dtype {dt.str!r} cannot be a torch tensor")
        _import_torch()  # fail here, in walk order, as an uncompiled read would

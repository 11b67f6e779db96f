"""The payload format of :class:`~aioshmcache.MsgpackSerde`: every byte, in one place.

This docstring is the format's reference; the constants below are the only definition of its
numbers and structs (:mod:`.encode` writes them, :mod:`.decode` checks them). What the format
allows of a dtype is decided here too (:func:`check_dtype_string`), for both halves.

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
it). No pickle, no hook that decodes anything (:mod:`.decode`'s hooks only count): the header length
is checked against ``max_header_bytes`` before unpacking (this plays the role of msgpack's
``max_buffer_size``, which ``unpackb`` does not take), ``msgpack.unpackb`` runs with
``raw=False, strict_map_key=True`` and explicit ``max_*_len`` limits (trailing bytes are an
error), and the result is walked with a depth limit,
converting ``ExtType`` records after validating each descriptor: dtype string against a whitelist
regex, then ``np.dtype`` and a check that it round-trips to the same canonical string with an
allowed kind; ``ndim``; ``prod(shape) * itemsize == nbytes`` in Python integers; the canonical
offset; the code points of a ``U`` array or scalar (at most U+10FFFF: numpy would make a larger
one into a str CPython cannot hold), in each array as it is read. Any other value msgpack may
unpack (its own timestamp record, code -1, which it turns into a ``msgpack.Timestamp`` without
calling the ext hook) is refused wherever it stands, inside a container too. Every failure is a
:class:`~aioshmcache.errors.SerdeError`.

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
(:func:`.decode.check_complete`). Plain values cost at most a few times
their encoded size: a list or map whose values are all plain (no container, no record) is
compiled into one copy of it, not one node per element.
"""

from __future__ import annotations

import re
import struct
from typing import Any, Final

import numpy as np

from ..errors import SerdeError

__all__ = [
    "ALIGN",
    "ALIGN_MASK",
    "ARR_HEAD",
    "ARR_HEAD_SIZE",
    "ARR_STRUCTS",
    "BYTES_DESC",
    "DTYPE_CACHE_MAX",
    "EXT_ARRAY",
    "EXT_BYTES",
    "EXT_SCALAR",
    "EXT_TUPLE",
    "FLAG_BF16",
    "FLAG_TORCH",
    "HLEN",
    "HLEN_OFFSET",
    "INLINE_BYTES_MAX",
    "INT_MAX",
    "INT_MIN",
    "KNOWN_FLAGS",
    "MAGIC",
    "MAX_NDIM_FORMAT",
    "PREFIX",
    "MAX_DATA_BYTES",
    "PREFIX_SIZE",
    "SCALAR_HEAD",
    "SHAPE_STRUCTS",
    "SIZE_MAX",
    "TOO_MANY_CONTAINERS",
    "VERSION",
    "allowed_kind",
    "check_dtype_string",
]

# --- the prefix -------------------------------------------------------------------------------

MAGIC: Final = b"ASHM"
VERSION: Final = 1
PREFIX: Final = struct.Struct("<4sHHIQ")
PREFIX_SIZE: Final = PREFIX.size  # 20
#: the prefix's data length field: the most bytes a payload's arrays can take, in all
MAX_DATA_BYTES: Final = (1 << 64) - 1
HLEN: Final = struct.Struct("<I")  # the prefix's header_len alone
HLEN_OFFSET: Final = 8
ALIGN: Final = 64
ALIGN_MASK: Final = ALIGN - 1

# --- the structure header's extension records -------------------------------------------------

EXT_ARRAY: Final = 1
EXT_SCALAR: Final = 2
EXT_TUPLE: Final = 3
EXT_BYTES: Final = 4

FLAG_TORCH: Final = 1
FLAG_BF16: Final = 2
KNOWN_FLAGS: Final = FLAG_TORCH | FLAG_BF16

ARR_HEAD: Final = struct.Struct("<QQBBB")
ARR_HEAD_SIZE: Final = ARR_HEAD.size  # 19
MAX_NDIM_FORMAT: Final = 64  # numpy's own limit (NPY_MAXDIMS in numpy 2)
#: an ARRAY record without its dtype string, by ndim (the encoder packs one in one call)
ARR_STRUCTS: Final = tuple(struct.Struct(f"<QQBBB{n}Q") for n in range(MAX_NDIM_FORMAT + 1))
#: the dims of an ARRAY record, by ndim
SHAPE_STRUCTS: Final = tuple(struct.Struct(f"<{n}Q") for n in range(MAX_NDIM_FORMAT + 1))
BYTES_DESC: Final = struct.Struct("<QQ")
SCALAR_HEAD: Final = struct.Struct("<B")  # a SCALAR record's dtype_len

INLINE_BYTES_MAX: Final = 1023  # bytes values longer than this go to the data section
INT_MIN: Final = -(1 << 63)  # msgpack's range of integers
INT_MAX: Final = (1 << 64) - 1
SIZE_MAX: Final = (1 << 62) - 1  # bound on any array's element count / byte size (fits npy_intp)

#: what a header with more nodes than ``max_containers`` is refused with (both halves count)
TOO_MANY_CONTAINERS: Final = (
    "more containers (maps, lists, tuples, numpy scalars) than max_containers allows"
)

# --- dtypes -----------------------------------------------------------------------------------

_ALLOWED_KINDS = frozenset("biufcSUmM")
_DTYPE_RE = re.compile(
    rb"[<>|](?:[biufc][1-9][0-9]?|[SU][1-9][0-9]{0,8}"
    rb"|[mM]8(?:\[(?:[1-9][0-9]{0,8})?(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?)"
)
#: bound of each dtype cache (descriptor bytes -> dtype here, dtype -> bytes in the encoder)
DTYPE_CACHE_MAX: Final = 512
# Only dtypes that passed validation are cached.
_DEC_DTYPES: dict[bytes, np.dtype[Any]] = {}


def check_dtype_string(raw: bytes) -> np.dtype[Any]:
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
    if len(_DEC_DTYPES) < DTYPE_CACHE_MAX:
        _DEC_DTYPES[raw] = dt
    return dt


def allowed_kind(dt: np.dtype[Any]) -> bool:
    """Whether arrays of ``dt``'s kind may be carried at all (the encoder asks before packing)."""
    return not dt.hasobject and dt.fields is None and dt.kind in _ALLOWED_KINDS

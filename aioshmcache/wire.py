"""The wire: a request's features to bytes and back, and length-prefixed frames.

A gateway hands each request's features to an engine worker over a socket or a pipe. Most are
small references (``ShmRef``), but any of them may be the item itself, served inline because it
was too large to cache or the cache was full; that path runs only under load, so a hand-written
JSON line that works in a quiet test overflows asyncio's 64 KiB ``readline`` limit in production.
:func:`pack_features` / :func:`unpack_features` carry both kinds, and the frame helpers
(:func:`read_frame` / :func:`write_frame` for asyncio streams, :func:`receive_frame` /
:func:`send_frame` for anyio byte streams, :func:`encode_frame` / :class:`FrameDecoder` for
plain buffers) delimit messages of any size up to an explicit ``max_bytes``.

Message format: one payload of the store's own serde (:class:`~aioshmcache.MsgpackSerde`, see
``aioshmcache._serde.format`` for the byte layout) whose value is::

    ["aioshmcache.wire", 1, [feature, ...]]
    feature = [mm_hash, kind, data, identifier, prompt_updates]
        mm_hash         str
        kind 0          data is None
        kind 1          data is a reference, eight unsigned 64-bit ints (the ``ShmRef``
                        fields in order: nonce, epoch, address, id, length, tag, position, seq)
        kind 2          data is an inline item, anything the serde carries
        identifier      str or None
        prompt_updates  list or tuple of serde values

Reusing the serde rather than writing a second format means one set of rules and one hostile-input
decoder: no pickle, no decoding hook that builds anything; the structure header is unpacked with
explicit ``max_*_len`` limits and a bound on its containers (``max_containers``: a message of
1 MiB of empty maps or lists is refused after 32,768 of them, not unpacked into a million);
arrays travel as raw bytes at canonical 64-byte aligned offsets, their dtype checked against a
whitelist, their shape against their byte length; trailing bytes are an error. Every decoding
failure is a ``SerdeError``, or a ``WireError`` when the value decodes but is not a features
message (both are ``ValueError``s).
The limits are the serde's (same names, same defaults), counted over the whole message (the
wrapping counts too: two lists, and per feature its row, its reference and its prompt updates);
``max_depth`` counts from the item, as in the store, although the message wraps items in three
more levels.

Frame format: an 8-byte little-endian unsigned length, then that many payload bytes. The length is
checked against ``max_bytes`` before any of the payload is read; payload bytes are then gathered
as they arrive, so a peer that declares a huge length makes the receiver hold only what it really
sent. A frame that cannot be read raises ``FrameTooLargeError`` or ``IncompleteFrameError``
(``FrameError`` once a stream is out of step); the stream should then be closed. A stream that
ends cleanly between frames raises ``EndOfFramesError`` (an ``EOFError``, like
``IncompleteFrameError``). A read or
write that is cancelled part-way also leaves the stream mid-frame: close it. One framing per I/O
style, all on the same rules: asyncio streams, anyio byte streams, plain buffers (the engine
channel's connections feed a :class:`FrameDecoder` from their protocol); every writer takes its
pieces from :func:`frame_parts` (frames joined into one buffer up to 256 KiB).

The plain form (for the engine channel; not in ``__all__``): a message of references and
``None``s without prompt updates may travel as its value packed with plain msgpack
(:func:`pack_plain_features`), which :func:`unpack_features_any` reads beside the serde form
under the same bounds (:func:`unpack_bounded`: the serde's bounds for a structure header).

Layering: this module stands on the serde and the value types only (nothing of the cache), so
any process that carries features can use it without a cache.
"""

from __future__ import annotations

import asyncio
import functools
import struct
from collections.abc import Sequence
from typing import Any

import anyio
import msgpack
from anyio.abc import AnyByteSendStream, ByteReceiveStream

from ._core_api import core
from ._serde import MsgpackSerde
from ._serde.decode import unpack_bounded as _unpack_bounded
from ._types import FeatureSpec, ShmRef, as_reference
from .errors import (
    EndOfFramesError,
    FrameError,
    FrameTooLargeError,
    IncompleteFrameError,
    InvalidReferenceError,
    SerdeError,
    WireError,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "FRAME_PREFIX_BYTES",
    "FrameDecoder",
    "encode_frame",
    "pack_features",
    "read_frame",
    "receive_frame",
    "send_frame",
    "unpack_features",
    "write_frame",
]

Buffer = bytes | bytearray | memoryview

#: Default bound on one frame's payload (256 MiB); pass ``max_bytes=`` for larger inline items.
DEFAULT_MAX_FRAME_BYTES = 256 << 20
#: Size of a frame's length prefix (an unsigned 64-bit little-endian int).
FRAME_PREFIX_BYTES = 8

_TAG = "aioshmcache.wire"
_VERSION = 1
_KIND_NONE, _KIND_REF, _KIND_ITEM = 0, 1, 2
_REF_FIELDS = len(ShmRef._fields)
_U64 = (1 << 64) - 1
_LENGTH = struct.Struct("<Q")
_WRAP_DEPTH = 3  # message list > features list > feature list > the item
_JOIN_BELOW = 256 << 10  # frames up to this size in all are written as one buffer
_RECEIVE_CHUNK = 1 << 20  # never ask a stream for more at once (trio's recv(n) allocates n)

# The serde's defaults (MsgpackSerde's keyword arguments), and ours.
_MAX_HEADER_BYTES = 1 << 20
_MAX_ARRAYS = 4096
_MAX_NDIM = 32
_MAX_DEPTH = 64
_MAX_FEATURES = 4096
_MAX_CONTAINERS = 1 << 15
_core_cut = core.chan_cut  # ``FrameDecoder._cut`` compiled (``_core_chan.c``), or declining
#: first bytes of a msgpack array (fixarray, array 16, array 32): a message in the plain form
_MSGPACK_ARRAY_FIRST = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))


@functools.lru_cache(maxsize=16)
def _serde(
    max_header_bytes: int, max_arrays: int, max_ndim: int, max_depth: int, max_containers: int
) -> MsgpackSerde:
    if type(max_depth) is not int or not 1 <= max_depth <= 256 - _WRAP_DEPTH:
        raise ValueError(f"max_depth must be an int in [1, {256 - _WRAP_DEPTH}], got {max_depth!r}")
    return MsgpackSerde(
        max_header_bytes=max_header_bytes,
        max_arrays=max_arrays,
        max_ndim=max_ndim,
        max_depth=max_depth + _WRAP_DEPTH,
        max_containers=max_containers,
    )


def _check_max_features(max_features: int) -> None:
    if type(max_features) is not int or max_features < 0:
        raise ValueError(f"max_features must be a non-negative int, got {max_features!r}")


def _reference_row(ref: ShmRef) -> list[int]:
    for name, value in zip(ShmRef._fields, ref):
        if type(value) is not int or not 0 <= value <= _U64:
            raise InvalidReferenceError(f"reference field {name!r} must be an unsigned 64-bit int")
    return list(ref)


def pack_features(
    features: Sequence[FeatureSpec],
    *,
    max_header_bytes: int = _MAX_HEADER_BYTES,
    max_arrays: int = _MAX_ARRAYS,
    max_ndim: int = _MAX_NDIM,
    max_depth: int = _MAX_DEPTH,
    max_features: int = _MAX_FEATURES,
    max_containers: int = _MAX_CONTAINERS,
) -> bytes:
    """Encode a request's features as one message: references compact, inline items as arrays.

    Each ``FeatureSpec`` keeps its ``mm_hash``, ``identifier`` and ``prompt_updates``; its data is
    ``None``, a reference (a ``ShmRef`` or its dict) or an inline item (a mapping of field name to
    anything ``MsgpackSerde`` carries: arrays, numpy scalars, numbers, str, bytes, lists, tuples,
    dicts). ``prompt_updates`` must be a list or tuple of such values (no arbitrary objects: this
    is not pickle). Arrays are copied once into the message, non-contiguous ones made contiguous.

    The limits are those :func:`unpack_features` applies by default: a message the receiver would
    refuse is refused here (``SerdeError``). ``TypeError`` for a value that is not a sequence of
    ``FeatureSpec`` with a str ``mm_hash``, a str-or-None ``identifier`` and a list/tuple of
    ``prompt_updates``; ``InvalidReferenceError`` for a malformed reference.
    """
    if isinstance(features, (str, bytes, FeatureSpec)) or not isinstance(features, Sequence):
        raise TypeError(
            f"features must be a sequence of FeatureSpec, not {type(features).__name__}"
        )
    _check_max_features(max_features)
    if len(features) > max_features:
        raise WireError(f"{len(features)} features exceed max_features={max_features}")
    serde = _serde(max_header_bytes, max_arrays, max_ndim, max_depth, max_containers)
    rows: list[list[Any]] = []
    for i, f in enumerate(features):
        if not isinstance(f, FeatureSpec):
            raise TypeError(f"features[{i}] must be a FeatureSpec, not {type(f).__name__}")
        if not isinstance(f.mm_hash, str):
            raise TypeError(f"features[{i}].mm_hash must be a str, not {type(f.mm_hash).__name__}")
        if f.identifier is not None and not isinstance(f.identifier, str):
            raise TypeError(
                f"features[{i}].identifier must be a str or None, not {type(f.identifier).__name__}"
            )
        if not isinstance(f.prompt_updates, (list, tuple)):
            raise TypeError(
                f"features[{i}].prompt_updates must be a list or tuple, "
                f"not {type(f.prompt_updates).__name__}"
            )
        data = f.data
        if data is None:
            row: list[Any] = [f.mm_hash, _KIND_NONE, None, f.identifier, f.prompt_updates]
        else:
            ref = as_reference(data)
            if ref is not None:
                row = [f.mm_hash, _KIND_REF, _reference_row(ref), f.identifier, f.prompt_updates]
            else:
                row = [f.mm_hash, _KIND_ITEM, data, f.identifier, f.prompt_updates]
        rows.append(row)
    plan = serde.plan([_TAG, _VERSION, rows])
    out = bytearray(plan.nbytes)
    serde.write(plan, memoryview(out))
    return bytes(out)


def unpack_features(
    data: Buffer,
    *,
    copy: bool = False,
    max_header_bytes: int = _MAX_HEADER_BYTES,
    max_arrays: int = _MAX_ARRAYS,
    max_ndim: int = _MAX_NDIM,
    max_depth: int = _MAX_DEPTH,
    max_features: int = _MAX_FEATURES,
    max_containers: int = _MAX_CONTAINERS,
) -> list[FeatureSpec]:
    """Decode a message made by :func:`pack_features` into new ``FeatureSpec`` objects.

    The bytes are treated as hostile: anything that is not exactly one well-formed message within
    the limits raises ``SerdeError`` (``WireError`` when it decodes but is not a features
    message); nothing executable is ever decoded. References come back as ``ShmRef`` (checked to
    be eight unsigned 64-bit ints; the receiver cache validates them against its segment).

    Zero-copy by default: the arrays of inline items are read-only ``np.frombuffer`` views that
    alias ``data`` (which stays exported, so a ``bytearray`` cannot be resized, while they live),
    and are read-only even when ``data`` is writable. ``copy=True`` gives writable arrays that own
    their memory. Large ``bytes`` values are copies either way.
    """
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(
            f"data must be bytes, bytearray or memoryview, not {type(data).__name__}"
        ) from None
    _check_max_features(max_features)
    serde = _serde(max_header_bytes, max_arrays, max_ndim, max_depth, max_containers)
    value = serde.read(view, copy=copy)
    try:
        return _features(value, max_features)
    except (SerdeError, WireError, MemoryError):
        raise
    except Exception as exc:  # a safety net: whatever slipped past the checks is still typed
        raise WireError(f"malformed features message: {exc}") from exc


def _features(value: object, max_features: int) -> list[FeatureSpec]:
    if type(value) is not list or len(value) != 3 or type(value[0]) is not str or value[0] != _TAG:
        raise WireError("not an aioshmcache.wire features message")
    version, rows = value[1], value[2]
    if type(version) is not int or version != _VERSION:
        raise WireError(f"unsupported wire version {version!r} (this side reads {_VERSION})")
    if type(rows) is not list:
        raise WireError("malformed features message: the features are not a list")
    if len(rows) > max_features:
        raise WireError(f"{len(rows)} features exceed max_features={max_features}")
    out: list[FeatureSpec] = []
    for i, row in enumerate(rows):
        if type(row) is not list or len(row) != 5:
            raise WireError(f"feature {i} is malformed")
        mm_hash, kind, item, identifier, prompt_updates = row
        if type(mm_hash) is not str:
            raise WireError(f"feature {i}: mm_hash is not a str")
        if identifier is not None and type(identifier) is not str:
            raise WireError(f"feature {i}: identifier is not a str")
        if type(prompt_updates) is not list and type(prompt_updates) is not tuple:
            raise WireError(f"feature {i}: prompt_updates is not a list or tuple")
        if type(kind) is not int:
            raise WireError(f"feature {i}: unknown data kind")
        if kind == _KIND_NONE:
            if item is not None:
                raise WireError(f"feature {i}: data of kind 'none' is not None")
        elif kind == _KIND_REF:
            if (
                type(item) is not list
                or len(item) != _REF_FIELDS
                or not all(type(v) is int and 0 <= v <= _U64 for v in item)
            ):
                raise WireError(f"feature {i}: malformed reference")
            item = ShmRef(*item)
        elif kind == _KIND_ITEM:
            if item is None:
                raise WireError(f"feature {i}: inline item is None")
        else:
            raise WireError(f"feature {i}: unknown data kind {kind}")
        out.append(FeatureSpec(mm_hash, item, identifier=identifier, prompt_updates=prompt_updates))
    return out


def pack_plain_features(features: Sequence[FeatureSpec]) -> bytes | None:
    """The message's plain form, for references and ``None``s without prompt updates, or None.

    The plain form is the message's value packed with plain msgpack instead of the serde: the
    serde's decoder keeps a compiled template per distinct header, and every hand-out's
    reference makes a new header (a template compiled per message: 15-40 us), so a message of
    references is cheaper this way. ``None`` when a feature does not fit the form (an inline
    item, prompt updates, a malformed feature): use :func:`pack_features`, whose errors say why.
    """
    if len(features) > _MAX_FEATURES:
        return None
    rows: list[list[Any]] = []
    for f in features:
        if not isinstance(f, FeatureSpec):  # :func:`pack_features` says why
            return None
        data = f.data
        if (
            type(f.mm_hash) is not str
            or f.prompt_updates != ()
            or not (f.identifier is None or type(f.identifier) is str)
        ):
            return None
        if data is None:
            rows.append([f.mm_hash, _KIND_NONE, None, f.identifier, []])
        elif type(data) is ShmRef:
            rows.append([f.mm_hash, _KIND_REF, _reference_row(data), f.identifier, []])
        else:
            return None
    try:
        packed: bytes = msgpack.packb([_TAG, _VERSION, rows])
    except ValueError:  # a str UTF-8 cannot encode (a lone surrogate): pack_features says why
        return None
    return packed


def is_plain(data: Buffer) -> bool:
    """Whether ``data`` starts as a msgpack array (the plain form), not as a serde payload."""
    return len(data) > 0 and data[0] in _MSGPACK_ARRAY_FIRST


def unpack_bounded(
    data: bytes, *, max_containers: int = _MAX_CONTAINERS, maps: bool = False
) -> Any:
    """Plain msgpack ``data`` unpacked under the bounds the serde puts on a structure header.

    Complete before it is unpacked (an array header cannot make msgpack allocate what the bytes
    do not hold), at most ``max_containers`` lists and maps, every length bounded by the size,
    no extensions, no maps unless ``maps``, map keys str or bytes; bin values are allowed when
    ``maps`` is (the serde's one bounded unpack, typed for the wire). ``WireError`` for anything
    else (malformed, too deep, bad UTF-8, trailing bytes).
    """
    try:
        return _unpack_bounded(
            data, max_containers=max_containers, maps=maps, binary=maps, records=False
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack's (malformed, too deep, bad UTF-8), the bounds', the rest
        raise WireError(f"malformed plain message: {exc}") from exc


def unpack_features_any(data: bytes) -> list[FeatureSpec]:
    """A message in either form (:func:`pack_plain_features`'s or :func:`pack_features`'s).

    The plain form is as hostile as any input: unpacked by :func:`unpack_bounded`, then
    checked as the serde form is; it may hold only references and ``None``s, without prompt
    updates. ``WireError`` for anything else.
    """
    if not is_plain(data):
        return unpack_features(data)
    value = unpack_bounded(data)
    try:
        for row in value[2] if type(value) is list and len(value) == 3 else ():
            if type(row) is list and len(row) == 5:
                if row[4] != []:
                    raise WireError("prompt updates in a plain features message")
                row[4] = ()  # as the serde form reads them
        features = _features(value, _MAX_FEATURES)
    except WireError:
        raise
    except Exception as exc:  # a safety net: whatever slipped past the checks is still typed
        raise WireError(f"malformed features message: {exc}") from exc
    for f in features:
        if f.data is not None and type(f.data) is not ShmRef:
            raise WireError("an inline item in a plain features message")
    return features


# --- frames ------------------------------------------------------------------------------------


def _payload_view(data: Buffer) -> memoryview:
    """``data`` as a flat byte view (a non-contiguous buffer is copied)."""
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(
            f"frame data must be bytes, bytearray or memoryview, not {type(data).__name__}"
        ) from None
    if not mv.c_contiguous:
        return memoryview(mv.tobytes())
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _check_max_bytes(max_bytes: int) -> int:
    if type(max_bytes) is not int or not 0 <= max_bytes <= _U64:
        raise ValueError(f"max_bytes must be an int in [0, 2**64), got {max_bytes!r}")
    return max_bytes


def _too_large(n: int, max_bytes: int, what: str) -> FrameTooLargeError:
    return FrameTooLargeError(
        f"{what} of {n} bytes exceeds max_bytes={max_bytes}", nbytes=n, max_bytes=max_bytes
    )


def _prefix_for(mv: memoryview, max_bytes: int) -> bytes:
    n = mv.nbytes
    if n > _check_max_bytes(max_bytes):
        raise _too_large(n, max_bytes, "frame")
    return _LENGTH.pack(n)


def _declared_length(prefix: bytes, max_bytes: int) -> int:
    (n,) = _LENGTH.unpack(prefix)
    if n > max_bytes:
        raise _too_large(n, max_bytes, "incoming frame")
    return int(n)


def encode_frame(data: Buffer, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """One frame as bytes: the 8-byte length prefix, then ``data``.

    For transports without a stream helper here (a pipe, a file, a message queue).
    ``FrameTooLargeError`` if ``data`` is longer than ``max_bytes``: the receiver would refuse it.
    """
    mv = _payload_view(data)
    return b"".join((_prefix_for(mv, max_bytes), mv))


def frame_parts(
    payloads: Sequence[Buffer], *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> list[Buffer]:
    """The frames of ``payloads``, in a row, as the pieces to write (the streams' helpers' own).

    Up to 256 KiB in all they are joined into one buffer, so that the peer wakes once for the
    whole message, not once per piece (asyncio's ``writelines`` writes each piece on its own);
    larger ones are left as prefixes and payloads, not copied. ``FrameTooLargeError`` (nothing
    to write) if a payload is longer than ``max_bytes``.
    """
    _check_max_bytes(max_bytes)
    parts: list[Buffer] = []
    total = 0
    for data in payloads:
        if type(data) is bytes:
            piece: Buffer = data
            n = len(data)
        else:
            view = _payload_view(data)
            piece, n = view, view.nbytes
        if n > max_bytes:
            raise _too_large(n, max_bytes, "frame")
        parts += (_LENGTH.pack(n), piece)
        total += FRAME_PREFIX_BYTES + n
    if total <= _JOIN_BELOW:
        return [b"".join(parts)]
    return parts


class FrameDecoder:
    """Split a byte stream fed in pieces of any size into frames (the sync twin of read_frame).

    ``feed`` returns the frames completed so far. A declared length over ``max_bytes`` raises
    ``FrameTooLargeError`` as soon as the prefix is in; after that error the decoder is out of
    step and every later ``feed`` raises ``FrameError``. At the end of the input, call
    :meth:`close`: ``IncompleteFrameError`` if a frame was cut short.
    """

    __slots__ = ("_broken", "_buf", "max_bytes")

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_bytes = _check_max_bytes(max_bytes)
        self._buf = bytearray()
        self._broken: FrameTooLargeError | None = None

    @property
    def pending(self) -> int:
        """Bytes received that do not form a whole frame yet."""
        return len(self._buf)

    def feed(self, data: Buffer) -> list[bytes]:
        """Add bytes; return every frame they complete (possibly none), in order."""
        if self._broken is not None:
            raise FrameError(f"the stream is out of step after an earlier error: {self._broken}")
        if not self._buf and type(data) is bytes:  # nothing pending: cut the bytes themselves
            frames, pos = self._cut(data, len(data))
            if pos < len(data):
                self._buf += memoryview(data)[pos:]
            return frames
        self._buf += _payload_view(data)
        with memoryview(self._buf) as mv:
            frames, pos = self._cut(mv, len(mv))
        if pos:
            del self._buf[:pos]
        return frames

    def _cut(self, src: bytes | memoryview, size: int) -> tuple[list[bytes], int]:
        """The whole frames at the start of ``src``, and where the rest begins."""
        cut = _core_cut(src, self.max_bytes)  # compiled; None for an over-long declared frame
        if cut is not None:
            return cut
        frames: list[bytes] = []
        pos = 0
        while size - pos >= FRAME_PREFIX_BYTES:
            (n,) = _LENGTH.unpack_from(src, pos)
            if n > self.max_bytes:
                self._broken = _too_large(n, self.max_bytes, "incoming frame")
                raise self._broken
            end = pos + FRAME_PREFIX_BYTES + n
            if end > size:
                break
            frames.append(bytes(src[pos + FRAME_PREFIX_BYTES : end]))  # one copy (bytes: none more)
            pos = end
        return frames, pos

    def close(self) -> None:
        """Declare the end of the input: ``IncompleteFrameError`` if part of a frame is pending."""
        if self._buf:
            expected = FRAME_PREFIX_BYTES
            if len(self._buf) >= FRAME_PREFIX_BYTES:
                expected += _LENGTH.unpack_from(self._buf)[0]
            received = len(self._buf)
            self._buf.clear()
            raise IncompleteFrameError(
                f"the input ended inside a frame ({received} of {expected} bytes)",
                received=received,
                expected=expected,
            )


async def read_frame(
    reader: asyncio.StreamReader, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> bytes:
    """Read one frame's payload from an asyncio stream.

    Uses ``readexactly``, so frames of any size pass regardless of the reader's 64 KiB ``limit``
    (which bounds only ``readline`` / ``readuntil``). ``EndOfFramesError`` if the stream ended
    cleanly before the frame; ``IncompleteFrameError`` if it ended inside one;
    ``FrameTooLargeError`` for a declared length over ``max_bytes`` (no payload byte read).
    """
    _check_max_bytes(max_bytes)
    try:
        prefix = await reader.readexactly(FRAME_PREFIX_BYTES)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise EndOfFramesError("the stream ended (no more frames)") from None
        raise _incomplete(len(exc.partial), FRAME_PREFIX_BYTES) from None
    n = _declared_length(prefix, max_bytes)
    if n == 0:
        return b""
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise _incomplete(FRAME_PREFIX_BYTES + len(exc.partial), FRAME_PREFIX_BYTES + n) from None


async def write_frame(
    writer: asyncio.StreamWriter, data: Buffer, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> None:
    """Write one frame to an asyncio stream and wait for the transport to drain.

    ``FrameTooLargeError`` (nothing written) if ``data`` is longer than ``max_bytes``, the limit
    the receiving side applies. Do not change a mutable ``data`` until this returns.
    """
    writer.writelines(frame_parts((data,), max_bytes=max_bytes))
    await writer.drain()


def _incomplete(received: int, expected: int) -> IncompleteFrameError:
    return IncompleteFrameError(
        f"the stream ended inside a frame ({received} of {expected} bytes)",
        received=received,
        expected=expected,
    )


async def _receive_exactly(stream: ByteReceiveStream, n: int, before: int, total: int) -> bytes:
    """Exactly ``n`` bytes from ``stream``; ``before`` / ``total`` describe the frame for errors."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        try:
            chunk = await stream.receive(min(n - got, _RECEIVE_CHUNK))
        except anyio.EndOfStream:
            if before + got == 0:
                raise EndOfFramesError("the stream ended (no more frames)") from None
            raise _incomplete(before + got, total) from None
        if len(chunk) > n - got:
            raise FrameError(f"{type(stream).__name__}.receive returned more bytes than asked")
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def receive_frame(
    stream: ByteReceiveStream, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> bytes:
    """Receive one frame's payload from an anyio byte stream (a socket, TLS, a buffered stream).

    Asks the stream for no more than the frame needs, so nothing of the next frame is consumed.
    An ``ObjectReceiveStream[bytes]`` (a memory object stream) has no byte boundaries: wrap it
    once in ``anyio.streams.buffered.BufferedByteReceiveStream`` and keep using that wrapper.
    Errors as :func:`read_frame`.
    """
    if not isinstance(stream, ByteReceiveStream):
        raise TypeError(
            f"receive_frame needs an anyio ByteReceiveStream, not {type(stream).__name__}; "
            "wrap an object stream of bytes in anyio.streams.buffered.BufferedByteReceiveStream"
        )
    _check_max_bytes(max_bytes)
    prefix = await _receive_exactly(stream, FRAME_PREFIX_BYTES, 0, FRAME_PREFIX_BYTES)
    n = _declared_length(prefix, max_bytes)
    if n == 0:
        return b""
    return await _receive_exactly(stream, n, FRAME_PREFIX_BYTES, FRAME_PREFIX_BYTES + n)


async def send_frame(
    stream: AnyByteSendStream, data: Buffer, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> None:
    """Send one frame on an anyio byte stream (or an object stream of bytes).

    ``FrameTooLargeError`` (nothing sent) if ``data`` is longer than ``max_bytes``. A small frame
    goes out as one ``send``; a large one as the prefix, then the payload (no concatenated copy).
    """
    for part in frame_parts((data,), max_bytes=max_bytes):
        if type(part) is not bytes:  # the payload of a large frame: no concatenated copy
            part = data if type(data) is bytes else bytes(part)
        await stream.send(part)

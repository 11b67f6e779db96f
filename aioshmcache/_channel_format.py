"""The channel's messages: a call, an answer, an error frame; built and parsed here only.

Everything travels in ``aioshmcache.wire`` frames (8-byte length, payload). A call is two
frames, a response one::

    call      frame 1: ["aioshmcache.channel", 4, "call", payload, [row, ...]]  (plain msgpack)
                       row = [mm_hash, identifier, reference]
                           mm_hash     str
                           identifier  str or None
                           reference   None (the feature's data is None), or 64 bytes (bin):
                                       the ``ShmRef`` fields as eight little-endian unsigned
                                       64-bit ints, in order (nonce, epoch, address, id,
                                       length, tag, position, seq)
              frame 2: empty
      or (version 3, any other call)
              frame 1: envelope ["aioshmcache.channel", 3, "call", payload]
              frame 2: wire.pack_features(features), or, for references and Nones without
                       prompt updates, that message's plain form (wire.pack_plain_features)
    response  frame:   envelope ["aioshmcache.channel", 1, "ok", result]
                    or ["aioshmcache.channel", 1, "error", kind, remote_type, message,
                        mm_hashes, unread]

Version 4 is the usual call in one message: references and ``None``s without prompt updates,
a payload that plain msgpack carries (below). It is unpacked once, under the same bounds as a
plain envelope, and its references need no per-field check (eight u64 by construction; the
receiver validates them against its segment). Its second frame is empty so that a worker that
does not read version 4 answers ``bad_request`` at once rather than waiting for a second frame.

An envelope is plain msgpack when its value is made of dicts, lists, str, bytes, int, float,
bool and None only (exactly those types: a tuple, a numpy array or scalar, a subclass is not),
and a payload of the store's own serde otherwise (``MsgpackSerde``: msgpack with size limits,
numpy arrays as raw aligned bytes; never pickle). The first byte tells the two apart (a msgpack
array marker, or the serde's ``ASHM``); a plain envelope is unpacked under the serde's bounds
for a structure header (``wire.unpack_bounded``: complete first, at most 32,768 containers,
lengths bounded by its size, str or bytes map keys, no extensions). A map key of another type
(an int, None) travels in neither form (the serde refuses it too): a payload or a result
holding one cannot be encoded. A worker answers in plain msgpack
only to a call of version 3 or 4 (whose gateway reads both forms); it serves calls of versions
1 (the features always a serde message), 2 (the envelope always the serde's), 3 and 4.

``kind`` is one of ``cache_miss``, ``writer_gone``, ``stale_reference``, ``invalid_reference``,
``reader_evicted`` (the cache's errors while reading the features, raised on the gateway as the
same types), ``bad_request`` (the worker could not decode the call: ``WireError``),
``bad_response`` (the handler's result cannot be encoded, or its answer would exceed the
worker's ``max_frame_bytes``: ``WireError``) and ``handler`` (the handler raised:
``EngineCallError`` with ``remote_type``). ``unread`` says the worker did not read the call's
references: the client then gives them back to its cache.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Final

import msgpack

from . import wire
from ._core_api import core
from ._serde import MsgpackSerde
from ._types import FeatureSpec, ShmRef
from .errors import (
    CacheMissError,
    EngineCallError,
    InvalidReferenceError,
    ReaderEvictedError,
    SerdeError,
    ShmCacheError,
    StaleReferenceError,
    WireError,
    WriterGoneError,
)

__all__ = [
    "ANSWER_VERSION",
    "CALL_VERSION",
    "CALL_VERSIONS",
    "TAG",
    "call_envelope",
    "call_frames",
    "framed_call",
    "decode",
    "decode_call",
    "encode",
    "error_frame",
    "pack_call_features",
    "raise_error",
    "unpack_call_features",
]

TAG: Final = "aioshmcache.channel"
ANSWER_VERSION: Final = 1
#: 3: the envelope may be plain msgpack, and so may the answer (module docstring)
CALL_VERSION: Final = 3
#: 4: the call and its features in one plain message (module docstring)
ONE_MESSAGE_VERSION: Final = 4
CALL_VERSIONS: Final = (1, 2, 3, 4)
#: calls of this version and later read an answer in plain msgpack
PLAIN_ANSWER_FROM: Final = 3
#: at most this many features in one call (``aioshmcache.wire``'s bound)
MAX_FEATURES: Final = 4096
_REF = struct.Struct("<8Q")
_REF_BYTES: Final = _REF.size
_EMPTY: Final = b""
#: an error frame carries at most this much of the exception's message
_MAX_MESSAGE_CHARS: Final = 16384
_SERDE = MsgpackSerde()
_PLAIN = msgpack.Packer(strict_types=True)  # reused: cheaper than a packb per message
_KIND_ERRORS: Final[dict[str, type[ShmCacheError]]] = {
    "stale_reference": StaleReferenceError,
    "invalid_reference": InvalidReferenceError,
    "reader_evicted": ReaderEvictedError,
    "bad_request": WireError,
    "bad_response": WireError,
}
# the compiled steps (``_core_chan.c``): each declines (None, nothing done) for anything but the
# usual case, which this module's own functions, their reference, then handle
core.configure_chan(FeatureSpec, ShmRef)
_core_unpack = core.chan_unpack
_core_call4 = core.chan_call4
#: ``framed_call(payload, features, max_bytes)``: the version-4 call's two frames as one buffer
#: to write (the compiled core), or None: the caller takes :func:`call_frames` (not version 4, a
#: frame over ``max_bytes``, or the pure core). The core's function itself: the gateway calls it
#: once a call, and a Python function around it was one frame more
framed_call = core.chan_call4_frames


def _keys_travel(value: object) -> bool:
    """Whether every map key in ``value`` is a str or bytes (exactly), the only keys either
    form of an envelope carries: plain msgpack packs any key, but its bounded unpack (and the
    serde) refuse the others. Walked only after ``value`` packed (its depth is bounded); the
    compiled encode declines such a key itself, so its usual call never comes here."""
    todo = [value]
    while todo:
        v = todo.pop()
        if type(v) is dict:
            for k in v:
                if type(k) is not str and type(k) is not bytes:
                    return False
            todo.extend(x for x in v.values() if type(x) is dict or type(x) is list)
        elif type(v) is list:
            todo.extend(x for x in v if type(x) is dict or type(x) is list)
    return True


def encode(value: object, *, plain: bool = True) -> bytes:
    """An envelope: plain msgpack when ``plain`` and the value allows it, else the serde's.

    ``SerdeError`` or ``TypeError`` when the serde cannot carry the value either (a map key
    that is not a str or bytes: neither form carries it).
    """
    if plain:
        try:
            packed: bytes = _PLAIN.pack(value)
        except (TypeError, ValueError, OverflowError):
            pass  # a tuple, an array, a numpy scalar, a subclass, too deep, too big an int
        else:
            if _keys_travel(value):
                return packed
    plan = _SERDE.plan(value)
    out = bytearray(plan.nbytes)
    _SERDE.write(plan, memoryview(out))
    return bytes(out)


def decode(data: bytes, what: str, versions: Sequence[int] = (ANSWER_VERSION,)) -> list[Any]:
    """An envelope in either form, checked to be the channel's (``WireError`` otherwise)."""
    value: Any
    if wire.is_plain(data):
        value = _core_unpack(data)
        if value is None:
            value = wire.unpack_bounded(data, maps=True)
    else:
        try:
            value = _SERDE.read(memoryview(data), copy=False)
        except WireError:
            raise
        except SerdeError as exc:
            raise WireError(f"not an aioshmcache.channel {what}: {exc}") from exc
    return _checked(value, what, versions)


def _checked(value: Any, what: str, versions: Sequence[int]) -> list[Any]:
    """``value`` if it is a channel envelope of one of ``versions`` (``WireError`` otherwise).

    Its tag, version and kind are checked to be a str, an int and a str before they are
    compared: the serde's form carries numpy arrays, whose comparison is an array (its truth a
    ``ValueError`` of numpy's own, or, for one element, the truth of that element).
    """
    if type(value) is not list or len(value) < 3 or type(value[0]) is not str or value[0] != TAG:
        raise WireError(f"not an aioshmcache.channel {what}")
    if type(value[1]) is not int or value[1] not in versions:
        raise WireError(f"unsupported channel version {value[1]!r} (this side reads {versions})")
    if type(value[2]) is not str:
        raise WireError(f"malformed aioshmcache.channel {what}: its kind is not a str")
    return value


def call_envelope(payload: Any) -> bytes:
    """A call's first frame."""
    return encode([TAG, CALL_VERSION, "call", payload])


def pack_call_features(features: list[FeatureSpec]) -> bytes:
    """A call's second frame: the plain form for references and Nones, else a wire message.

    A request of references (and ``None``s) without prompt updates, the channel's usual call,
    travels in the plain form (``wire.pack_plain_features``: the serde's decoder would compile a
    template per call, since every hand-out's reference makes a new header). Anything else (an
    inline item, prompt updates, a malformed feature: its error) is ``wire.pack_features``'s.
    """
    plain = wire.pack_plain_features(features)
    return plain if plain is not None else wire.pack_features(features)


def call_frames(payload: Any, features: Sequence[FeatureSpec]) -> tuple[bytes, bytes]:
    """A call's two frames: version 4 when it fits (module docstring), else version 3.

    Errors as :func:`call_envelope` and :func:`pack_call_features` raise them.
    """
    one = _one_message(payload, features)
    if one is not None:
        return one, _EMPTY
    return call_envelope(payload), pack_call_features(list(features))


def _one_message(payload: Any, features: Sequence[FeatureSpec]) -> bytes | None:
    """The version-4 call, or None when the call does not fit it."""
    if len(features) > MAX_FEATURES:
        return None
    rows: list[list[Any]] = []
    for f in features:
        if not isinstance(f, FeatureSpec):  # the general form says why (``TypeError``)
            return None
        data, ident = f.data, f.identifier
        if (
            type(f.mm_hash) is not str
            or f.prompt_updates != ()
            or not (ident is None or type(ident) is str)
        ):
            return None
        if data is None:
            rows.append([f.mm_hash, ident, None])
            continue
        if type(data) is not ShmRef:
            return None
        for v in data:  # what the general form refuses (a bool, a numpy int) it refuses
            if type(v) is not int:
                return None
        try:
            rows.append([f.mm_hash, ident, _REF.pack(*data)])
        except struct.error:  # out of range: the general form says why
            return None
    try:
        packed: bytes = _PLAIN.pack([TAG, ONE_MESSAGE_VERSION, "call", payload, rows])
    except (TypeError, ValueError, OverflowError):
        return None  # a payload plain msgpack does not carry
    return packed if _keys_travel(payload) else None


def decode_call(head: bytes, body: bytes) -> tuple[int, Any, list[FeatureSpec]]:
    """A call's frames as (version, payload, features); ``WireError`` or ``SerdeError``."""
    if not body:
        got = _core_call4(head)  # the usual call, compiled
        if got is not None:
            return ONE_MESSAGE_VERSION, got[0], got[1]
    if wire.is_plain(head):
        value = wire.unpack_bounded(head, maps=True)
        if (
            type(value) is list
            and len(value) == 5
            and type(value[1]) is int
            and value[1] == ONE_MESSAGE_VERSION
            and value[0] == TAG
        ):
            if value[2] != "call":
                raise WireError("not a channel call")
            if body:
                raise WireError("a version-4 call's second frame must be empty")
            return ONE_MESSAGE_VERSION, value[3], _rows(value[4])
        value = _checked(value, "call", CALL_VERSIONS)
    else:
        value = decode(head, "call", CALL_VERSIONS)
    if value[2] != "call" or len(value) != 4 or value[1] == ONE_MESSAGE_VERSION:
        raise WireError("not a channel call")
    return value[1], value[3], unpack_call_features(body)


def _rows(rows: object) -> list[FeatureSpec]:
    """A version-4 call's features, as hostile as any input (``WireError``)."""
    if type(rows) is not list:
        raise WireError("malformed channel call: the features are not a list")
    if len(rows) > MAX_FEATURES:
        raise WireError(f"{len(rows)} features exceed max_features={MAX_FEATURES}")
    out: list[FeatureSpec] = []
    for i, row in enumerate(rows):
        if type(row) is not list or len(row) != 3:
            raise WireError(f"feature {i} is malformed")
        mm_hash, ident, ref = row
        if type(mm_hash) is not str:
            raise WireError(f"feature {i}: mm_hash is not a str")
        if ident is not None and type(ident) is not str:
            raise WireError(f"feature {i}: identifier is not a str")
        if ref is not None:
            if type(ref) is not bytes or len(ref) != _REF_BYTES:
                raise WireError(f"feature {i}: malformed reference")
            ref = ShmRef(*_REF.unpack(ref))
        out.append(FeatureSpec(mm_hash, ref, identifier=ident))
    return out


def unpack_call_features(body: bytes) -> list[FeatureSpec]:
    """A call's second frame, in either form, as hostile as any input (``WireError``)."""
    return wire.unpack_features_any(body)


def error_frame(
    kind: str,
    exc: BaseException,
    *,
    mm_hashes: Sequence[str] = (),
    unread: bool = False,
    plain: bool = False,
    limit: int | None = None,
) -> bytes:
    """An error answer (``plain``: the caller reads plain msgpack), of at most ``limit`` bytes.

    The exception's message never makes it fail: an error answer is what is left when all else
    failed, and a worker that could not send it would drop the connection, which the gateway
    takes for a worker gone (and may run the handler again). A message that cannot be made (its
    ``__str__`` raises) is replaced, lone surrogates (a file name's undecodable bytes) are
    escaped, and the message is cut until the answer fits ``limit``. (``mm_hashes`` come from
    a call the gateway could encode: they encode here too.)
    """
    try:
        message = str(exc)
    except Exception:  # any error of the exception's own code
        message = "(its message could not be made)"
    if type(message) is not str:  # a str subclass's own methods stay out of the answer
        message = str.__str__(message)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + " [...]"
    head = [TAG, ANSWER_VERSION, "error", kind, type(exc).__name__]
    tail = [list(mm_hashes), unread]
    frame = encode([*head, message, *tail], plain=plain)
    while limit is not None and len(frame) > limit and message:
        message = message[: len(message) // 2]  # (each cut at least halves it: few encodes)
        frame = encode([*head, message + " [...]" if message else "", *tail], plain=plain)
    return frame


def raise_error(value: list[Any]) -> None:
    """Raise what an error answer says, as a typed exception."""
    try:
        _, _, _, kind, remote_type, message, mm_hashes, _unread = value
        hashes = [str(h) for h in mm_hashes]
    except (TypeError, ValueError):
        raise WireError("malformed channel error response") from None
    message = str(message)
    if type(kind) is not str:  # (an unhashable kind could not even be looked up)
        raise WireError("malformed channel error response: its kind is not a str")
    if kind == "cache_miss":
        raise CacheMissError(hashes, message)
    if kind == "writer_gone":
        raise WriterGoneError(message, mm_hashes=hashes)
    if kind in _KIND_ERRORS:
        raise _KIND_ERRORS[kind](message)
    raise EngineCallError(f"engine worker: {remote_type}: {message}", remote_type=str(remote_type))

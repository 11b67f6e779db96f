"""The gateway <-> engine worker messages, on a Unix-domain stream socket.

Each message is one frame of :mod:`aioshmcache.tools.framing` (an :mod:`aioshmcache.wire` frame
holding a msgpack map, with a maximum size and explicit decoding limits); a request's features
are the bytes of :func:`aioshmcache.wire.pack_features` (references in their compact form, inline
items as arrays), decoded by :func:`aioshmcache.wire.unpack_features` as hostile input: the
channel is as hostile-input-proof as the cache itself.

Messages (``t`` is the type)::

    worker -> gateway  {"t": "hello", "worker": i, "pid": pid, "token": secret}
    gateway -> worker  {"t": "infer", "id": n, "features": pack_features([...])}
    worker -> gateway  {"t": "result", "id": n, "ok": true, "results": [summary, ...]}
                       {"t": "result", "id": n, "ok": false, "error": kind, "message": text,
                        "mm_hashes": [...]}       # kind: cache_miss, invalid_reference, ...
    gateway -> worker  {"t": "stop"}

A feature's data is a ``ShmRef`` (the tensors are in shared memory) or the item itself (served
inline: too large for the cache, or the cache is off).
"""

from __future__ import annotations

from collections.abc import Sequence

from aioshmcache import FeatureSpec, InvalidReferenceError, SerdeError
from aioshmcache.wire import pack_features, unpack_features

from ..framing import ProtocolError

__all__ = ["decode_features", "encode_features"]


def encode_features(features: Sequence[FeatureSpec]) -> bytes:
    """A sender's output features as a message field (references, or inline tensors)."""
    for f in features:
        if f.data is None:
            raise ProtocolError(f"feature {f.mm_hash} has neither a reference nor inline data")
    try:
        return pack_features(features)
    except (SerdeError, InvalidReferenceError, TypeError) as exc:
        raise ProtocolError(f"features cannot be sent: {exc}") from None


def decode_features(blob: object) -> list[FeatureSpec]:
    """The worker's side of :func:`encode_features` (references are validated by the cache)."""
    if not isinstance(blob, bytes):
        raise ProtocolError("'features' must be the bytes of pack_features")
    try:
        features = unpack_features(blob)
    except SerdeError as exc:
        raise ProtocolError(f"undecodable features: {exc}") from None
    if not features:
        raise ProtocolError("'features' must not be empty")
    for f in features:
        if f.data is None:
            raise ProtocolError(f"feature {f.mm_hash} has neither a reference nor inline data")
    return features

"""The tier's value format in Redis: a signed header, then the wire module's bytes of one item.

A value in Redis is untrusted input: anyone who can write to the Redis server (another
deployment, a stale version, an attacker on the network) can put bytes under our keys. A value
is therefore only ever served after its HMAC-SHA256 tag (under the tier's ``secret``) matched,
its sizes agreed with each other and with ``max_item_bytes``, and its payload decoded with the
wire module's hostile-input decoder (msgpack with limits, arrays as raw bytes; no pickle).

Keys (``P`` = the tier's prefix, ``N`` = the namespace: the first 16 hex digits of
HMAC-SHA256(secret, ``b"aioshmcache.tier/namespace"``), ``D`` = the first 32 hex digits of
BLAKE2b(``mm_hash``))::

    PN:{D}:v   the value (below)
    PN:{D}:l   the lease of the host computing it (a random token, or "skip": see ``tier``)

The namespace comes from the secret (a keyed digest: it names the secret without revealing
it), so hosts with different secrets use disjoint keys: a host configured with a wrong secret
neither overwrites the others' values (which they would then reject) nor reads them; it only
misses. The braces are a Redis Cluster *hash tag*: both keys of one hash map to the same slot,
so the scripts that touch both run on one node. Hashing the ``mm_hash`` keeps the key short and
free of braces whatever the caller's hashes look like; the ``mm_hash`` itself is inside the
payload and checked against the one asked for.

A key of another Redis type at either key (not ours: someone else wrote it) is deleted by the
look-up and the hash claimed, so the item is made once and stored, not made on every request.
A lease is ours only if it expires within the longest expiry the tier sets (``lease_s`` or
``skip_ttl_s``): one without an expiry, or with a longer one, is replaced the same way, so a
garbage lease costs no wait at all; a garbage lease that looks like ours costs a waiter at
most ``max_wait_s`` once per look-up (then it makes the item itself).

Value (all integers little-endian)::

    offset size
    0      8   MAGIC   b"AIOSHMTV"
    8      2   VERSION 1
    10     2   FLAGS   0 (reserved; a reader rejects anything else)
    12     4   HEADER  64 (header size; a reader rejects anything else)
    16     8   LENGTH  payload bytes; the value is exactly HEADER + LENGTH bytes
    24     8   MAKE_NS how long the item's ``make`` took on the host that wrote it (ns):
                       information for the readers' cost policy, never trusted for safety
    32     32  TAG     HMAC-SHA256(secret, DOMAIN || u32 len(key) || key || bytes 0..31
                       || payload), DOMAIN = b"aioshmcache.tier/1\\0", key = the value's
                       Redis key (UTF-8): a value copied under another key does not verify
    64     LENGTH      payload: ``aioshmcache.wire.pack_features([FeatureSpec(mm_hash, item)])``

Checks, in order, each a :class:`TierValueError` with a ``reason`` (counted by the tier, never
raised to a request): ``truncated`` (shorter than the header, or than its LENGTH says),
``malformed`` (magic, version, flags, header size, or longer than LENGTH says), ``oversized``
(LENGTH over ``max_item_bytes``), ``signature`` (the tag; compared in constant time with
``hmac.compare_digest``, before anything of the payload is decoded), ``decoding`` (the payload
is not one wire feature carrying an inline item for this ``mm_hash``).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any, Final

from ._types import FeatureSpec, ShmRef
from .errors import SerdeError, ShmCacheError, WireError
from .wire import pack_features, unpack_features

__all__ = [
    "HEADER_SIZE",
    "TierValueError",
    "key_digest",
    "keyspace",
    "open_value",
    "seal_value",
    "value_key",
    "lease_key",
]

MAGIC: Final = b"AIOSHMTV"
VERSION: Final = 1
HEADER_SIZE: Final = 64
DOMAIN: Final = b"aioshmcache.tier/1\0"
_HEAD = struct.Struct("<8sHHIQQ")  # magic, version, flags, header size, length, make ns
_SIGNED = _HEAD.size  # bytes 0..31 are signed; the tag follows
_TAG_SIZE = 32
_U64 = (1 << 64) - 1


class TierValueError(ShmCacheError, ValueError):
    """A value read from the tier failed a check; ``reason`` names which (module docstring)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def keyspace(prefix: str, secret: bytes) -> str:
    """``prefix`` and the namespace of ``secret`` (see the module docstring): the start of
    every key of a tier with that secret."""
    ns = hmac.new(secret, b"aioshmcache.tier/namespace", hashlib.sha256).hexdigest()[:16]
    return f"{prefix}{ns}:"


def key_digest(mm_hash: str) -> str:
    """The 32 hex digits that stand for ``mm_hash`` in the tier's keys."""
    return hashlib.blake2b(mm_hash.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def value_key(space: str, mm_hash: str) -> str:
    """The Redis key of ``mm_hash``'s value (``space``: from :func:`keyspace`)."""
    return f"{space}{{{key_digest(mm_hash)}}}:v"


def lease_key(space: str, mm_hash: str) -> str:
    """The Redis key of ``mm_hash``'s lease (same hash slot as the value)."""
    return f"{space}{{{key_digest(mm_hash)}}}:l"


def _tag(secret: bytes, key: str, signed_head: bytes, payload: memoryview | bytes) -> bytes:
    kb = key.encode("utf-8")
    mac = hmac.new(secret, DOMAIN, hashlib.sha256)
    mac.update(struct.pack("<I", len(kb)))
    mac.update(kb)
    mac.update(signed_head)
    mac.update(payload)
    return mac.digest()


def seal_value(secret: bytes, key: str, mm_hash: str, item: Any, *, make_ns: int = 0) -> bytes:
    """The signed value of ``item`` for ``key`` (raises what ``pack_features`` raises)."""
    payload = pack_features([FeatureSpec(mm_hash, item)])
    head = _HEAD.pack(MAGIC, VERSION, 0, HEADER_SIZE, len(payload), min(max(make_ns, 0), _U64))
    return b"".join((head, _tag(secret, key, head, payload), payload))


def open_value(
    secret: bytes, key: str, mm_hash: str, data: bytes, *, max_item_bytes: int
) -> tuple[Any, int]:
    """``(item, make_ns)`` from a value read under ``key``, or :class:`TierValueError`.

    The item's arrays are read-only views into ``data`` (no copy): the cache copies them into
    shared memory when it puts the item.
    """
    if len(data) < HEADER_SIZE:
        raise TierValueError("truncated", f"{len(data)} bytes: shorter than the header")
    magic, version, flags, header, length, make_ns = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION or flags != 0 or header != HEADER_SIZE:
        raise TierValueError("malformed", "not an aioshmcache tier value of version 1")
    if length > max_item_bytes:
        raise TierValueError("oversized", f"{length} payload bytes over {max_item_bytes}")
    if len(data) < HEADER_SIZE + length:
        raise TierValueError("truncated", f"{len(data)} bytes of {HEADER_SIZE + length}")
    if len(data) > HEADER_SIZE + length:
        raise TierValueError("malformed", "bytes after the payload")
    view = memoryview(data)
    expected = _tag(secret, key, bytes(view[:_SIGNED]), view[HEADER_SIZE:])
    if not hmac.compare_digest(expected, bytes(view[_SIGNED : _SIGNED + _TAG_SIZE])):
        raise TierValueError("signature", "the value's signature does not match")
    try:
        features = unpack_features(view[HEADER_SIZE:])
    except (SerdeError, WireError) as exc:
        raise TierValueError("decoding", f"payload: {exc}") from exc
    if (
        len(features) != 1
        or features[0].mm_hash != mm_hash
        or features[0].data is None
        or isinstance(features[0].data, ShmRef)
    ):
        raise TierValueError("decoding", "the payload is not this hash's item")
    return features[0].data, make_ns

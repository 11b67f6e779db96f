"""Keys no client can poison: the server derives an item's key from the bytes it preprocesses.

A cache, a cache group and a fleet tier share one key space, so whoever chooses a key decides
what every other request for that key gets. The safe key is one the server computes from the
bytes it preprocesses; a hash a client sends is only a *claim*:

- with a body, the claim is checked against it (``content_key(body, claimed=h)``): a claim that
  does not name this body raises :class:`~aioshmcache.errors.KeyMismatchError` (answer 400) and
  nothing is cached;
- without a body, it can only look up an item the server keyed by content
  (``lookup_key(h)``): a hit is served, a miss means the client must send the body. A look-up
  cannot reach a tenant key (below) or anything else that is not a content key.

A client-chosen identifier that nobody verifies (vLLM's user-provided ids) is scoped to one tenant
by :func:`tenant_key`, so it can only ever reach what that same tenant put under it.

Formats (self-describing: the prefix names the algorithm and the kind of key)::

    sha256:<64 hex>      content_key(body): the SHA-256 of the body, nothing else, so any client
                         computes it ("sha256:" + hashlib.sha256(body).hexdigest(); WebCrypto's
                         SHA-256 in a browser); the OCI / Docker digest notation
    ns-sha256:<64 hex>   content_key(body, namespace=ns): SHA-256 over
                         NS_TAG || u64be(len(ns)) || ns || SHA-256(body), ns as UTF-8
                         (surrogates passed through, so every str has its own bytes)
    user-sha256:<64 hex> tenant_key(identifier, tenant=t): SHA-256 over
                         USER_TAG || u64be(len(t)) || t || u64be(len(id)) || id

Why SHA-256: collision resistance is what keeps two bodies off one key; SHA-256 gives it, runs
in hardware on x86-64 CPUs with the SHA extensions (1.7 GB/s measured here, against 0.9 GB/s for
BLAKE2b-256 through hashlib), and every client platform has it. hashlib releases the GIL while
it hashes more than 2 KiB, so a large body may be keyed in a worker thread.

Why these encodings: the three kinds carry different prefixes, so no key of one kind equals a key
of another. Within a kind, the hashed bytes are an unambiguous (length-prefixed) encoding of the
inputs behind a tag naming the kind, so two different (namespace, body) or (tenant, identifier)
pairs share a key only through a SHA-256 collision. A namespaced key hashes the body's digest,
not the body, so a server can derive it from a client's plain claim without the body
(``lookup_key(h, namespace=tenant)``): a tenant's look-ups are scoped by the server, and one
tenant cannot reach another's items even knowing their digests.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from .errors import KeyMismatchError

__all__ = ["NS_TAG", "USER_TAG", "content_key", "lookup_key", "tenant_key"]

#: the domain-separation tags hashed in front of a namespaced content key and a tenant key
NS_TAG: Final = b"aioshmcache/content-key/namespaced/v1\0"
USER_TAG: Final = b"aioshmcache/tenant-key/v1\0"

_PLAIN: Final = "sha256:"
_SCOPED: Final = "ns-sha256:"
_USER: Final = "user-sha256:"
_CONTENT_KEY: Final = re.compile(r"(?:ns-)?sha256:[0-9a-f]{64}")

Body = bytes | bytearray | memoryview


def _digest(body: Body) -> bytes:
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError(f"body must be bytes, bytearray or memoryview, not {type(body).__name__}")
    if isinstance(body, memoryview) and not body.c_contiguous:
        raise TypeError("body must be a C-contiguous buffer")
    return hashlib.sha256(body).digest()


def _text(value: str, what: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    data = value.encode("utf-8", "surrogatepass")
    return len(data).to_bytes(8, "big") + data


def _scoped(digest: bytes, namespace: str) -> str:
    return _SCOPED + hashlib.sha256(NS_TAG + _text(namespace, "namespace") + digest).hexdigest()


def content_key(body: Body, *, namespace: str | None = None, claimed: str | None = None) -> str:
    """The cache key of ``body``: its SHA-256 as ``sha256:<hex>`` (``ns-sha256:`` in a namespace).

    ``namespace`` (a tenant, a format, a preprocessing version: whatever, beyond the bytes,
    decides what the item is) gives the same body a different key in each namespace.
    ``claimed`` is a hash the client sent with the body: it must name this body (its plain key
    or its key in ``namespace``), else :class:`~aioshmcache.errors.KeyMismatchError` is raised,
    and the caller caches nothing. A body that is not bytes, bytearray or a contiguous
    memoryview, or a namespace or claim that is not a str, raises ``TypeError``.
    """
    if claimed is not None and not isinstance(claimed, str):
        raise TypeError(f"claimed must be a str, not {type(claimed).__name__}")
    digest = _digest(body)
    plain = _PLAIN + digest.hex()
    key = plain if namespace is None else _scoped(digest, namespace)
    if claimed is not None and claimed not in (plain, key):
        raise KeyMismatchError(f"the claimed key {claimed[:80]!r} is not the body's", claimed)
    return key


def lookup_key(claimed: str, *, namespace: str | None = None) -> str:
    """The key to look up for a hash a client sent without a body.

    ``claimed`` must be a content key (``sha256:`` or ``ns-sha256:`` and 64 lowercase hex
    digits); anything else, a tenant key included, raises
    :class:`~aioshmcache.errors.KeyMismatchError`. With ``namespace``, ``claimed`` must be the
    plain ``sha256:`` key and the result is the body's key in that namespace, exactly
    ``content_key(body, namespace=namespace)``: the server, not the client, scopes the look-up.
    """
    if not isinstance(claimed, str):
        raise TypeError(f"claimed must be a str, not {type(claimed).__name__}")
    if _CONTENT_KEY.fullmatch(claimed) is None:
        raise KeyMismatchError(f"{claimed[:80]!r} is not a content key", claimed)
    if namespace is None:
        return claimed
    if not claimed.startswith(_PLAIN):
        raise KeyMismatchError("in a namespace, look up by the plain sha256: key", claimed)
    return _scoped(bytes.fromhex(claimed[len(_PLAIN) :]), namespace)


def tenant_key(identifier: str, *, tenant: str) -> str:
    """The key of a client-chosen ``identifier`` that nobody verifies, scoped to ``tenant``.

    ``user-sha256:<hex>``: only requests of the same tenant reach it; it never equals a content
    key, and :func:`lookup_key` refuses it. The cache trusts the identifier as far as that
    tenant trusts itself: a tenant that reuses an identifier for other bytes gets its own stale
    item back. ``tenant`` must come from the server's authentication, not from the request body.
    """
    data = USER_TAG + _text(tenant, "tenant") + _text(identifier, "identifier")
    return _USER + hashlib.sha256(data).hexdigest()

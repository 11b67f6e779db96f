"""vLLM's processor-cache method names over aioshmcache's caches: one adapter per role.

vLLM's multimodal processor cache has a sender (P0, in the API process) and a receiver (P1, in
the engine) with method names of their own (``is_cached_item``, ``touch_sender_cache_item``,
``touch_receiver_cache_item``, ``clear_cache``, ...). Code written against that interface can
drive aioshmcache's caches through these two classes unchanged; aioshmcache's own faces keep one
name per job (``is_cached``, ``touch``, ``clear``), and this module is the only place the vLLM
names live.

Each method is one call of the wrapped cache: the same algorithm, the same errors (a hash that
is not cached any more raises ``CacheMissError``, whose ``mm_hashes`` list the items to resend).
What differs from vLLM's own shared-memory cache: the receiver returns new ``FeatureSpec``
objects rather than filling in the given ones; a standalone touch lapses by aioshmcache's rule
(at the item's next hand-out, or after ``handout_ttl`` at most), so ``release_sender_touches``
has nothing to release; a hit of a given item returns the caller's own prompt updates (vLLM:
the kept ones, equal when a hash's updates are); and a reference is not bound to its hash
(vLLM 0.33 signs the hash into its handle): the receiver reads a reference under whatever hash
it is given, so the sender's ``validate_input_item`` is the check of a pair from outside. The
sender's stats are the wrapped cache's counted from the adapter's last ``clear_cache`` (vLLM's
restart there; the cache's own, published for ``inspect`` and the metrics, never do).

The adapter takes over the cache it is given: ``close()`` closes it (vLLM closes its caches at
shutdown). ``sender`` / ``receiver`` give the wrapped cache for everything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._request import MmItem, check_hash
from ._types import CacheInfo, FeatureSpec, as_reference
from .cache import Receiver, SenderCache
from .errors import InvalidReferenceError, StaleReferenceError

__all__ = ["VllmReceiverCache", "VllmSenderCache"]

#: a P0 request's items: ``(item, prompt_updates)``, or ``None`` for a hash believed cached
_Items = Sequence[MmItem | None]


class VllmSenderCache:
    """P0 under vLLM's names: a ``SenderCache`` (the writer) it takes over."""

    def __init__(self, sender: SenderCache) -> None:
        """Wrap ``sender``; ``close()`` closes it."""
        if not isinstance(sender, SenderCache):
            raise TypeError(f"a SenderCache is needed, not {type(sender).__name__}")
        self.sender = sender
        self._base = CacheInfo(0, 0)  # the sender's counters at the last ``clear_cache``
        self._last_delta = CacheInfo(0, 0)

    def is_cached_item(self, mm_hash: str) -> bool:
        """Whether ``mm_hash`` is cached (a pure look-up: no hand-out, no change of order)."""
        return self.sender.is_cached(mm_hash)

    def is_cached(self, mm_hashes: Sequence[str]) -> list[bool]:
        """``is_cached_item`` of each hash."""
        sender = self.sender
        return [sender.is_cached(h) for h in mm_hashes]

    def get_and_update_item(
        self, mm_item: MmItem | None, mm_hash: str, *, wait_for_space: float | None = None
    ) -> MmItem:
        """``(ShmRef, prompt_updates)`` for a hit or a put; the input itself when it cannot be
        cached. ``mm_item`` is ``(item, prompt_updates)``, or ``None`` for a cached hash
        (``CacheMissError`` if it is not). ``wait_for_space`` is aioshmcache's own option."""
        return self.sender.get_and_update_item(mm_item, mm_hash, wait_for_space=wait_for_space)

    def get_and_update(
        self, mm_items: _Items, mm_hashes: Sequence[str], *, wait_for_space: float | None = None
    ) -> list[MmItem]:
        """A whole request: every cached hash of it pinned first, then each item updated."""
        return self.sender.get_and_update(mm_items, mm_hashes, wait_for_space=wait_for_space)

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        """Protect a cached item from eviction until its next hand-out (nothing if not cached)."""
        self.sender.touch(mm_hash)

    def release_sender_touches(self) -> None:
        """Nothing to do: a touch lapses by itself (vLLM's processor calls this after every
        request's updates)."""

    def validate_input_item(self, mm_item: Any, mm_hash: str) -> None:
        """Check a pair that came from outside: a reference must be the one this cache holds
        for ``mm_hash`` now, else ``InvalidReferenceError`` (a ``ValueError``, as vLLM raises);
        anything else (inline data) passes."""
        ref = as_reference(mm_item)  # a malformed reference mapping: InvalidReferenceError
        if ref is None:
            return
        store = self.sender.store
        try:
            r = store.validate(ref)
        except StaleReferenceError as exc:
            raise InvalidReferenceError(f"not a live reference of {mm_hash!r}: {exc}") from None
        cur = store.ref_of(check_hash(mm_hash))
        if cur is None or (cur.id, cur.address, cur.epoch) != (r.id, r.address, r.epoch):
            raise InvalidReferenceError(f"the reference is not the one cached for {mm_hash!r}")

    def invalidate(self, mm_hash: str) -> None:
        """Forget ``mm_hash`` (after a receiver's ``CacheMissError``): the next request puts it."""
        self.sender.invalidate(mm_hash)

    def clear_cache(self) -> None:
        """Drop every item; every reference handed out before becomes stale. The stats restart
        (vLLM's do): ``make_stats`` counts from here."""
        sender = self.sender
        with sender.store.lock:  # the counters' lock too: no request counts in between
            sender.clear()
            self._base = sender.make_stats()
            self._last_delta = CacheInfo(0, 0)

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """Hits and total since the last ``clear_cache``; with ``delta``, the change since the
        previous delta call (or that clear)."""
        with self.sender.store.lock:
            info = self.sender.make_stats() - self._base
            if not delta:
                return info
            out = info - self._last_delta
            self._last_delta = info
            return out

    def remove_dangling_items(self) -> None:
        """Nothing to do, as in vLLM once its table is clean: no cached item is freed, and the
        sender drops an item's prompt updates as it leaves, so none dangles."""

    def close(self) -> None:
        """Close the wrapped cache: its segment is unlinked (idempotent)."""
        self.sender.close()


class VllmReceiverCache:
    """P1 under vLLM's names: a reader (``ReceiverCache`` or ``GroupReceiverCache``) it takes
    over."""

    def __init__(self, receiver: Receiver) -> None:
        """Wrap ``receiver``; ``close()`` closes it."""
        if not isinstance(receiver, Receiver):
            raise TypeError(f"a ReceiverCache is needed, not {type(receiver).__name__}")
        self.receiver = receiver

    def get_and_update_features(self, mm_features: Sequence[FeatureSpec]) -> list[FeatureSpec]:
        """Every reference of a request read into its item; new specs, the input left as it is.

        Features whose data is ``None`` pass through. Stale references are read around and
        raised together as one ``CacheMissError`` listing their hashes.
        """
        return self.receiver.get_and_update_features(mm_features)

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        """A reference becomes its item (a copy); inline data is returned unchanged."""
        return self.receiver.get_and_update_item(mm_item, mm_hash)

    def get_and_update(self, mm_items: Sequence[Any], mm_hashes: Sequence[str]) -> list[Any]:
        """``get_and_update_item`` of each item, as one request (stale ones: one miss)."""
        if len(mm_items) != len(mm_hashes):
            raise ValueError(f"{len(mm_items)} items for {len(mm_hashes)} hashes")
        features = [FeatureSpec(h, it) for it, h in zip(mm_items, mm_hashes)]
        return [f.data for f in self.receiver.get_and_update_features(features)]

    def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        """Validate ``mm_item``'s reference without reading it; owes nothing."""
        self.receiver.touch(mm_hash, mm_item)

    def clear_cache(self) -> None:
        """Drop local state (a receiver keeps no item copies): its counters restart."""
        self.receiver.clear()

    def close(self) -> None:
        """Close the wrapped reader: its reader slots are freed (idempotent)."""
        self.receiver.close()

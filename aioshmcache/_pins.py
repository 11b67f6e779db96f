"""Layer 5, pins: how the writer protects items from eviction without a debt.

``Pins`` is the part of the writer (``StoreWriter``) that pins: a *touch* (``touch``: until the
item's next hand-out, ``handout_ttl`` at most), a request's *pins* (``pin`` / ``unpin``, and the
caches' ``_pin_entry`` / ``_unpin_entry``, which hold the entry itself so that an item
invalidated and put again meanwhile keeps its own pins), and a request's *guard* (``guard`` /
``unguard``: every chunk of the request, while it decides in one step under the lock, without a
ledger entry each; ``_pin_ids`` turns it into pins when the request goes on unlocked). Its
methods take the writer lock, as the store's do; it works on the writer's state, declared below
for the type checker.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from ._ledger import Debts, HandoutLedger
from ._segment import Segment
from ._shards import ShardedMap

__all__ = ["Pins"]


class Pins:
    """The writer's pins and guards (see the module docstring); mixed into ``StoreWriter``."""

    if TYPE_CHECKING:  # the writer's state this part works on (set by ``StoreWriter``)
        _ledger: HandoutLedger
        _index: ShardedMap[str, int]
        _rows: ShardedMap[int, bytes]
        _guarded: dict[int, None] | None
        _lock: threading.RLock
        _seg: Segment

        def _check_writer(self) -> None: ...
    else:  # no state of its own: the writer's (hidden from the checker, which
        __slots__ = ()  # would then refuse every assignment to the writer's state here)

    def touch(self, key: str) -> bool:
        """Protect a cached key from eviction until its next hand-out (``handout_ttl`` at most).

        Returns False if ``key`` is not cached.
        """
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            cid = self._index.get(key)
            if cid is None:
                return False
            self._ledger.touch(self._ledger.debts_of(cid))
            return True

    def pin(self, key: str) -> bool:
        """Request-scoped pin (counted) of the entry cached under ``key``; pair with
        :meth:`unpin`. False if ``key`` is not cached."""
        self._check_writer()
        with self._lock:
            cid = self._index.get(key)
            if cid is None:
                return False
            self._ledger.pin(self._ledger.debts_of(cid))
            return True

    def unpin(self, key: str) -> None:
        """Undo one :meth:`pin` of the entry cached under ``key`` now."""
        if self._seg.forked:  # not when closed: a request's cleanup may run after a close
            self._check_writer()
        with self._lock:
            cid = self._index.get(key)
            if cid is not None and (e := self._ledger.get(cid)) is not None:
                self._ledger.unpin(e)

    def _pin_entry(self, key: str) -> Debts | None:
        """Request-scoped pin of the entry cached under ``key`` now (see :meth:`_unpin_entry`).

        Returns the entry's debts (``id`` is its chunk id), which hold the pin.
        """
        self._check_writer()
        with self._lock:
            cid = self._index.get(key)
            if cid is None:
                return None
            e = self._ledger.debts_of(cid)
            self._ledger.pin(e)
            return e

    def _unpin_entry(self, e: Debts) -> None:
        """Undo one :meth:`_pin_entry` of ``e`` (whatever key names it by now)."""
        with self._lock:
            self._ledger.unpin(e)

    @contextlib.contextmanager
    def pinned(self, keys: list[str]) -> Iterator[list[str]]:
        """Pin the cached ones of ``keys`` for the block; yields the list of keys pinned.

        Keys appended to that list (pinned later in the block with :meth:`pin`) are unpinned on
        exit too. Pins belong to entries: an entry invalidated and re-put meanwhile keeps the
        pins of its own requests, and the new entry is not unpinned by mistake.
        """
        entries = [(k, e) for k in keys if (e := self._pin_entry(k)) is not None]
        done = [k for k, _e in entries]
        n0 = len(done)
        try:
            yield done
        finally:
            for _k, e in entries:
                self._unpin_entry(e)
            for k in done[n0:]:
                self.unpin(k)

    def guard(self, keys: Sequence[str]) -> dict[int, None]:
        """Protect the chunks of the cached ``keys``, and every chunk put (committed) from now
        on, from eviction and relocation until :meth:`unguard`. Hold :attr:`lock` from here to
        :meth:`unguard`: the guard covers one step.

        A request protects its own items so that its later puts never evict its earlier ones.
        While it decides in one step under the lock, nothing else can put, so "every chunk put
        from now on" is exactly its own puts: a set member each instead of a pin (a ledger
        entry). Returns the guarded set (for :meth:`_pin_ids` if the request goes on unlocked).
        """
        with self._lock:
            index = self._index
            self._guarded = g = {cid: None for k in keys if (cid := index.get(k)) is not None}
            return g

    def unguard(self) -> None:
        """End :meth:`guard` (idempotent)."""
        with self._lock:
            self._guarded = None

    def _pin_ids(self, ids: Iterable[int]) -> list[Debts]:
        """Request-scoped pins of the live chunks ``ids`` (each undone by :meth:`_unpin_entry`).

        What a request's :meth:`guard` becomes when the request goes on outside the lock.
        """
        with self._lock:
            rows, ledger = self._rows, self._ledger
            out = []
            for cid in ids:
                if cid in rows:
                    e = ledger.debts_of(cid)
                    ledger.pin(e)
                    out.append(e)
            return out

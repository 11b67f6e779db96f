"""Layer 5, pins: how the writer protects items from eviction without a debt.

``Pins`` is the part of the writer (``StoreWriter``) that pins: a *touch* (until the item's next
hand-out, ``handout_ttl`` at most), a request's *pins* (counted, on the entry itself, so that an
item invalidated and put again meanwhile keeps its own pins: :meth:`Pins.pin_entry` /
:meth:`Pins.unpin_entry`), and a request's *guard* (:meth:`Pins.guard`: every chunk of the
request, while it decides in one step under the lock, without a ledger entry each;
:meth:`Pins.pin_ids` turns it into pins when the request goes on unlocked).

It owns the guard; the pins and touches are the ledger's, found through the writer's index. It
holds no lock: the writer calls it holding the writer lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ._ledger import Debts, HandoutLedger
from ._sharded_map import ShardedMap

__all__ = ["Pins"]


class Pins:
    """The writer's pins and guard (see the module docstring)."""

    __slots__ = ("_index", "_ledger", "_rows", "guarded")

    def __init__(
        self, ledger: HandoutLedger, index: ShardedMap[str, int], rows: ShardedMap[int, bytes]
    ) -> None:
        self._ledger = ledger
        self._index = index  # key -> chunk id (the writer's)
        self._rows = rows  # chunk id -> row, while the chunk lives (the writer's)
        #: the chunk ids a request's guard protects (see :meth:`guard`); None: no guard
        self.guarded: dict[int, None] | None = None

    def touch(self, key: str) -> bool:
        """Protect the entry cached under ``key`` until its next hand-out; False if none."""
        cid = self._index.get(key)
        if cid is None:
            return False
        self._ledger.touch(self._ledger.debts_of(cid))
        return True

    def pin_entry(self, key: str) -> Debts | None:
        """One request-scoped pin of the entry cached under ``key`` now: its debts (``id`` is
        its chunk id), which hold the pin; None if ``key`` is not cached."""
        cid = self._index.get(key)
        if cid is None:
            return None
        e = self._ledger.debts_of(cid)
        self._ledger.pin(e)
        return e

    def unpin_entry(self, e: Debts) -> None:
        """Undo one :meth:`pin_entry` of ``e`` (whatever key names it by now)."""
        self._ledger.unpin(e)

    def pinned_entry_of(self, key: str) -> Debts | None:
        """The entry cached under ``key`` now if it holds a pin, else None."""
        cid = self._index.get(key)
        e = None if cid is None else self._ledger.get(cid)
        return e if e is not None and e.pins > 0 else None

    def unpin_key(self, key: str) -> None:
        """Undo one pin of the entry cached under ``key`` now (if any)."""
        cid = self._index.get(key)
        if cid is not None and (e := self._ledger.get(cid)) is not None:
            self._ledger.unpin(e)

    def guard(self, keys: Sequence[str]) -> dict[int, None]:
        """Guard the chunks of the cached ``keys``, and every chunk committed from now on, until
        :meth:`unguard` (see ``StoreWriter.guard``). Returns the guarded set."""
        index = self._index  # ``index.get(k)``, inline: a look-up per item of the request
        shards, mask = index.shards, index.mask
        self.guarded = g = {
            cid: None for k in keys if (cid := shards[hash(k) & mask].get(k)) is not None
        }
        return g

    def unguard(self) -> None:
        """End :meth:`guard` (idempotent)."""
        self.guarded = None

    def is_guarded(self, cid: int) -> bool:
        """Whether the request deciding now guards chunk ``cid``."""
        g = self.guarded
        return g is not None and cid in g

    def pin_ids(self, ids: Iterable[int]) -> list[Debts]:
        """Request-scoped pins of the live chunks ``ids`` (each undone by :meth:`unpin_entry`):
        what a request's guard becomes when the request goes on outside the lock."""
        rows, ledger = self._rows, self._ledger
        out = []
        for cid in ids:
            if cid in rows:
                e = ledger.debts_of(cid)
                ledger.pin(e)
                out.append(e)
        return out

"""``ShardedMap``: a dict split into many small dicts, so that no insert rebuilds a big table.

A CPython dict grows by rebuilding its whole table when it is 2/3 full, and rebuilds it again
after as many inserts as it has room for when keys come and go (a cache's index in steady state).
With 100,000-200,000 entries one rebuild took 12-30 ms here: a writer whose index, rows and side
tables all hold one entry per cached item stalled a put (and the event loop) that long, twice per
doubling of the item count and periodically ever after. Split by key hash into up to ``SHARDS``
dicts, each rebuild moves that fraction of the entries, and the shards reach their thresholds at
different puts. The count is sized from what the map can hold (:func:`shards_for`): a small cache
keeps one dict (many shards cost a cache miss or so per access: the shard is one more object).

Hot paths may index a shard themselves (``m.shards[hash(key) & m.mask]``) to skip a call;
one that inserts a key it knows is new, or deletes one it knows is there, adjusts ``n`` itself.
``mask`` and ``n`` live in the core's ``MapState`` base: C integers on the compiled core (its
put counts entries without making Python ints), plain slots on the pure one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final, Generic, TypeVar, overload

from ._core_api import core

__all__ = ["SHARDS", "ShardedMap", "shards_for"]

SHARDS: Final = 256  # at most
#: entries a shard may reach before one more shard is worth its cost: its rebuild then moves at
#: most this many entries (~1-2 ms here, at 100-150 ns each on a loaded machine)
SHARD_ENTRIES: Final = 8192


def shards_for(max_entries: int) -> int:
    """Shards for a map that may hold ``max_entries``: a power of two, 1 to ``SHARDS``."""
    n = 1
    while n < SHARDS and max_entries > n * SHARD_ENTRIES:
        n *= 2
    return n


K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


class ShardedMap(core.MapState, Generic[K, V]):
    """A mapping in ``shards`` dicts by ``hash(key) & mask`` (see the module docstring).

    Holds no object per entry: shards whose keys and values are str and ints stay untracked by
    the garbage collector, as a plain dict of them would.
    """

    __slots__ = ("shards",)  # and the base's ``mask`` and ``n``

    def __init__(self, shards: int = SHARDS) -> None:
        if shards < 1 or shards & (shards - 1):
            raise ValueError("shards must be a power of two >= 1")
        self.shards: list[dict[K, V]] = [{} for _ in range(shards)]
        self.mask = shards - 1
        self.n = 0  # entries (``len``)

    def __len__(self) -> int:
        return self.n

    def __contains__(self, key: object) -> bool:
        return key in self.shards[hash(key) & self.mask]

    def __getitem__(self, key: K) -> V:
        return self.shards[hash(key) & self.mask][key]

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...
    def get(self, key: K, default: object = None) -> object:
        return self.shards[hash(key) & self.mask].get(key, default)

    def __setitem__(self, key: K, value: V) -> None:
        d = self.shards[hash(key) & self.mask]
        if key not in d:
            self.n += 1
        d[key] = value

    def __delitem__(self, key: K) -> None:
        del self.shards[hash(key) & self.mask][key]
        self.n -= 1

    _MISSING: Final = object()

    @overload
    def pop(self, key: K) -> V: ...
    @overload
    def pop(self, key: K, default: D) -> V | D: ...
    def pop(self, key: K, default: object = _MISSING) -> object:
        d = self.shards[hash(key) & self.mask]
        if key in d:
            self.n -= 1
            return d.pop(key)
        if default is ShardedMap._MISSING:
            raise KeyError(key)
        return default

    def __iter__(self) -> Iterator[K]:
        for d in self.shards:
            yield from d

    def keys(self) -> Iterator[K]:
        return iter(self)

    def items(self) -> Iterator[tuple[K, V]]:
        for d in self.shards:
            yield from d.items()

    def values(self) -> Iterator[V]:
        for d in self.shards:
            yield from d.values()

    def clear(self) -> None:
        for d in self.shards:
            d.clear()
        self.n = 0

    def to_dict(self) -> dict[K, V]:
        """Every entry in one plain dict (for inspection and tests)."""
        return dict(self.items())

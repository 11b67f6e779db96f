"""How much each workload runs: the full run and the ``--quick`` smoke run."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from aioshmcache import CacheConfig, ShmObjectStore, StoreWriter

from ..units import GiB, KiB, MiB

__all__ = ["Params", "bench_config", "open_store", "segment_prefix"]

_counter = itertools.count()


def segment_prefix() -> str:
    """Every segment this process creates is named ``aioshm-bench-<pid>-<n>``."""
    return f"bench-{os.getpid()}-"


def bench_config(capacity: int, max_object: int, n_readers: int = 1, **kw: object) -> CacheConfig:
    """A config with a recognisable, unique segment name."""
    return CacheConfig(
        capacity,
        max_object,
        n_readers,
        name=f"{segment_prefix()}{next(_counter)}",
        **kw,  # type: ignore[arg-type]
    )


@contextlib.contextmanager
def open_store(config: CacheConfig) -> Iterator[StoreWriter]:
    store = ShmObjectStore.create(config)
    try:
        yield store
    finally:
        store.close()


@dataclass
class Params:
    """Sizes, repetitions and operation counts."""

    quick: bool
    runs: int
    sizes: list[int]
    peer_sizes: list[int]
    # operations per run, by item size (the first key >= size applies)
    ops: dict[int, int]
    peer_ops: dict[int, int]
    small_batches: int  # 1 KiB steady state: batches of 256 puts per run
    sender_puts: int  # 1 KiB through SenderCache: puts per run (the latency max is over all runs)
    fresh_cache: int
    fresh_runs: int
    churn_puts: int
    churn_runs: int
    readers: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    cache_sizes: list[int] = field(default_factory=list)
    lag_seconds: float = 2.0
    lag_runs: int = 3
    lag_loops: list[str] = field(default_factory=lambda: ["asyncio", "uvloop"])
    threshold_sizes: list[int] = field(default_factory=list)
    concurrent_tasks: int = 100
    concurrent_requests: int = 50
    gc_entries: int = 250_000  # live small items in the writer for the full-collection cell
    # the trace suite: a catalogue of images, requests per trace, image sizes, seeds per trace;
    # sizes (and the capacity, a fraction of them) divided by trace_scale to keep the copies short
    trace_items: int = 3000
    trace_requests: int = 20_000
    trace_sizes: tuple[int, int] = (512 * KiB, 8 * MiB)
    trace_seeds: int = 5
    trace_scale: int = 4

    @classmethod
    def full(cls) -> Params:
        return cls(
            quick=False,
            runs=5,
            sizes=[1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB],
            peer_sizes=[1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB],
            ops={1 * KiB: 2000, 64 * KiB: 1000, 1 * MiB: 200, 16 * MiB: 20, 64 * MiB: 6},
            peer_ops={1 * KiB: 300, 64 * KiB: 200, 1 * MiB: 60, 16 * MiB: 8, 64 * MiB: 3},
            small_batches=8,
            sender_puts=20_000,  # x 5 runs: the max is over 100,000 steady-state puts
            fresh_cache=1 * GiB,
            fresh_runs=5,
            churn_puts=10_000,
            churn_runs=3,
            cache_sizes=[64 * MiB, 256 * MiB, 1 * GiB, 4 * GiB, 8 * GiB],
            lag_seconds=1.0,
            lag_runs=3,
            lag_loops=["asyncio", "uvloop"],
            threshold_sizes=[
                16 * KiB,
                64 * KiB,
                256 * KiB,
                512 * KiB,
                1 * MiB,
                2 * MiB,
                4 * MiB,
                8 * MiB,
                16 * MiB,
            ],
        )

    @classmethod
    def smoke(cls) -> Params:
        return cls(
            quick=True,
            runs=3,
            sizes=[1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB],
            peer_sizes=[1 * KiB, 1 * MiB],
            ops={1 * KiB: 300, 64 * KiB: 200, 1 * MiB: 40, 16 * MiB: 4},
            peer_ops={1 * KiB: 40, 1 * MiB: 10},
            small_batches=3,
            sender_puts=2_000,
            fresh_cache=256 * MiB,
            fresh_runs=1,
            churn_puts=1_000,
            churn_runs=1,
            readers=[1, 8],
            cache_sizes=[64 * MiB, 256 * MiB],
            lag_seconds=0.6,
            lag_runs=1,
            lag_loops=["asyncio"],
            threshold_sizes=[64 * KiB, 1 * MiB, 4 * MiB],
            concurrent_tasks=20,
            concurrent_requests=20,
            gc_entries=20_000,
            trace_items=400,
            trace_requests=2000,
            trace_seeds=1,
            trace_scale=64,
        )

    def n_ops(self, size: int, *, peers: bool = False) -> int:
        table = self.peer_ops if peers else self.ops
        for limit in sorted(table):
            if size <= limit:
                return table[limit]
        return table[max(table)]

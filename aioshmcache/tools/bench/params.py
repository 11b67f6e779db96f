"""How much each workload runs: one dataclass whose defaults are the full run; ``--quick`` less."""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path
from typing import Any

from aioshmcache import CacheConfig

from ..units import KiB, MiB

__all__ = ["Params", "bench_config", "segment_prefix"]

_counter = itertools.count()
K, M = KiB, MiB
_SIZES = (K, 64 * K, M, 16 * M, 64 * M)
_THRESHOLDS = tuple(k * K for k in (16, 64, 256, 512)) + tuple(k * M for k in (1, 2, 4, 8, 16))
Table = tuple[tuple[int, int], ...]


def segment_prefix() -> str:
    """Every segment this process creates is named ``aioshm-bench-<pid>-<n>``."""
    return f"bench-{os.getpid()}-"


def bench_config(capacity: int, max_object: int, **kw: Any) -> CacheConfig:
    """A config with one reader slot and a recognisable, unique segment name."""
    return CacheConfig(capacity, max_object, 1, name=f"{segment_prefix()}{next(_counter)}", **kw)


@dataclasses.dataclass(frozen=True)
class Params:
    """Sizes, repetitions and operation counts: the defaults are the full run."""

    quick: bool = False
    redis: bool = True  # --no-redis: no Redis peer in the round trip
    vllm_file: Path | None = None  # --vllm-file: vLLM's store for the vllm suite
    runs: int = 5
    sizes: tuple[int, ...] = _SIZES
    peer_sizes: tuple[int, ...] = _SIZES
    #: operations per run by item size: (up to this size, n), the first that fits applies
    ops: Table = tuple(zip(_SIZES, (2000, 1000, 200, 20, 6)))
    peer_ops: Table = tuple(zip(_SIZES, (300, 200, 60, 8, 3)))
    small_batches: int = 8  # 1 KiB steady state: batches of 256 puts per run
    sender_puts: int = 20_000  # SenderCache puts per run (the latency max is over all runs)
    churn_puts: int = 10_000
    churn_runs: int = 3
    lag_seconds: float = 1.0
    lag_runs: int = 3
    lag_loops: tuple[str, ...] = ("asyncio", "uvloop")
    threshold_sizes: tuple[int, ...] = _THRESHOLDS
    gc_entries: int = 250_000  # live small items in the writer for the full-collection cell
    group_requests: int = 4000  # group: the Zipf load, over group_images distinct images
    group_images: int = 1000
    group_lookups: int = 2000  # is_cached calls per run
    # trace: a catalogue of images, requests per trace, image sizes, seeds per trace; sizes (and
    # the capacity, a fraction of them) divided by trace_scale to keep the copies short
    trace_items: int = 3000
    trace_requests: int = 20_000
    trace_sizes: tuple[int, int] = (512 * K, 8 * M)
    trace_seeds: int = 5
    trace_scale: int = 4
    vllm_rounds: int = 15  # vllm: interleaved rounds, item sizes, items per churn round
    vllm_sizes: tuple[int, ...] = (1 * K, 64 * K, 1 * M, 16 * M)
    vllm_churn: int = 64

    @classmethod
    def smoke(cls) -> Params:
        """The ``--quick`` run CI uses: fewer sizes, runs and operations."""
        return cls(**_SMOKE)

    def n_ops(self, size: int, *, peers: bool = False) -> int:
        table = self.peer_ops if peers else self.ops
        return next((n for limit, n in table if size <= limit), table[-1][1])


_SMOKE: dict[str, Any] = dict(quick=True, runs=3, sizes=(K, 64 * K, M, 16 * M), peer_sizes=(K, M))
_SMOKE |= dict(ops=((K, 300), (64 * K, 200), (M, 40), (16 * M, 4)), peer_ops=((K, 40), (M, 10)))
_SMOKE |= dict(small_batches=3, sender_puts=2_000, churn_puts=1_000, churn_runs=1)
_SMOKE |= dict(lag_seconds=0.6, lag_runs=1, lag_loops=("asyncio",), gc_entries=20_000)
_SMOKE |= dict(threshold_sizes=(64 * K, M, 4 * M), vllm_rounds=3, vllm_sizes=(K, M), vllm_churn=16)
_SMOKE |= dict(group_requests=600, group_images=200, group_lookups=200)
_SMOKE |= dict(trace_items=400, trace_requests=2000, trace_seeds=1, trace_scale=64)

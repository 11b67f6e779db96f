"""Cache groups: preprocessings with 1 and 4 gateway processes, and what a sibling costs.

* **Zipf load.** A stream of requests for ``images`` distinct image hashes whose popularity
  follows a Zipf law (as the demo's load), split round-robin over ``W`` gateway writer processes
  (spawned, started together behind a barrier), each the writer of its own shard of one group.
  Each runs the hash-first pattern of a gateway through the public API: ``is_cached_item(h)``;
  if true, ``get_and_update_features([FeatureSpec(h, None)])`` (an own hit, or a copy from a
  sibling shard); else "preprocess" (build the item's arrays from the hash) and put it. The
  figure is the number of preprocessings with 4 processes against 1 (target: ≤ 1.1x), and, for
  scale, with 4 processes that each have their own plain cache (what ``--workers 4`` gives
  without a group).
* **Sibling look-up.** ``is_cached_item(h)`` in shard 1 for a hash only shard 0 holds (found
  through shard 0's key hints, its chunk checked), and for a hash nobody holds (own index and
  every sibling's hints), against an own hit.
* **Sibling hit.** ``get_and_update_features([FeatureSpec(h, None)])`` in shard 1 for a 1 MiB
  and a 16 MiB item held by shard 0: reserve, copy, verify, publish; against ``np.copyto`` of
  the same bytes into warm shared memory, measured interleaved in the same run.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from aioshmcache import CacheConfig, CacheMissError, FeatureSpec, SenderCache

from ..progress import Progress
from ..units import KiB, MiB
from .params import Params, segment_prefix
from .report import Report, Row, Target
from .timing import Samples, ShmBuffer, memcpy_into, source_array, timed_calls

__all__ = ["run_group_suite", "zipf_stream"]

S_ZIPF = "Cache group: preprocessings of a Zipf load, 1 vs 4 gateway processes"
S_LOOKUP = "Cache group: is_cached_item across shards (vs an own hit)"
S_COPY = "Cache group: sibling hit, copy into the own shard (vs np.copyto into warm shm)"

ZIPF_S = 1.1
ITEM_BYTES = 256 * KiB  # one "preprocessed image": 64 Ki float32


def zipf_stream(n_requests: int, images: int, *, s: float = ZIPF_S, seed: int = 0) -> list[str]:
    """``n_requests`` image hashes; image ``i`` is asked with probability ∝ 1 / (i+1)^s."""
    weights = 1.0 / np.arange(1, images + 1, dtype=np.float64) ** s
    rng = np.random.default_rng(seed)
    picks = rng.choice(images, size=n_requests, p=weights / weights.sum())
    return [hashlib.blake2b(f"img{i}".encode(), digest_size=16).hexdigest() for i in picks]


def preprocess(h: str, nbytes: int = ITEM_BYTES) -> dict[str, Any]:
    """The simulated preprocessing: build the item's arrays from its hash (deterministic)."""
    seed = int(h[:16], 16)
    x = np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)
    return {"pixel_values": x, "image_size": np.array([224, 224])}


def _gateway(config: CacheConfig, hashes: Sequence[str], barrier: Any, out: Any) -> None:
    """One gateway writer process: the hash-first pattern over its share of the stream."""
    counts = {"preprocessed": 0, "own_hits": 0, "sibling_hits": 0, "fallbacks": 0}
    with SenderCache(config) as cache:
        barrier.wait(120)
        t0 = time.perf_counter()
        for h in hashes:
            if cache.is_cached_item(h):
                try:
                    cache.get_and_update_features([FeatureSpec(h, None)])
                    continue
                except CacheMissError:  # a sibling's copy went stale meanwhile
                    counts["fallbacks"] += 1
            cache.get_and_update_features([FeatureSpec(h, preprocess(h))])
            counts["preprocessed"] += 1
        snap = cache.snapshot()
        counts["sibling_hits"] = snap.sibling_hits
        counts["own_hits"] = snap.hits - snap.sibling_hits
        counts["seconds"] = time.perf_counter() - t0  # type: ignore[assignment]
        barrier.wait(120)  # every shard stays open until all are done (siblings stay readable)
    out.put(counts)


def _run_load(stream: Sequence[str], writers: int, *, group: bool, capacity: int) -> dict[str, Any]:
    """Run ``stream`` over ``writers`` spawned processes; their counts summed."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(writers), ctx.Queue()
    tag = f"{segment_prefix()}z{writers}{'g' if group else 'p'}{time.monotonic_ns() % 10**6}"
    procs = []
    for k in range(writers):
        if group:
            cfg = CacheConfig(capacity, 4 * ITEM_BYTES, 1, group=tag)
        else:
            cfg = CacheConfig(capacity, 4 * ITEM_BYTES, 1, name=f"{tag}-{k}")
        p = ctx.Process(target=_gateway, args=(cfg, stream[k::writers], barrier, out))
        p.start()
        procs.append(p)
    try:
        results = [out.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
    total: dict[str, Any] = {k: sum(r[k] for r in results) for k in results[0]}
    total["seconds"] = max(r["seconds"] for r in results)
    return total


def bench_zipf(p: Params, report: Report, progress: Progress) -> None:
    n_req, images = (600, 200) if p.quick else (4000, 1000)
    stream = zipf_stream(n_req, images)
    distinct = len(set(stream))
    capacity = (distinct + 16) * (ITEM_BYTES + 4 * KiB)  # every shard could hold them all
    progress(f"group: Zipf load, {n_req} requests over {distinct} distinct images, 1 process")
    one = _run_load(stream, 1, group=True, capacity=capacity)
    progress("group: the same load over 4 gateway processes of one group")
    four = _run_load(stream, 4, group=True, capacity=capacity)
    progress("group: the same load over 4 processes with a plain cache each (no group)")
    apart = _run_load(stream, 4, group=False, capacity=capacity)
    param = f"{n_req} req, {distinct} images, s={ZIPF_S}"
    base = one["preprocessed"]
    report.add(Row(S_ZIPF, "preprocessings, 1 process", param, base, kind="count"))
    # a count ratio: more preprocessings than 1 process is worse (ratio above 1)
    for label, got, target in (
        ("4 processes of one group", four, Target("ratio", "<=", 1.1)),
        ("4 processes, a plain cache each (no group)", apart, None),
    ):
        note = ""
        if got is four:
            note = f"{four['sibling_hits']} sibling hits, {four['fallbacks']} stale fallbacks"
        report.row(
            S_ZIPF,
            f"preprocessings, {label}",
            param,
            got["preprocessed"],
            kind="count",
            baseline="1 process",
            ratio=got["preprocessed"] / base,
            target=target,
            note=note,
        )


def bench_lookup_and_copy(p: Params, report: Report, progress: Progress) -> None:
    runs = max(3, p.runs)
    group = f"{segment_prefix()}s{time.monotonic_ns() % 10**6}"
    cfg = CacheConfig(64 * MiB, 20 * MiB, 1, group=group)
    progress("group: sibling look-up and sibling hit (copy), 2 shards in one process")
    with SenderCache(cfg) as a, SenderCache(cfg) as b:
        a.get_and_update_features([FeatureSpec("in-a", preprocess("00" * 8, 4 * KiB))])
        b.get_and_update_features([FeatureSpec("in-b", preprocess("01" * 8, 4 * KiB))])
        own, sib, miss = Samples(), Samples(), Samples()
        n = 200 if p.quick else 2000
        for _ in range(runs):
            timed_calls(lambda: b.is_cached_item("in-b"), n, own.new_run())
            timed_calls(lambda: b.is_cached_item("in-a"), n, sib.new_run())
            timed_calls(lambda: b.is_cached_item("nowhere"), n, miss.new_run())
        o = own.stat()
        report.row(S_LOOKUP, "own hit (baseline)", "", o)
        for label, samples in (
            ("held by a sibling (hint + chunk check)", sib),
            ("held by nobody (own index + every sibling's hints)", miss),
        ):
            report.row(S_LOOKUP, label, "1 sibling", samples.stat(), vs=("own hit", o))
        for size in (1 * MiB, 16 * MiB):
            item = {"x": source_array(size)}
            a.get_and_update_features([FeatureSpec(f"big{size}", item)])
            dst, src = ShmBuffer(size), source_array(size, seed=1)
            copy, base = Samples(), Samples()
            reps = 5 if size > MiB else 30
            if p.quick:
                reps = max(2, reps // 5)

            def sibling_hit(key: str = f"big{size}") -> None:
                [f] = b.get_and_update_features([FeatureSpec(key, None)])
                if f.data is None or isinstance(f.data, dict):
                    raise RuntimeError("the sibling hit did not produce a reference")

            try:
                for r in range(runs + 1):  # run 0 warms up
                    crun: list[float] = []
                    brun: list[float] = []
                    for _ in range(reps):
                        timed_calls(sibling_hit, 1, crun)
                        b.invalidate(f"big{size}")  # so that the next one copies again
                        memcpy_into(dst.view(size), src, 1, brun)
                    if r:
                        copy.add_run(crun)
                        base.add_run(brun)
            finally:
                dst.close()
            cs, bs = copy.stat(), base.stat()
            param = f"{size // MiB} MiB"
            report.row(S_COPY, "np.copyto into warm shm (baseline)", param, bs)
            label = "sibling hit: get_and_update_features(None) in shard 1"
            report.row(S_COPY, label, param, cs, vs=("np.copyto", bs))
        if b.snapshot().sibling_hits == 0:
            raise RuntimeError("no sibling hit was counted")


def run_group_suite(p: Params, report: Report, progress: Progress) -> None:
    """The cache-group suite (``--suite group``)."""
    report.attempt("group: Zipf load", lambda: bench_zipf(p, report, progress))
    report.attempt("group: sibling costs", lambda: bench_lookup_and_copy(p, report, progress))

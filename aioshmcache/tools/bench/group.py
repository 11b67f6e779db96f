"""Cache groups: preprocessings with 1 and 4 gateway processes, and what a sibling costs.

* **Zipf load.** Requests for image hashes of Zipf popularity, split round-robin over ``W``
  spawned gateway processes (started together behind a barrier), each the writer of its own
  shard of one group and running the gateway's hash-first pattern: ``is_cached(h)``, then
  ``get_and_update_features([FeatureSpec(h, None)])`` (an own hit, or a copy from a sibling) or
  "preprocess" and put. The figure: preprocessings with 4 processes against 1 (target ≤ 1.1x),
  and with 4 processes of a plain cache each (``--workers 4`` without a group).
* **Sibling look-up.** ``is_cached(h)`` in shard 1 for a hash only shard 0 holds, and for
  a hash nobody holds, against an own hit.
* **Sibling hit.** ``get_and_update_features`` in shard 1 of a 1 MiB and a 16 MiB item held by
  shard 0 (reserve, copy, verify, publish) against ``np.copyto`` of the same bytes into warm
  shared memory, interleaved.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from aioshmcache import CacheConfig, CacheMissError, FeatureSpec, SenderCache

from ..progress import Progress
from ..units import KiB, MiB
from . import timing as tm
from .params import Params, segment_prefix
from .procs import run_spawned
from .report import Report, Target
from .trace import zipf_trace

__all__ = ["run_group_suite"]

S_ZIPF = "Cache group: preprocessings of a Zipf load, 1 vs 4 gateway processes"
S_LOOKUP = "Cache group: is_cached across shards (vs an own hit)"
S_COPY = "Cache group: sibling hit, copy into the own shard (vs np.copyto into warm shm)"

ZIPF_S = 1.1
ITEM_BYTES = 256 * KiB  # one "preprocessed image": 64 Ki float32


def preprocess(h: str, nbytes: int = ITEM_BYTES) -> dict[str, Any]:
    """The simulated preprocessing: build the item's arrays from its hash (deterministic)."""
    x = np.random.default_rng(int(h[:16], 16)).standard_normal(nbytes // 4, dtype=np.float32)
    return {"pixel_values": x, "image_size": np.array([224, 224])}


def _gateway(config: CacheConfig, hashes: Sequence[str], barrier: Any, out: Any) -> None:
    """One gateway writer process: the hash-first pattern over its share of the stream."""
    counts = {"preprocessed": 0, "fallbacks": 0}
    with SenderCache(config) as cache:
        barrier.wait(120)
        for h in hashes:
            if cache.is_cached(h):
                try:
                    cache.get_and_update_features([FeatureSpec(h, None)])
                    continue
                except CacheMissError:  # a sibling's copy went stale meanwhile
                    counts["fallbacks"] += 1
            cache.get_and_update_features([FeatureSpec(h, preprocess(h))])
            counts["preprocessed"] += 1
        counts["sibling_hits"] = cache.snapshot().sibling_hits
        barrier.wait(120)  # every shard stays open until all are done (siblings stay readable)
    out.put(counts)


def _run_load(stream: Sequence[str], writers: int, *, group: bool, capacity: int) -> dict[str, int]:
    """Run ``stream`` over ``writers`` spawned processes; their counts summed."""
    tag = f"{segment_prefix()}z{writers}{'g' if group else 'p'}{time.monotonic_ns() % 10**6}"
    args = []
    for k in range(writers):
        where: dict[str, Any] = {"group": tag} if group else {"name": f"{tag}-{k}"}
        args.append((CacheConfig(capacity, 4 * ITEM_BYTES, 1, **where), stream[k::writers]))
    results = run_spawned(_gateway, args, timeout=600)
    return {k: sum(r[k] for r in results) for k in results[0]}


def bench_zipf(p: Params, report: Report, progress: Progress) -> None:
    picks = zipf_trace(p.group_requests, p.group_images, ZIPF_S, seed=0)  # image i: ∝ 1/(i+1)^s
    stream = [hashlib.blake2b(f"img{i}".encode(), digest_size=16).hexdigest() for i in picks]
    distinct = len(set(stream))
    capacity = (distinct + 16) * (ITEM_BYTES + 4 * KiB)  # every shard could hold them all
    runs = {}
    for label, writers, group in (
        ("1 process", 1, True),
        ("4 processes of one group", 4, True),
        ("4 processes, a plain cache each (no group)", 4, False),
    ):
        progress(f"group: Zipf load, {p.group_requests} requests, {distinct} images, {label}")
        runs[label] = _run_load(stream, writers, group=group, capacity=capacity)
    param = f"{p.group_requests} req, {distinct} images, s={ZIPF_S}"
    add = report.section(S_ZIPF, param, kind="count", baseline="1 process")
    base = runs.pop("1 process")["preprocessed"]
    add("preprocessings, 1 process", base, baseline=None)
    # a count ratio: more preprocessings than 1 process is worse (ratio above 1)
    for label, got in runs.items():
        note = f"{got['sibling_hits']} sibling hits, {got['fallbacks']} stale fallbacks"
        kw = {"target": Target("<=", 1.1, "ratio"), "note": note} if "no group" not in label else {}
        ratio = got["preprocessed"] / base
        add(f"preprocessings, {label}", got["preprocessed"], ratio=ratio, **kw)


def bench_lookup_and_copy(p: Params, report: Report, progress: Progress) -> None:
    runs, n = max(3, p.runs), p.group_lookups
    cfg = CacheConfig(64 * MiB, 20 * MiB, 1, group=f"{segment_prefix()}s{time.monotonic_ns()}")
    progress("group: sibling look-up and sibling hit (copy), 2 shards in one process")
    with SenderCache(cfg) as a, SenderCache(cfg) as b:
        a.get_and_update_features([FeatureSpec("in-a", preprocess("00" * 8, 4 * KiB))])
        b.get_and_update_features([FeatureSpec("in-b", preprocess("01" * 8, 4 * KiB))])
        keys = ("in-b", "in-a", "nowhere")
        st = tm.interleave(runs, {h: tm.each(n, partial(b.is_cached, h)) for h in keys})
        add = report.section(S_LOOKUP, "1 sibling")
        add("own hit (baseline)", st["in-b"], param="")
        add("held by a sibling (hint + chunk check)", st["in-a"], vs=("own hit", st["in-b"]))
        label = "held by nobody (own index + every sibling's hints)"
        add(label, st["nowhere"], vs=("own hit", st["in-b"]))
        for size in (1 * MiB, 16 * MiB):
            key = f"big{size}"
            a.get_and_update_features([FeatureSpec(key, {"x": tm.source_array(size)})])
            reps = max(2, (5 if size > MiB else 30) // (5 if p.quick else 1))

            def sibling_hit(key: str = key) -> None:
                [f] = b.get_and_update_features([FeatureSpec(key, None)])
                if f.data is None or isinstance(f.data, dict):
                    raise RuntimeError("the sibling hit did not produce a reference")

            def drop_own(i: int, key: str = key) -> tuple[()]:
                # so that each hit copies again (untimed); not ``invalidate(key)``, after which
                # this shard copies the key from no sibling (its copy would be the old item)
                b.clear()
                return ()

            with tm.ShmBuffer(size) as dst:
                base = tm.copy_into(dst, tm.source_array(size, seed=1), reps)
                cells = {"copy": tm.each(reps, sibling_hit, drop_own), "base": base}
                st = tm.interleave(runs, cells, warmup=1)
            add = report.section(S_COPY, f"{size // MiB} MiB")
            add("np.copyto into warm shm (baseline)", st["base"])
            label = "sibling hit: get_and_update_features(None) in shard 1"
            add(label, st["copy"], vs=("np.copyto", st["base"]))
        if b.snapshot().sibling_hits == 0:
            raise RuntimeError("no sibling hit was counted")


def run_group_suite(p: Params, report: Report, progress: Progress) -> None:
    """The cache-group suite (``--suite group``)."""
    report.attempt("group: Zipf load", lambda: bench_zipf(p, report, progress))
    report.attempt("group: sibling costs", lambda: bench_lookup_and_copy(p, report, progress))

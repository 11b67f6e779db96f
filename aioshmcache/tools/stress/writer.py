"""The writer process: one generation of an ``AsyncSenderCache``, M request tasks, forgeries.

It runs at most ``--window`` requests ahead (credits come back from the parent), checks what the
sender returns and sends the references on; with ``forge`` it sends forged and stale references
for the readers to refuse; on ``check`` (after quiescence) it checks that the cache drains.
"""

from __future__ import annotations

import asyncio
import functools
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Final

import anyio

from aioshmcache import AsyncSenderCache, CacheConfig, CacheMissError, FeatureSpec, ShmRef
from aioshmcache.wire import pack_features

from .._core_gaps import retag_reference
from ..framing import Link
from ..lag import LoopLagMeter
from .child import SABOTAGE_EVERY, Proc, guarded
from .options import StressOptions
from .workload import Workload

INV, MISS = "InvalidReferenceError", "CacheMissError"
Ref = dict[str, Any]
#: forged references: how a recent one is altered, and what a reader may answer once the forgery
#: is re-tagged with the segment's secret (what an attacker who maps the segment can do: the
#: ring's own checks must refuse it; None: never re-tagged). Untagged, the tag check refuses
#: every one (InvalidReferenceError). ``stale_evicted`` is a genuine reference, evicted since.
FORGERIES: Final[dict[str, tuple[Callable[[Ref, WriterProc], object], list[str] | None]]] = {
    "foreign_nonce": (lambda r, w: r.update(nonce=r["nonce"] ^ 2), None),
    "no_length": (lambda r, w: r.pop("length"), None),
    "negative_address": (lambda r, w: r.update(address=-64), None),
    "string_id": (lambda r, w: r.update(id="7"), None),
    "bool_epoch": (lambda r, w: r.update(epoch=True), None),
    "past_epoch": (lambda r, w: r.update(epoch=r["epoch"] - 1), [MISS]),  # from before a clear
    "future_epoch": (lambda r, w: r.update(epoch=r["epoch"] + 1), [INV]),
    "misaligned": (lambda r, w: r.update(address=r["address"] + 8), [INV]),
    "out_of_range": (lambda r, w: r.update(address=w.capacity + 64 * w.rand(1, 1 << 20)), [INV]),
    # stale if the chunk was evicted meanwhile
    "wrong_length": (lambda r, w: r.update(length=r["length"] + 64 ** w.rand(0, 3)), [INV, MISS]),
    "unissued_id": (lambda r, w: r.update(id=(1 << 62) + w.rand(0, 1 << 40)), [INV]),
    # an issued id at a random place: stale or invalid
    "random": (lambda r, w: r.update(w.random_place()), [INV, MISS]),
}
KINDS: Final = ("stale_evicted", *FORGERIES)
Meta = tuple[str, int, dict[str, Any], int, int]  # mm_hash, k, item, digest, size


class WriterProc(Proc):
    """One writer generation: an AsyncSenderCache, M request tasks and the probe injector."""

    def __init__(
        self, opts: StressOptions, link: Link, token: str, *, gen: int, name: str, delivery: str
    ) -> None:
        super().__init__(opts, link, token, opts.seed * 1000 + gen)
        self.lag = LoopLagMeter(0.05, window=1)  # a blocked event loop shows up here
        self.who, self.gen, self.name, self.delivery = f"writer g{gen}", gen, name, delivery
        self.work = Workload(opts)
        self.credit, self.credit_event = opts.window, asyncio.Event()
        self.stopping, self.rid, self.max_op = False, 0, 0.0
        self.capacity: int = 0
        self.stats: Counter[str] = Counter()
        self.recent: deque[tuple[str, Ref]] = deque(maxlen=512)
        self.seen: deque[int] = deque(maxlen=256)
        self.tx = AsyncSenderCache.from_config(self.config())  # created by run()
        self.tasks: list[asyncio.Task[None]] = []

    def violation(self, text: str) -> None:
        self.stats["violations"] += 1
        super().violation(text)

    def rand(self, lo: int, hi: int) -> int:
        return self.rng.randrange(lo, hi)

    def random_place(self) -> Ref:
        """A random address and length, and an id the writer issued, for a forgery."""
        last = max(int(ref["id"]) for _h, ref in self.recent)
        address, length = 64 * self.rand(0, self.capacity // 64), self.rand(0, 1 << 20)
        return {"address": address, "id": self.rand(1, max(2, last + 1)), "length": length}

    def config(self) -> CacheConfig:
        o, broadcast = self.opts, self.delivery != "one_of_n"
        return CacheConfig(
            o.capacity,
            o.max_object,
            o.readers,
            name=None if o.group else self.name,
            group=self.name if o.group else None,  # --group: the writer of its own shard
            delivery="broadcast" if broadcast else "one_of_n",
            # a hand-out never delivered lapses after handout_ttl (the drain check waits that
            # long); the drop sabotage's broadcast generations keep them 10 min: a leak to see
            handout_ttl=600.0 if broadcast and "drop" in o.sabotage else o.handout_ttl,
            evict_stuck_readers_after=o.evict_after or None if "stop-readers" in o.faults else None,
            second_chance=o.second_chance,
        )

    async def run(self) -> None:
        async with self.tx as tx:
            self.capacity = tx.snapshot().capacity_bytes
            handle = {"gen": self.gen, "delivery": self.delivery, "name": tx.sender.name}
            handle["handle"] = tx.handle().to_dict()  # what readers attach by
            self.send("hello", token=self.token, writer=handle)
            loops = [self.request_loop() for _ in range(self.opts.writers)]
            if "forge" in self.opts.faults and self.opts.probe_rate > 0:
                loops.append(self.inject_loop())
            self.tasks = [asyncio.ensure_future(c) for c in loops]
            for t in self.tasks:
                t.add_done_callback(self.task_done)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.lag.run)
                tg.start_soon(self.heartbeat)
                await self.serve()
                self.stopping = True
                for t in self.tasks:
                    t.cancel()
                await asyncio.gather(*self.tasks, return_exceptions=True)
                tg.cancel_scope.cancel()

    def task_done(self, t: asyncio.Future[None]) -> None:
        if not t.cancelled() and (exc := t.exception()) is not None:
            tb = "".join(traceback.format_exception(exc))
            self.violation(f"writer task crashed: {exc!r}\n{tb}")

    def hb(self) -> dict[str, Any]:
        if self.lag.max > self.opts.max_loop_lag and not self.stats["lag_reported"]:
            self.stats["lag_reported"] = 1
            self.violation(f"writer event loop blocked for {self.lag.max:.2f} s")
        out: dict[str, Any] = dict(self.stats, lag_max=self.lag.max, op_max=self.max_op)
        if not self.tx.sender.closed:
            out.update((k, v) for k, v in self.tx.snapshot().to_dict().items() if k != "readers")
        return {"stats": out}

    # --- the parent's messages -----------------------------------------------------------
    async def on_credit(self, msg: dict[str, Any]) -> None:
        self.give_credit(int(msg["n"]))

    async def on_stop(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.stopping = True
        self.credit_event.set()
        _, pending = await asyncio.wait(self.tasks, timeout=self.opts.op_deadline + 5)
        for t in pending:
            self.violation("a writer task did not stop within its deadline")
            t.cancel()
        return self.hb()

    async def on_check(self, msg: dict[str, Any]) -> dict[str, Any]:
        """After quiescence: every cached item becomes freeable, and then the ring drains."""
        tx, deadline = self.tx, time.monotonic() + float(msg["within"])
        while True:
            keys = tx.cached_order()
            stuck = [h for h in keys if not tx.is_freeable(h)]
            if not stuck or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        if not stuck:
            await tx.remove_dangling_items()
        snap, out = tx.snapshot(), self.hb()
        out.update(items=len(keys), not_freeable=stuck[:20], n_not_freeable=len(stuck))
        out.update(after_items=snap.items, after_bytes=snap.bytes_used)
        return out | {"slots": snap.to_dict()["readers"]}

    # --- requests --------------------------------------------------------------------------
    def give_credit(self, n: int) -> None:
        self.credit += n
        self.credit_event.set()

    async def take_credit(self) -> bool:
        t = time.monotonic()
        while self.credit <= 0 and not self.stopping:
            self.credit_event.clear()
            with anyio.move_on_after(1.0):
                await self.credit_event.wait()
            if time.monotonic() - t > 60:
                self.violation("no flow-control credit for 60 s: readers stopped reporting")
                t = time.monotonic()
        self.credit -= not self.stopping
        return not self.stopping

    def build(self, ks: list[int], force_data: set[str]) -> tuple[list[FeatureSpec], list[Meta]]:
        """A request's features: items, or None for a hash "the readers have" (a miss then is
        the sender's CacheMissError)."""
        specs, meta = [], []
        for j, k in enumerate(ks):
            h, (item, digest, n), r = self.work.name(k), self.work.item(k), self.rng.random()
            cached = self.tx.is_cached_item(h)
            none = h not in force_data and ((r < 0.4 and cached) or (r > 0.97 and k in self.seen))
            data, ident, updates = None if none else item, f"{self.rid}.{j}", (("upd", k),)
            specs.append(FeatureSpec(h, data, identifier=ident, prompt_updates=updates))
            meta.append((h, k, item, digest, n))
        return specs, meta

    async def request_loop(self) -> None:
        o, rng, tx = self.opts, self.rng, self.tx
        while not self.stopping and await self.take_credit():
            self.rid += 1
            rid, force, sent = self.rid, set[str](), False
            ks = [self.work.sample(rng) for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4)))]
            waits = o.wait_for_space > 0 and rng.random() < 0.2
            wait = rng.uniform(0.0, o.wait_for_space) if waits else 0.0
            for attempt in range(len(ks) + 1):  # each CacheMissError is resent with data: ends
                specs, meta = self.build(ks, force)
                mode, t0 = self.cancel_mode(), time.monotonic()
                call = functools.partial(tx.get_and_update_features, specs, wait_for_space=wait)
                res = await guarded(call, mode=mode, deadline=o.op_deadline, rng=rng)
                self.max_op = max(self.max_op, time.monotonic() - t0)
                self.stats["requests"] += 1
                miss = res.exc.mm_hashes if isinstance(res.exc, CacheMissError) else None
                if res.kind == "timeout":
                    self.violation(f"get_and_update_features missed its {o.op_deadline} s deadline")
                elif res.kind == "cancelled":
                    self.stats[f"cancelled_{mode}"] += 1
                elif res.kind == "ok":
                    self.stats["cancel_too_late"] += mode != "none"
                    sent = self.publish(rid, t0, specs, meta, res.value)
                elif miss and attempt < len(ks) and not set(miss) <= force:
                    self.stats["sender_cache_miss"] += 1
                    force.update(miss)
                    continue
                else:
                    self.violation(f"get_and_update_features raised {res.exc!r}")
                break
            if not sent:  # nothing went to the readers: no credit comes back for it
                self.give_credit(1)
            await asyncio.sleep(0)

    def publish(
        self, rid: int, t0: float, specs: list[FeatureSpec], meta: list[Meta], out: Any
    ) -> bool:
        """Check what the sender returned and send the references (no await: cancel-safe)."""
        if not isinstance(out, list) or len(out) != len(specs):
            self.violation(f"get_and_update_features returned {type(out).__name__}")
            return False
        wired: list[FeatureSpec] = []  # what the readers get: the references, None for inline
        checks: list[list[int]] = []  # per feature: the digest and size the reader verifies
        for spec, f, (h, k, item, digest, n) in zip(specs, out, meta):
            self.seen.append(k)
            if not isinstance(f, FeatureSpec) or f.mm_hash != h:
                self.violation(f"{h}: sender returned {f!r}")
                continue
            updates = tuple(f.prompt_updates)
            # prompt updates stay in the writer process: a group shard's copy from a sibling
            # (asked for with None) comes back without them
            sibling_copy = self.opts.group and spec.data is None and updates == ()
            lost = updates != tuple(spec.prompt_updates) and not sibling_copy
            if lost or f.identifier != spec.identifier:
                self.violation(f"{h}: prompt updates / identifier not preserved")
            if isinstance(f.data, ShmRef):
                self.recent.append((h, f.data.to_dict()))
                self.stats.update(refs=1, ref_bytes=n)
                # self-test: a lying digest on every SABOTAGE_EVERY-th reference (count-based:
                # the run goes on until the readers caught some, however slow it is)
                lie = "digest" in self.opts.sabotage and self.stats["refs"] % SABOTAGE_EVERY == 0
                self.stats["sabotaged"] += lie
                wired.append(FeatureSpec(h, f.data))
                checks.append([digest ^ lie, n])
            elif f.data is item and spec.data is item:
                self.stats["inline"] += 1
                wired.append(FeatureSpec(h, None))
                checks.append([digest, n])
            else:
                self.violation(f"{h}: sender returned data that is neither a ShmRef nor the input")
        f = pack_features(wired)
        self.send("req", gen=self.gen, d=self.delivery, rid=rid, t0=t0, f=f, c=checks)
        return True

    # --- forged and stale references --------------------------------------------------------
    async def inject_loop(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.rng.expovariate(self.opts.probe_rate))
            if self.stopping or not self.recent or (probe := self.forge()) is None:
                continue
            ref, expect, kind = probe
            via = "item" if self.rng.random() < 0.3 else "features"
            if via == "item":  # a stale reference read alone raises StaleReferenceError
                expect = ["StaleReferenceError" if e == MISS else e for e in expect]
            self.stats.update((f"probe_{kind}", "probes"))
            self.send("probe", gen=self.gen, kind=kind, via=via, h="forged", ref=ref, expect=expect)

    def forge(self) -> tuple[Ref, list[str], str] | None:
        """A forged or stale reference, the typed errors a reader may answer, and its kind."""
        kind, (h, ref) = self.rng.choice(KINDS), self.rng.choice(self.recent)
        if kind == "stale_evicted":  # certainly stale once h is not cached
            return None if self.tx.is_cached_item(h) else (ref, [MISS], kind)
        alter, retagged = FORGERIES[kind]
        alter(r := dict(ref), self)
        tag = retag_reference(self.tx.sender, r) if retagged and self.rng.random() < 0.5 else None
        if retagged and tag is not None:
            return dict(r, tag=tag), retagged, kind + "+tag"
        return r, [INV], kind

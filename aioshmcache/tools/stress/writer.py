"""The writer process: one generation of an ``AsyncSenderCache`` and M request tasks.

It runs at most ``--window`` requests ahead (credits come back from the parent), checks what the
sender returns and sends the references on; on ``check`` (after quiescence) it checks that the
cache drains.
"""

from __future__ import annotations

import asyncio
import functools
import time
import traceback
from collections import Counter, deque
from typing import Any

import anyio

from aioshmcache import AsyncSenderCache, CacheConfig, CacheMissError, FeatureSpec, ShmRef
from aioshmcache.wire import pack_features

from ..framing import Link
from ..lag import LoopLagMeter
from .child import SABOTAGE_EVERY, Proc, guarded
from .options import StressOptions
from .workload import Workload, verify_item

Meta = tuple[str, int, dict[str, Any], int, int]  # mm_hash, k, item, digest, size


class WriterProc(Proc):
    """One writer generation: an AsyncSenderCache and M request tasks."""

    def __init__(
        self, opts: StressOptions, link: Link, token: str, *, gen: int, name: str, delivery: str
    ) -> None:
        super().__init__(opts, link, token, opts.seed * 1000 + gen)
        self.lag = LoopLagMeter(0.05, window=1)  # a blocked event loop shows up here
        self.who, self.gen, self.name, self.delivery = f"writer g{gen}", gen, name, delivery
        self.work = Workload(opts)
        self.credit, self.credit_event = opts.window, asyncio.Event()
        self.stopping, self.rid, self.max_op = False, 0, 0.0
        self.stats: Counter[str] = Counter()
        self.seen: deque[int] = deque(maxlen=256)
        self.tx = AsyncSenderCache.from_config(self.config())  # created by run()
        self.tasks: list[asyncio.Task[None]] = []

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
            handle = {"gen": self.gen, "delivery": self.delivery, "name": tx.sender.name}
            handle["handle"] = tx.handle().to_dict()  # what readers attach by
            self.send("hello", token=self.token, writer=handle)
            loops = [self.request_loop() for _ in range(self.opts.writers)]
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
            cached = self.tx.is_cached(h)
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
            elif self.opts.group and spec.data is None and f.data is not None:
                # a sibling shard's item this shard had no room for, served inline: a copy of
                # the sibling's bytes, checked here as a reader checks what it reads
                if (wrong := verify_item(f.data, h, digest, n)) is not None:
                    self.violation(f"served inline from a sibling: {wrong}")
                self.stats["sibling_inline"] += 1
                wired.append(FeatureSpec(h, None))
                checks.append([digest, n])
            else:
                self.violation(f"{h}: sender returned data that is neither a ShmRef nor the input")
        f = pack_features(wired)
        self.send("req", gen=self.gen, d=self.delivery, rid=rid, t0=t0, f=f, c=checks)
        return True

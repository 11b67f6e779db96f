"""The writer process: one generation of an ``AsyncSenderCache``, M request tasks, forgeries.

It runs at most ``--window`` requests ahead of the readers (credits come back from the parent),
checks what the sender returns, sends the references on, and, with the ``forge`` fault, sends
forged and stale references for the readers to refuse. On ``check`` (after quiescence) it checks
that every cached item becomes freeable and that the ring drains.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
import traceback
from collections import Counter, deque
from typing import Any

import anyio

from aioshmcache import AsyncSenderCache, CacheConfig, CacheMissError, FeatureSpec, ShmRef
from aioshmcache.wire import pack_features

from .._core_gaps import retag_reference
from ..framing import Link
from ..lag import LoopLagMeter
from .calls import cancel_mode, guarded
from .forking import fork_lingering
from .options import StressOptions, handout_ttl
from .protocol import HB_INTERVAL, SABOTAGE_EVERY
from .workload import Workload

__all__ = ["WriterProc"]


class WriterProc:
    """One writer generation: an AsyncSenderCache, M request tasks and the probe injector."""

    def __init__(self, opts: StressOptions, gen: int, name: str, delivery: str, link: Link) -> None:
        self.opts = opts
        self.gen = gen
        self.name = name
        self.delivery = delivery
        self.link = link
        self.rng = random.Random(opts.seed * 1000 + gen)
        self.work = Workload(opts)
        self.credit = opts.window
        self.credit_event = asyncio.Event()
        self.stopping = False
        self.rid = 0
        self.stats: Counter[str] = Counter()
        self.lag = LoopLagMeter(0.05, window=1)
        self.recent: deque[tuple[str, dict[str, int]]] = deque(maxlen=512)
        self.seen: deque[int] = deque(maxlen=256)
        self.tx: AsyncSenderCache | None = None
        self.max_op = 0.0
        self.capacity = 0

    def violation(self, text: str) -> None:
        self.stats["violations"] += 1
        self.link.send({"t": "violation", "who": f"writer g{self.gen}", "text": text})

    def config(self) -> CacheConfig:
        o = self.opts
        evict = o.evict_after if ("stop-readers" in o.faults and o.evict_after > 0) else None
        # --group: this process is the writer of its own shard of the group ``self.name``
        return CacheConfig(
            o.capacity,
            o.max_object,
            o.readers,
            name=None if o.group else self.name,
            group=self.name if o.group else None,
            delivery="one_of_n" if self.delivery == "one_of_n" else "broadcast",
            handout_ttl=handout_ttl(o, self.delivery),
            evict_stuck_readers_after=evict,
            second_chance=o.second_chance,
        )

    async def run(self) -> None:
        async with AsyncSenderCache.from_config(self.config()) as tx:
            self.tx = tx
            self.capacity = tx.snapshot().capacity_bytes
            self.link.send(
                {
                    "t": "handle",
                    "gen": self.gen,
                    "handle": tx.handle().to_dict(),
                    "delivery": self.delivery,
                    "name": tx.sender.name,
                }
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.lag.run)
                tg.start_soon(self.heartbeat)
                tasks = [
                    asyncio.ensure_future(self.request_loop(i)) for i in range(self.opts.writers)
                ]
                if "forge" in self.opts.faults and self.opts.probe_rate > 0:
                    tasks.append(asyncio.ensure_future(self.inject_loop()))
                for t in tasks:
                    t.add_done_callback(self.task_done)
                await self.control(tasks)
                tg.cancel_scope.cancel()

    async def control(self, tasks: list[asyncio.Task[None]]) -> None:
        while True:
            msg = await self.link.recv()
            if msg is None:  # the parent is gone
                self.stopping = True
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return
            kind = msg["t"]
            if kind == "credit":
                self.give_credit(int(msg["n"]))
            elif kind == "stop":
                self.stopping = True
                self.credit_event.set()
                _, pending = await asyncio.wait(tasks, timeout=self.opts.op_deadline + 5)
                for t in pending:
                    self.violation("a writer task did not stop within its deadline")
                    t.cancel()
                self.link.send({"t": "stopped", "gen": self.gen, "stats": self.stats_msg()})
            elif kind == "check":
                self.link.send(await self.final_check(float(msg["within"])))
            elif kind == "fork":  # the fork fault: the parent SIGKILLs us next
                pid = fork_lingering(self.link, float(msg["linger"]))
                self.link.send({"t": "forked", "pid": pid})
            elif kind == "slots":
                self.link.send({"t": "slots", "slots": self.slots()})
            elif kind == "exit":
                return

    def task_done(self, t: asyncio.Future[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            exc = t.exception()
            tb = "".join(traceback.format_exception(exc)) if exc is not None else ""
            self.violation(f"writer task crashed: {exc!r}\n{tb}")

    def stats_msg(self) -> dict[str, Any]:
        tx = self.tx
        out: dict[str, Any] = dict(self.stats)
        if tx is not None and not tx.sender.closed:
            snap = tx.snapshot()
            out.update(
                hits=snap.hits,
                misses=snap.misses,
                inline_full=snap.inline_full,
                inline_too_large=snap.inline_too_large,
                evictions=snap.evictions,
                relocations=snap.relocations,
                bytes_relocated=snap.bytes_relocated,
                inline_busy=tx.inline_busy,
                items=snap.items,
                bytes_used=snap.bytes_used,
                sibling_hits=snap.sibling_hits,
            )
        out["lag_max"] = self.lag.max
        out["lag_over_100ms"] = self.lag.n_large
        out["op_max"] = self.max_op
        return out

    async def heartbeat(self) -> None:
        while True:
            self.link.send({"t": "hb", "stats": self.stats_msg()})
            if self.lag.max > self.opts.max_loop_lag and not self.stats["lag_reported"]:
                self.stats["lag_reported"] = 1
                self.violation(f"writer event loop blocked for {self.lag.max:.2f} s")
            await asyncio.sleep(HB_INTERVAL)

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
        if self.stopping:
            return False
        self.credit -= 1
        return True

    def build(
        self, ks: list[int], force_data: set[str]
    ) -> tuple[list[FeatureSpec], list[tuple[str, int, dict[str, Any], int, int]]]:
        tx = self.tx
        if tx is None:
            raise RuntimeError("no sender")
        specs: list[FeatureSpec] = []
        meta: list[tuple[str, int, dict[str, Any], int, int]] = []
        for j, k in enumerate(ks):
            h = self.work.name(k)
            item, digest, n = self.work.item(k)
            r = self.rng.random()
            data: Any = item
            if h not in force_data and (
                (r < 0.4 and tx.is_cached_item(h)) or (r > 0.97 and k in self.seen)
            ):
                data = None  # "the readers have it": a miss here is the sender's CacheMissError
            specs.append(
                FeatureSpec(h, data, identifier=f"{self.rid}.{j}", prompt_updates=(("upd", k),))
            )
            meta.append((h, k, item, digest, n))
        return specs, meta

    async def request_loop(self, task_no: int) -> None:
        o, rng, tx = self.opts, self.rng, self.tx
        if tx is None:
            return
        while not self.stopping:
            if not await self.take_credit():
                return
            self.rid += 1
            rid = self.rid
            ks = [self.work.sample(rng) for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4)))]
            force: set[str] = set()
            wait = 0.0
            if o.wait_for_space > 0 and rng.random() < 0.2:
                wait = rng.uniform(0.0, o.wait_for_space)
            sent = False
            # each CacheMissError names hashes passed as None, resent with data: this ends
            for attempt in range(len(ks) + 1):
                specs, meta = self.build(ks, force)
                mode = cancel_mode(o, rng)
                t0 = time.monotonic()
                call = functools.partial(tx.get_and_update_features, specs, wait_for_space=wait)
                res = await guarded(call, mode=mode, deadline=o.op_deadline, rng=rng)
                took = time.monotonic() - t0
                self.max_op = max(self.max_op, took)
                self.stats["requests"] += 1
                if res.kind == "timeout":
                    self.violation(f"get_and_update_features missed its {o.op_deadline} s deadline")
                    break
                if res.kind == "cancelled":
                    self.stats[f"cancelled_{mode}"] += 1
                    break
                if res.kind == "error":
                    exc = res.exc
                    if (
                        isinstance(exc, CacheMissError)
                        and attempt < len(ks)
                        and not set(exc.mm_hashes) <= force
                    ):
                        self.stats["sender_cache_miss"] += 1
                        force.update(exc.mm_hashes)
                        continue
                    self.violation(f"get_and_update_features raised {exc!r}")
                    break
                if mode != "none":
                    self.stats["cancel_too_late"] += 1
                sent = self.publish(rid, t0, specs, meta, res.value)
                break
            if not sent:  # nothing went to the readers: no credit comes back for it
                self.give_credit(1)
            await asyncio.sleep(0)

    def publish(
        self,
        rid: int,
        t0: float,
        specs: list[FeatureSpec],
        meta: list[tuple[str, int, dict[str, Any], int, int]],
        out: Any,
    ) -> bool:
        """Check what the sender returned and send the references (no await: cancel-safe)."""
        wired: list[FeatureSpec] = []  # what the readers get: the references, None for inline
        checks: list[list[int]] = []  # per feature: the digest and size the reader verifies
        if not isinstance(out, list) or len(out) != len(specs):
            self.violation(f"get_and_update_features returned {type(out).__name__}")
            return False
        # self-test: a lying digest on every SABOTAGE_EVERY-th reference (count-based, not
        # random: the run keeps going until the readers have caught some, however slow it is)
        sabotage = "digest" in self.opts.sabotage
        for spec, f, (h, k, item, digest, n) in zip(specs, out, meta):
            self.seen.append(k)
            if not isinstance(f, FeatureSpec) or f.mm_hash != h:
                self.violation(f"{h}: sender returned {f!r}")
                continue
            updates = tuple(f.prompt_updates)
            # DESIGN: prompt updates stay in the writer process only, so an item a group shard
            # copied from a sibling (asked for with None) comes back without them
            sibling_copy = self.opts.group and spec.data is None and updates == ()
            if (
                updates != tuple(spec.prompt_updates) and not sibling_copy
            ) or f.identifier != spec.identifier:
                self.violation(f"{h}: prompt updates / identifier not preserved")
            if isinstance(f.data, ShmRef):
                self.recent.append((h, f.data.to_dict()))
                self.stats["refs"] += 1
                self.stats["ref_bytes"] += n
                lie = sabotage and self.stats["refs"] % SABOTAGE_EVERY == 0
                if lie:
                    self.stats["sabotaged"] += 1
                wired.append(FeatureSpec(h, f.data))
                checks.append([digest ^ 1 if lie else digest, n])
            elif f.data is item and spec.data is item:
                self.stats["inline"] += 1
                wired.append(FeatureSpec(h, None))
                checks.append([digest, n])
            else:
                self.violation(f"{h}: sender returned data that is neither a ShmRef nor the input")
        self.link.send(
            {
                "t": "req",
                "gen": self.gen,
                "d": self.delivery,
                "rid": rid,
                "t0": t0,
                "f": pack_features(wired),
                "c": checks,
            }
        )
        return True

    # --- forged and stale references ------------------------------------------------------
    async def inject_loop(self) -> None:
        tx = self.tx
        if tx is None:
            return
        kinds = (
            "stale_evicted",
            "past_epoch",
            "future_epoch",
            "foreign_nonce",
            "misaligned",
            "out_of_range",
            "wrong_length",
            "unissued_id",
            "random",
            "malformed",
        )
        while not self.stopping:
            await asyncio.sleep(self.rng.expovariate(self.opts.probe_rate))
            if self.stopping or not self.recent:
                continue
            kind = self.rng.choice(kinds)
            probe = self.forge(kind)
            if probe is None:
                continue
            via = "item" if self.rng.random() < 0.3 else "features"
            ref, expect, kind = probe
            if via == "item":
                expect = ["StaleReferenceError" if e == "CacheMissError" else e for e in expect]
            self.stats[f"probe_{kind}"] += 1
            self.stats["probes"] += 1
            self.link.send(
                {
                    "t": "probe",
                    "gen": self.gen,
                    "kind": kind,
                    "via": via,
                    "h": "forged",
                    "ref": ref,
                    "expect": expect,
                }
            )

    def forge(self, kind: str) -> tuple[dict[str, Any], list[str], str] | None:
        """A forged or stale reference and the typed errors a reader may answer it with.

        References carry a tag binding their fields to the segment's secret, so an altered field
        is ``InvalidReferenceError``. Half of the forgeries are re-tagged with the secret (what
        an attacker who can map the segment could do): then the ring's own checks (bounds,
        alignment, chunk header, id, state, length) must still refuse them.
        """
        tx = self.tx
        if tx is None:
            return None
        h, ref = self.rng.choice(self.recent)
        r: dict[str, Any] = dict(ref)
        inv, miss = "InvalidReferenceError", "CacheMissError"
        if kind == "stale_evicted":
            if tx.is_cached_item(h):
                return None  # cached (this chunk or a newer one): not certainly stale
            return r, [miss], kind
        if kind == "malformed":  # not even a well-formed reference
            variant = self.rng.randrange(4)
            if variant == 0:
                del r["length"]
            elif variant == 1:
                r["address"] = -64
            elif variant == 2:
                r["id"] = "7"
            else:
                r["epoch"] = True
            return r, [inv], kind
        if kind == "foreign_nonce":
            r["nonce"] ^= 0x2
            return r, [inv], kind
        cap = self.capacity
        if kind == "past_epoch":
            r["epoch"] -= 1
            retagged = [miss]  # an older epoch with a valid tag: from before a clear
        elif kind == "future_epoch":
            r["epoch"] += 1
            retagged = [inv]
        elif kind == "misaligned":
            r["address"] += 8
            retagged = [inv]
        elif kind == "out_of_range":
            r["address"] = cap + 64 * self.rng.randrange(1, 1 << 20)
            retagged = [inv]
        elif kind == "wrong_length":
            r["length"] += self.rng.choice((1, 64, 4096))
            retagged = [inv, miss]  # stale if the chunk was evicted meanwhile
        elif kind == "unissued_id":
            r["id"] = (1 << 62) + self.rng.randrange(1 << 40)
            retagged = [inv]
        elif kind == "random":
            r["address"] = self.rng.randrange(0, cap // 64) * 64
            r["id"] = self.rng.randrange(1, max(2, self.max_id_issued() + 1))
            r["length"] = self.rng.randrange(0, 1 << 20)
            retagged = [inv, miss]  # an issued id at a place it does not live: stale or invalid
        else:
            raise ValueError(kind)
        if self.rng.random() < 0.5:
            tag = retag_reference(tx.sender, r)
            if tag is not None:
                r["tag"] = tag
                return r, retagged, kind + "+tag"
        return r, [inv], kind

    def max_id_issued(self) -> int:
        """The largest chunk id among the references handed out lately."""
        return max((int(ref["id"]) for _h, ref in self.recent), default=1)

    async def final_check(self, within: float) -> dict[str, Any]:
        """After quiescence: every cached item becomes freeable, and then the ring drains."""
        tx = self.tx
        out: dict[str, Any] = {"t": "final", "gen": self.gen}
        if tx is None:
            out["error"] = "no sender"
            return out
        deadline = time.monotonic() + within
        while True:
            keys = tx.cached_order()
            stuck = [h for h in keys if not tx.is_freeable(h)]
            if not stuck or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        out["items"] = len(keys)
        out["not_freeable"] = stuck[:20]
        out["n_not_freeable"] = len(stuck)
        if not stuck:
            await tx.remove_dangling_items()
        snap = tx.snapshot()
        out["after_items"] = snap.items
        out["after_bytes"] = snap.bytes_used
        out["slots"] = self.slots()
        out["stats"] = self.stats_msg()
        return out

    def slots(self) -> list[dict[str, Any]]:
        """The reader slots as the writer sees them now."""
        tx = self.tx
        if tx is None or tx.sender.closed:
            return []
        return [
            {
                "slot": s.slot,
                "attached": s.attached,
                "alive": s.alive,
                "pid": s.pid,
                "lag": s.lag,
                "acknowledged": s.acknowledged,
                "revoked": s.revoked,
            }
            for s in tx.snapshot().readers
        ]

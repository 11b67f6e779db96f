"""The reader process: attaches to each writer generation in turn and verifies every array.

Every genuine reference must return exactly the item written for its hash (crc32 over every
array) or a typed error that something explains; every forged or stale one must be refused with
one of the typed errors the writer expects. A reader that was attached to a writer that died must
see ``WriterGoneError`` from it within ``DEAD_WRITER_BOUND`` of the death.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import traceback
from collections import Counter
from typing import Any, Final

import anyio

from aioshmcache import (
    AsyncReceiverCache,
    CacheMissError,
    ClosedCacheError,
    FeatureSpec,
    ReaderEvictedError,
    SegmentNotFoundError,
    ShmCacheError,
    WriterGoneError,
)

from ..framing import Link
from ..lag import LoopLagMeter
from .calls import cancel_mode, guarded
from .closing import read_while_closing
from .forking import fork_lingering
from .options import StressOptions
from .protocol import HB_INTERVAL, SABOTAGE_EVERY, Feature, request_features
from .workload import verify_item

__all__ = ["DEAD_WRITER_BOUND", "ReaderProc"]

DEAD_WRITER_BOUND: Final = 1.0  # DESIGN 4: a reader learns of a dead writer within 1 s


class ReaderProc:
    """One reader: attaches to each writer generation in turn and verifies every array."""

    def __init__(self, opts: StressOptions, token: str, seed: int, link: Link) -> None:
        self.opts = opts
        self.token = token
        self.link = link
        self.rng = random.Random(seed)
        self.rx: AsyncReceiverCache | None = None
        self.gen = 0
        self.handle: dict[str, Any] | None = None
        self.delivery = "broadcast"
        self.gone = False  # the current generation's writer is gone
        self.need_reattach = False
        self.attach_after = 0.0
        self.group: str | None = None  # --group: the cache group this reader is attached to
        self.unowed_ids: set[tuple[int, int]] = set()  # (nonce, chunk id)
        self.nonce_seen: dict[int, float] = {}  # --group: a shard first read from, and when
        self.reads_by_nonce: Counter[int] = Counter()  # per shard: session_reads
        # per writer instance: the highest hand-out seq this session read and acknowledged
        self.acked_seq: dict[int, int] = {}
        self.session_reads = 0  # references read and verified in this session (one ack each)
        self.session_uncertain = 0  # cancelled or half-read requests: acks we cannot count
        self.inflight = 0
        self.sabotage_seen = 0  # requests with references seen (the drop sabotage counts them)
        self.idle = asyncio.Event()
        self.idle.set()
        self.sem = asyncio.Semaphore(opts.reader_concurrency)
        self.lag = LoopLagMeter(0.05, window=1)
        self.tasks: set[asyncio.Task[None]] = set()
        # the close-read fault: the cache it closed (its operations may raise ClosedCacheError)
        self.closed_rx: AsyncReceiverCache | None = None

    def violation(self, text: str) -> None:
        self.link.send({"t": "violation", "who": f"reader {self.token}", "text": text})

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.heartbeat)
            tg.start_soon(self.lag.run)
            try:
                await self.dispatch()
            finally:
                await self.wait_idle()
                await self.detach()
                tg.cancel_scope.cancel()

    async def heartbeat(self) -> None:
        while True:
            self.link.send({"t": "hb", "gen": self.gen, "lag_max": self.lag.max})
            await asyncio.sleep(HB_INTERVAL)

    async def wait_idle(self) -> None:
        with anyio.move_on_after(self.opts.op_deadline * 2):
            await self.idle.wait()

    async def dispatch(self) -> None:
        while True:
            msg = await self.link.recv()
            if msg is None:
                return
            kind = msg["t"]
            if self.need_reattach and kind in ("req", "probe", "sync"):
                await self.wait_idle()
                await self.reattach()
            if kind in ("req", "probe"):
                if "drop" in self.opts.sabotage and kind == "req" and self.drop_this(msg):
                    # self-test: a reader that silently loses requests (it says so to the parent,
                    # which keeps the run going until some were dropped)
                    self.link.send(
                        {"t": "done", "rid": msg["rid"], "gen": msg["gen"], "r": "ok", "dropped": 1}
                    )
                    continue
                await self.sem.acquire()
                self.inflight += 1
                self.idle.clear()
                task = asyncio.ensure_future(self.run_one(msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif kind == "handle":
                await self.wait_idle()
                await self.switch(msg)
            elif kind == "group":  # --group: attach to the whole group, once
                if self.group is None:
                    self.group = str(msg["group"])
                    await self.attach()
            elif kind == "sync":
                await self.wait_idle()
                # the parent compares ``reads`` with the acknowledgements our slot (found by pid)
                # holds in the writer's snapshot: every verified read wrote one, none was lost
                self.link.send(
                    {
                        "t": "synced",
                        "token": msg["token"],
                        "gen": self.gen,
                        "attached": self.rx is not None and not self.gone,
                        "pid": os.getpid(),
                        "reads": self.session_reads,
                        "reads_by_nonce": [[n, c] for n, c in self.reads_by_nonce.items()],
                        "uncertain": self.session_uncertain,
                    }
                )
            elif kind == "fork":  # the fork fault: the parent SIGKILLs us next
                pid = fork_lingering(self.link, float(msg["linger"]))
                self.link.send({"t": "forked", "pid": pid})
            elif kind == "exit":
                return

    def drop_this(self, msg: dict[str, Any]) -> bool:
        """Sabotage: drop every SABOTAGE_EVERY-th request that holds a reference."""
        if self.rx is None or self.gone or (self.group is None and int(msg["gen"]) != self.gen):
            return False
        if all(ref is None for _h, ref, _d, _n in request_features(msg)):
            return False
        self.sabotage_seen += 1
        return self.sabotage_seen % SABOTAGE_EVERY == 0

    async def run_one(self, msg: dict[str, Any]) -> None:
        try:
            if msg["t"] == "req":
                await self.read_request(msg)
            else:
                await self.read_probe(msg)
        except Exception as exc:
            self.violation(f"reader harness error: {exc!r}\n{traceback.format_exc()}")
        finally:
            self.sem.release()
            self.inflight -= 1
            if not self.inflight:
                self.idle.set()

    # --- attach / detach --------------------------------------------------------------------
    async def detach(self) -> None:
        rx, self.rx = self.rx, None
        if rx is not None:
            with anyio.move_on_after(self.opts.op_deadline) as sc:
                await rx.aclose()
            if sc.cancelled_caught:
                self.violation("AsyncReceiverCache.aclose missed its deadline")

    async def attach(self) -> None:
        if self.group is not None:
            rx = AsyncReceiverCache.attach_group(self.group, wait_for_shard=self.opts.op_deadline)
        elif self.handle is None:
            return
        else:
            rx = AsyncReceiverCache.attach(self.handle)
        try:
            with anyio.fail_after(self.opts.op_deadline):
                await rx.open()
        except (WriterGoneError, SegmentNotFoundError) as exc:
            self.gone = True
            self.link.send(
                {
                    "t": "err",
                    "kind": type(exc).__name__,
                    "gen": self.gen,
                    "where": "attach",
                    "text": str(exc),
                }
            )
            return
        except TimeoutError:
            self.violation("attach missed its deadline")
            self.gone = True
            return
        except ShmCacheError as exc:
            self.violation(f"attach to g{self.gen} raised {exc!r}")
            self.gone = True
            return
        self.rx = rx
        self.gone = False
        self.attach_after = time.monotonic()
        self.unowed_ids = set()
        self.nonce_seen = {}
        self.reads_by_nonce = Counter()
        self.acked_seq = {}
        self.session_reads = self.session_uncertain = 0
        self.link.send({"t": "attached", "gen": self.gen})

    async def reattach(self) -> None:
        self.need_reattach = False
        why = "close-read" if self.rx is not None and self.rx is self.closed_rx else "revoked"
        await self.detach()
        await self.attach()
        self.link.send({"t": "err", "kind": "reattach", "gen": self.gen, "where": why})

    async def switch(self, msg: dict[str, Any]) -> None:
        """A new writer generation: the old one must have been reported gone (within 1 s)."""
        if int(msg["gen"]) == self.gen:
            return  # already have it (sent on hello and again with the generation change)
        prev = msg.get("prev")
        if (
            self.rx is not None
            and not self.gone
            and prev is not None
            and self.rx is not self.closed_rx
        ):
            dead_at = float(prev["dead_at"])
            while True:
                t_call = time.monotonic()
                try:
                    await self.rx.get_and_update_features([])
                except WriterGoneError:
                    self.link.send(
                        {"t": "err", "kind": "WriterGoneError", "gen": self.gen, "where": "switch"}
                    )
                    break
                except ReaderEvictedError:
                    break
                if t_call - dead_at > DEAD_WRITER_BOUND:
                    self.violation(
                        f"writer g{self.gen} died {t_call - dead_at:.2f} s ago and the reader "
                        "still does not see WriterGoneError"
                    )
                    break
                await asyncio.sleep(0.05)
        await self.detach()
        self.gen = int(msg["gen"])
        self.handle = msg["handle"]
        self.delivery = str(msg["delivery"])
        self.need_reattach = False
        await self.attach()

    # --- reads --------------------------------------------------------------------------------
    def report(self, msg: dict[str, Any], result: str, **extra: Any) -> None:
        out = {"t": "done", "rid": msg["rid"], "gen": msg["gen"], "r": result}
        out.update(extra)
        self.link.send(out)

    def stale_gen(self, msg: dict[str, Any]) -> bool:
        """Not for the writer generation we read (a group reader reads every generation)."""
        return self.group is None and (self.gone or int(msg["gen"]) != self.gen)

    def count_reads(self, nonce: int | None, n: int) -> None:
        self.session_reads += n
        if nonce is not None:
            self.reads_by_nonce[nonce] += n

    async def read_request(self, msg: dict[str, Any]) -> None:
        rx = self.rx
        if rx is None or self.stale_gen(msg):
            self.report(msg, "skip")
            return
        t0 = float(msg["t0"])
        feats = request_features(msg)
        # a request holds the references of one writer: one shard
        nonce = next((ref.nonce for _h, ref, _d, _n in feats if ref is not None), None)
        try:
            await self.read_checked(msg, rx, t0, feats, nonce)
        finally:
            if nonce is not None and nonce not in self.nonce_seen:
                # a group reader attaches to a new shard when it first reads from it: hand-outs
                # made before this moment may not be owed to it
                self.nonce_seen[nonce] = time.monotonic()

    async def read_checked(
        self,
        msg: dict[str, Any],
        rx: AsyncReceiverCache,
        t0: float,
        feats: list[Feature],
        nonce: int | None,
    ) -> None:
        specs: list[FeatureSpec] = []
        for h, ref, _digest, _n in feats:
            if ref is None:
                specs.append(FeatureSpec(h, None))
            else:  # both forms of a reference the receiver accepts
                specs.append(FeatureSpec(h, ref if self.rng.random() < 0.5 else ref.to_dict()))
        maybe_unowed = t0 < self.attach_after
        if self.group is not None and nonce is not None:
            seen = self.nonce_seen.get(nonce)
            maybe_unowed = maybe_unowed or seen is None or t0 < seen
        if maybe_unowed:
            self.unowed_ids.update(
                (ref.nonce, ref.id) for _h, ref, _d, _n in feats if ref is not None
            )
        mode = cancel_mode(self.opts, self.rng)
        if (
            "close-read" in self.opts.faults
            and rx is not self.closed_rx
            and self.rng.random() < self.opts.close_read_prob
        ):
            mode = "close"
            self.closed_rx = rx
            self.need_reattach = True  # the next message attaches again (a new session)
            res = await read_while_closing(
                rx,
                lambda: rx.get_and_update_features(specs),
                deadline=self.opts.op_deadline,
                rng=self.rng,
            )
        else:
            res = await guarded(
                lambda: rx.get_and_update_features(specs),
                mode=mode,
                deadline=self.opts.op_deadline,
                rng=self.rng,
            )
        if res.kind == "timeout":
            self.violation(f"get_and_update_features missed its {self.opts.op_deadline} s deadline")
            self.report(msg, "timeout")
            return
        if res.kind == "cancelled":
            self.session_uncertain += 1
            self.report(msg, f"cancelled_{mode}")
            return
        if res.kind == "ok":
            n_ok, nbytes, bad = self.verify(feats, res.value)
            self.count_reads(nonce, n_ok + bad)
            for _h, ref, _d, _n in feats:
                if ref is not None and ref.seq > self.acked_seq.get(ref.nonce, 0):
                    self.acked_seq[ref.nonce] = ref.seq
            self.report(msg, "ok", n=n_ok, b=nbytes, bad=bad, closing=int(mode == "close"))
            return
        exc = res.exc
        if isinstance(exc, CacheMissError):
            n_ok = nbytes = bad = 0
            if exc.features is not None:
                n_ok, nbytes, bad = self.verify(feats, exc.features, allow_missing=True)
                self.count_reads(nonce, n_ok + bad)
            stale = self.stale_indices(feats, exc.features)
            delivery = str(msg.get("d", self.delivery))
            explained, unexplained = await self.classify(feats, stale, t0, maybe_unowed, delivery)
            self.report(
                msg,
                "miss",
                n=n_ok,
                b=nbytes,
                bad=bad,
                stale=len(stale),
                why=dict(explained),
                unexplained=len(unexplained),
            )
            for why in unexplained:
                self.violation(why)
            return
        self.session_uncertain += 1  # part of the request may have been read and acknowledged
        if isinstance(exc, ClosedCacheError) and rx is self.closed_rx:
            # the close-read fault closed this cache under the read (or beside it): typed
            self.report(msg, "closed_during_read" if mode == "close" else "closed_beside_read")
            return
        if isinstance(exc, ReaderEvictedError):
            self.need_reattach = True
            self.report(msg, "ReaderEvictedError")
            return
        if isinstance(exc, WriterGoneError):
            self.gone = self.group is None  # a group reader goes on with the other shards
            self.report(msg, "WriterGoneError")
            return
        self.violation(f"genuine request {msg['rid']} (g{msg['gen']}) raised {exc!r}")
        self.report(msg, f"unexpected_{type(exc).__name__}")

    def verify(
        self, feats: list[Feature], out: Any, *, allow_missing: bool = False
    ) -> tuple[int, int, int]:
        if not isinstance(out, list) or len(out) != len(feats):
            self.violation(f"receiver returned {type(out).__name__} for {len(feats)} features")
            return 0, 0, 1
        n_ok = nbytes = bad = 0
        for (h, ref, digest, n), f in zip(feats, out):
            if not isinstance(f, FeatureSpec) or f.mm_hash != h:
                self.violation(f"receiver returned {f!r} for {h}")
                bad += 1
                continue
            if ref is None:
                if f.data is not None:
                    self.violation(f"{h}: inline placeholder came back as {type(f.data).__name__}")
                    bad += 1
                continue
            if f.data is None and allow_missing:
                continue
            err = verify_item(f.data, h, digest, n)
            if err is not None:
                self.violation(f"WRONG DATA: {err}")
                bad += 1
            else:
                n_ok += 1
                nbytes += n
        return n_ok, nbytes, bad

    @staticmethod
    def stale_indices(feats: list[Feature], out: Any) -> list[int]:
        if not isinstance(out, list):
            return [i for i, f in enumerate(feats) if f[1] is not None]
        return [
            i
            for i, (f, o) in enumerate(zip(feats, out))
            if f[1] is not None and isinstance(o, FeatureSpec) and o.data is None
        ]

    async def classify(
        self,
        feats: list[Feature],
        stale: list[int],
        t0: float,
        maybe_unowed: bool,
        delivery: str,
    ) -> tuple[Counter[str], list[str]]:
        """Why stale genuine references are explained (by cause); the others, described."""
        now = time.monotonic()
        explained: Counter[str] = Counter()
        todo: list[int] = []
        for i in stale:
            ref = feats[i][1]
            if delivery == "one_of_n":
                if now - t0 > self.opts.handout_ttl - 0.05:
                    explained["ttl"] += 1
                    continue
            elif maybe_unowed:
                explained["before_attach"] += 1
                continue
            elif ref is not None and (ref.nonce, ref.id) in self.unowed_ids:
                explained["unowed_ack"] += 1
                continue
            elif (
                ref is not None
                and now - t0 > self.opts.handout_ttl - 0.05
                and ref.seq < self.acked_seq.get(ref.nonce, 0)
            ):
                # the ledger's lost-hand-out rule: older than handout_ttl while this reader has
                # acknowledged a later hand-out of the same writer (a delivery delayed that long)
                explained["lapsed"] += 1
                continue
            todo.append(i)
        if not todo:
            return explained, []
        if delivery != "one_of_n" and self.rx is not None:
            # revoked? Asked with the stale references themselves: a revocation is per shard for
            # a group reader, and only a request routed to that shard raises it (a stale
            # reference is read around again, and owes nothing: it is not acknowledged)
            again = [FeatureSpec(feats[i][0], feats[i][1]) for i in todo]
            try:
                await self.rx.get_and_update_features(again)
            except ReaderEvictedError:
                self.need_reattach = True
                explained["revoked"] += len(todo)
                return explained, []
            except (WriterGoneError, ShmCacheError):
                pass
        why = []
        for i in todo:
            h, ref = feats[i][0], feats[i][1]
            why.append(
                f"{h} (chunk {ref.id if ref else '?'}, {delivery}, g{self.gen}) was reclaimed "
                f"{now - t0:.2f} s after its hand-out, before this reader acknowledged it"
            )
        return explained, why

    async def read_probe(self, msg: dict[str, Any]) -> None:
        rx = self.rx
        out: dict[str, Any] = {"t": "probe_done", "kind": msg["kind"], "gen": msg["gen"]}
        if rx is None or self.stale_gen(msg):
            out["r"] = "skip"
            self.link.send(out)
            return
        ref, h, expect = msg["ref"], str(msg["h"]), list(msg["expect"])

        async def call() -> Any:
            if msg["via"] == "item":
                return await rx.get_and_update_item(ref, h)
            return await rx.get_and_update_features([FeatureSpec(h, ref)])

        res = await guarded(call, mode="none", deadline=self.opts.op_deadline, rng=self.rng)
        if res.kind == "timeout":
            self.violation(f"probe {msg['kind']} missed its deadline")
            out["r"] = "timeout"
        elif res.kind == "ok":
            self.violation(
                f"FORGED/STALE reference ({msg['kind']}, via {msg['via']}) returned data "
                f"instead of one of {expect}: {ref}"
            )
            out["r"] = "DATA"
        else:
            name = type(res.exc).__name__
            out["r"] = name
            if name in expect:
                pass
            elif isinstance(res.exc, ClosedCacheError) and rx is self.closed_rx:
                out["r"] = "closed_beside_read"  # the close-read fault closed it meanwhile
            elif isinstance(res.exc, ReaderEvictedError):
                self.need_reattach = True
            elif isinstance(res.exc, WriterGoneError):
                self.gone = self.group is None
            else:
                self.violation(
                    f"probe {msg['kind']} (via {msg['via']}) raised {res.exc!r}, expected {expect}"
                )
        self.link.send(out)

"""The reader process: attaches to each writer generation in turn and verifies every array.

Every genuine reference must return exactly the item written for its hash (crc32 over every
array) or a typed error that something explains; every forged or stale one must be refused with
a typed error the writer expects. A reader attached to a writer that died must see
``WriterGoneError`` from it within 1 s of the death. With ``close-read`` a reader closes its own
cache from a worker thread (the sync ``close``, which races a read) none, up to 0.2 ms or up to
2 ms after a read started; reads under or beside it must end with verified bytes or a typed
error, then the reader attaches again (a new session).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
import traceback
from collections import Counter
from typing import Any, Final

import anyio
import anyio.to_thread

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
from .child import SABOTAGE_EVERY, Feature, Proc, guarded, request_features
from .options import StressOptions
from .workload import verify_item

DEAD_WRITER_BOUND: Final = 1.0  # DESIGN 4: a reader learns of a dead writer within 1 s


def close_after(receiver: Any, delay: float) -> None:
    """The close-read fault, in a worker thread: close ``receiver`` ``delay`` s from now."""
    time.sleep(delay)
    receiver.close()


@dataclasses.dataclass
class Session:
    """What one attachment (one reader slot) has read and acknowledged."""

    attached_at: float = dataclasses.field(default_factory=time.monotonic)
    unowed: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # (nonce, chunk id)
    nonce_seen: dict[int, float] = dataclasses.field(default_factory=dict)  # group: shard, when
    reads: Counter[int | None] = dataclasses.field(default_factory=Counter)  # verified, by nonce
    acked_seq: dict[int, int] = dataclasses.field(default_factory=dict)  # highest seq, by nonce
    uncertain: int = 0  # cancelled or half-read requests: acknowledgements we cannot count


class ReaderProc(Proc):
    """One reader: attaches to each writer generation in turn and verifies every array."""

    def __init__(self, opts: StressOptions, link: Link, token: str, *, seed: int) -> None:
        super().__init__(opts, link, seed)
        self.who = f"reader {token}"
        self.rx: AsyncReceiverCache | None = None
        self.closed_rx: AsyncReceiverCache | None = None  # the cache close-read closed
        self.gen, self.delivery = 0, "broadcast"
        self.handle: dict[str, Any] | None = None
        self.group: str | None = None  # --group: the cache group this reader is attached to
        self.gone = self.need_reattach = False  # gone: the current generation's writer is
        self.s = Session()
        self.inflight, self.sabotage_seen = 0, 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.sem = asyncio.Semaphore(opts.reader_concurrency)
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.heartbeat)
            try:
                await self.serve()
            finally:
                await self.wait_idle()
                await self.detach()
                tg.cancel_scope.cancel()

    async def wait_idle(self) -> None:
        with anyio.move_on_after(self.opts.op_deadline * 2):
            await self.idle.wait()

    def err(self, kind: str, where: str, text: str = "") -> None:
        """A typed error outside a request (counted by the parent)."""
        wgone = kind == "WriterGoneError"
        self.send(
            "count", e={f"{kind} ({where})": 1}, gen=self.gen, kind=kind, text=text, wgone=wgone
        )

    def done(
        self, msg: dict[str, Any], result: str, e: dict[str, int] | None = None, /, **c: int
    ) -> None:
        """A request is settled: its outcome and counters."""
        c = {k: v for k, v in dict(c, reads=1, **{f"read_{result}": 1}).items() if v}
        self.send(
            "done",
            rid=msg["rid"],
            gen=msg["gen"],
            c=c,
            e=e or {},
            wgone=result == "WriterGoneError",
        )

    # --- the parent's messages -------------------------------------------------------------
    async def maybe_reattach(self) -> None:
        if self.need_reattach:
            await self.wait_idle()
            self.need_reattach = False
            why = "close-read" if self.rx is not None and self.rx is self.closed_rx else "revoked"
            await self.detach()
            await self.attach()
            self.err("reattach", why)

    async def on_req(self, msg: dict[str, Any]) -> None:
        await self.maybe_reattach()
        if "drop" in self.opts.sabotage and msg["t"] == "req" and self.drop_this(msg):
            # self-test: a reader that silently loses requests (it tells the parent, which keeps
            # the run going until some were dropped)
            return self.done(msg, "ok", sabotage_dropped=1)
        await self.sem.acquire()
        self.inflight += 1
        self.idle.clear()
        task = asyncio.ensure_future(self.run_one(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    on_probe = on_req

    async def on_handle(self, msg: dict[str, Any]) -> None:
        await self.wait_idle()
        await self.switch(msg)

    async def on_group(self, msg: dict[str, Any]) -> None:
        """--group: attach to the whole group, once."""
        if self.group is None:
            self.group = str(msg["group"])
            await self.attach()

    async def on_sync(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The parent compares ``reads`` with the acknowledgements our slot (found by pid) holds."""
        await self.maybe_reattach()
        await self.wait_idle()
        s, attached = self.s, self.rx is not None and not self.gone
        by_nonce = [[n, c] for n, c in s.reads.items() if n is not None]
        reads = sum(s.reads.values())
        return {
            "gen": self.gen,
            "attached": attached,
            "pid": os.getpid(),
            "reads": reads,
            "reads_by_nonce": by_nonce,
            "uncertain": s.uncertain,
        }

    def drop_this(self, msg: dict[str, Any]) -> bool:
        """Sabotage: drop every SABOTAGE_EVERY-th request that holds a reference."""
        if self.rx is None or self.stale_gen(msg):
            return False
        if all(ref is None for _h, ref, _d, _n in request_features(msg)):
            return False
        self.sabotage_seen += 1
        return self.sabotage_seen % SABOTAGE_EVERY == 0

    async def run_one(self, msg: dict[str, Any]) -> None:
        try:
            await (self.read_request(msg) if msg["t"] == "req" else self.read_probe(msg))
        except Exception as exc:
            self.violation(f"reader harness error: {exc!r}\n{traceback.format_exc()}")
        finally:
            self.sem.release()
            self.inflight -= 1
            if not self.inflight:
                self.idle.set()

    # --- attach / detach -----------------------------------------------------------------------
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
        self.gone = True
        try:
            with anyio.fail_after(self.opts.op_deadline):
                await rx.open()
        except (WriterGoneError, SegmentNotFoundError) as exc:
            return self.err(type(exc).__name__, "attach", str(exc))
        except TimeoutError:
            return self.violation("attach missed its deadline")
        except ShmCacheError as exc:
            return self.violation(f"attach to g{self.gen} raised {exc!r}")
        self.rx, self.gone, self.s = rx, False, Session()

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
                    self.err("WriterGoneError", "switch")
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
        self.gen, self.handle, self.delivery = int(msg["gen"]), msg["handle"], str(msg["delivery"])
        self.need_reattach = False
        await self.attach()

    # --- reads ---------------------------------------------------------------------------------
    def stale_gen(self, msg: dict[str, Any]) -> bool:
        """Not for the writer generation we read (a group reader reads every generation)."""
        return self.group is None and (self.gone or int(msg["gen"]) != self.gen)

    async def read_request(self, msg: dict[str, Any]) -> None:
        rx, s, o = self.rx, self.s, self.opts
        if rx is None or self.stale_gen(msg):
            return self.done(msg, "skip")
        t0, feats = float(msg["t0"]), request_features(msg)
        # a request holds the references of one writer: one shard
        nonce = next((ref.nonce for _h, ref, _d, _n in feats if ref is not None), None)
        # hand-outs made before this session (or, in a group, before its first read of the
        # shard, which attaches it) may not be owed to it
        seen = s.nonce_seen.get(nonce, time.monotonic()) if nonce is not None else 0.0
        unowed = t0 < s.attached_at or (self.group is not None and nonce is not None and t0 < seen)
        if unowed:
            s.unowed.update((ref.nonce, ref.id) for _h, ref, _d, _n in feats if ref is not None)
        # both forms of a reference the receiver accepts
        specs = [
            FeatureSpec(h, r if r is None or self.rng.random() < 0.5 else r.to_dict())
            for h, r, _d, _n in feats
        ]
        mode, delay = self.cancel_mode(), 0.0
        closing = "close-read" in o.faults and rx is not self.closed_rx
        if closing := closing and self.rng.random() < o.close_read_prob:
            # close-read (see the module docstring); the next message reattaches
            mode, self.closed_rx, self.need_reattach = "close", rx, True
            delay = self.rng.choice((0.0, self.rng.uniform(0, 0.0002), self.rng.uniform(0, 0.002)))
        call = functools.partial(rx.get_and_update_features, specs)
        try:
            async with anyio.create_task_group() as tg:
                if closing:
                    tg.start_soon(
                        anyio.to_thread.run_sync, functools.partial(close_after, rx.receiver, delay)
                    )
                res = await guarded(
                    call, mode="none" if closing else mode, deadline=o.op_deadline, rng=self.rng
                )
        finally:
            if nonce is not None:
                s.nonce_seen.setdefault(nonce, time.monotonic())
        exc = res.exc
        if res.kind == "timeout":
            self.violation(f"get_and_update_features missed its {o.op_deadline} s deadline")
            self.done(msg, "timeout")
        elif res.kind == "cancelled":
            s.uncertain += 1
            self.done(msg, f"cancelled_{mode}")
        elif res.kind == "ok":
            counts = self.verify(feats, res.value, nonce)
            for _h, ref, _d, _n in feats:
                if ref is not None and ref.seq > s.acked_seq.get(ref.nonce, 0):
                    s.acked_seq[ref.nonce] = ref.seq
            self.done(msg, "ok", **counts, closed_read_ok=closing)
        elif isinstance(exc, CacheMissError):
            counts = (
                self.verify(feats, exc.features, nonce, allow_missing=True)
                if exc.features is not None
                else {}
            )
            stale = self.stale_indices(feats, exc.features)
            why, unexplained = await self.classify(feats, stale, t0, unowed, str(msg["d"]))
            causes = {f"stale_explained_{k}": v for k, v in why.items()}
            e = {"CacheMissError (stale genuine refs)": len(stale)}
            self.done(msg, "miss", e, **counts, stale_explained=why.total(), **causes)
            for text in unexplained:
                self.violation(text)
        else:
            s.uncertain += 1  # part of the request may have been read and acknowledged
            if isinstance(exc, ClosedCacheError) and rx is self.closed_rx:
                # the close-read fault closed this cache under the read (or beside it): typed
                self.done(msg, "closed_during_read" if closing else "closed_beside_read")
            elif isinstance(exc, ReaderEvictedError):
                self.need_reattach = True
                self.done(msg, "ReaderEvictedError", {"ReaderEvictedError": 1})
            elif isinstance(exc, WriterGoneError):
                self.gone = self.group is None  # a group reader goes on with the other shards
                self.done(msg, "WriterGoneError", {"WriterGoneError": 1})
            else:
                self.violation(f"genuine request {msg['rid']} (g{msg['gen']}) raised {exc!r}")
                self.done(msg, f"unexpected_{type(exc).__name__}")

    def verify(
        self, feats: list[Feature], out: Any, nonce: int | None, *, allow_missing: bool = False
    ) -> dict[str, int]:
        """Check every item read against its digest: the counters (a wrong one is a violation);
        each item read was acknowledged, counted for the session."""
        if not isinstance(out, list) or len(out) != len(feats):
            out = [f"receiver returned {type(out).__name__} for {len(feats)} features"]
        ok = nbytes = bad = 0
        for (h, ref, digest, n), f in zip(feats, out):
            if not isinstance(f, FeatureSpec) or f.mm_hash != h:
                err: str | None = f if isinstance(f, str) else f"receiver returned {f!r} for {h}"
            elif ref is None:
                kind = type(f.data).__name__
                err = None if f.data is None else f"{h}: inline placeholder came back as {kind}"
            elif f.data is None and allow_missing:
                continue
            elif err := verify_item(f.data, h, digest, n):
                err = f"WRONG DATA: {err}"
            else:
                ok, nbytes = ok + 1, nbytes + n
            if err is not None:
                self.violation(err)
                bad += 1
        self.s.reads[nonce] += ok + bad
        return {"items_verified": ok, "bytes_verified": nbytes, "items_wrong": bad}

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
        self, feats: list[Feature], stale: list[int], t0: float, maybe_unowed: bool, delivery: str
    ) -> tuple[Counter[str], list[str]]:
        """Why stale genuine references are explained (by cause); the others, described.

        A stale genuine reference means the writer reclaimed a hand-out before this reader
        acknowledged it. One-of-N: explained only past ``handout_ttl``. Broadcast: if the
        hand-out may predate the session, if the session acknowledged the same chunk through
        such an unowed hand-out, if it lapsed by the ledger's lost-hand-out rule (older than
        ``handout_ttl`` while a later hand-out of the writer was acknowledged: a delivery
        delayed that long), or if the reader was revoked.
        """
        now, s = time.monotonic(), self.s
        explained: Counter[str] = Counter()
        todo: list[int] = []
        lapsed = now - t0 > self.opts.handout_ttl - 0.05
        for i in stale:
            ref = feats[i][1]
            if delivery == "one_of_n":
                cause = "ttl" if lapsed else None
            elif maybe_unowed:
                cause = "before_attach"
            elif ref is not None and (ref.nonce, ref.id) in s.unowed:
                cause = "unowed_ack"
            elif ref is not None and lapsed and ref.seq < s.acked_seq.get(ref.nonce, 0):
                cause = "lapsed"
            else:
                cause = None
            if cause is None:
                todo.append(i)
            else:
                explained[cause] += 1
        if todo and delivery != "one_of_n" and self.rx is not None:
            # revoked? Asked with the stale references themselves: a group reader is revoked per
            # shard, and only a request routed to that shard raises it (a stale reference is
            # read around again and owes nothing: it is not acknowledged)
            try:
                await self.rx.get_and_update_features(
                    [FeatureSpec(feats[i][0], feats[i][1]) for i in todo]
                )
            except ReaderEvictedError:
                self.need_reattach = True
                explained["revoked"] += len(todo)
                return explained, []
            except ShmCacheError:
                pass
        return explained, [
            f"{feats[i][0]} (chunk {ref.id if (ref := feats[i][1]) else '?'}, {delivery}, "
            f"g{self.gen}) was reclaimed {now - t0:.2f} s after its hand-out, before this reader "
            "acknowledged it"
            for i in todo
        ]

    async def read_probe(self, msg: dict[str, Any]) -> None:
        """A forged or stale reference must be refused with one of the expected typed errors."""
        rx, kind, via = self.rx, msg["kind"], msg["via"]
        ref, h, expect = msg["ref"], str(msg["h"]), list(msg["expect"])
        if rx is None or self.stale_gen(msg):
            r = "skip"
        else:
            call = functools.partial(rx.get_and_update_features, [FeatureSpec(h, ref)])
            if via == "item":
                call = functools.partial(rx.get_and_update_item, ref, h)
            res = await guarded(call, mode="none", deadline=self.opts.op_deadline, rng=self.rng)
            r = type(res.exc).__name__ if res.exc else {"ok": "DATA"}.get(res.kind, res.kind)
            if r == "timeout":
                self.violation(f"probe {kind} missed its deadline")
            elif r == "DATA":
                self.violation(
                    f"FORGED/STALE reference ({kind}, via {via}) returned data instead of one "
                    f"of {expect}: {ref}"
                )
            elif r in expect:
                pass
            elif isinstance(res.exc, ClosedCacheError) and rx is self.closed_rx:
                r = "closed_beside_read"  # the close-read fault closed it meanwhile
            elif isinstance(res.exc, ReaderEvictedError):
                self.need_reattach = True
            elif isinstance(res.exc, WriterGoneError):
                self.gone = self.group is None
            else:
                self.violation(f"probe {kind} (via {via}) raised {res.exc!r}, expected {expect}")
        self.send("count", p={f"{kind}:{r}": 1, "answered": 1, "skipped": int(r == "skip")})

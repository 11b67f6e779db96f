"""The reader process: attaches to each writer generation in turn and verifies every array.

Every genuine reference must return exactly the item written for its hash (crc32 over every
array) or a typed error that something explains. A reader attached to a writer that died must
see ``WriterGoneError`` within 1 s of the death. ``close-read``: a worker thread closes the
reader's cache (the sync ``close``) 0 to 2 ms into a read; the read must end with verified bytes
or a typed error, then the reader attaches again (a new session).
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

DEAD_WRITER_BOUND: Final = 1.0  # a reader learns of a dead writer within 1 s (docs/design.md)
Msg = dict[str, Any]


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
        super().__init__(opts, link, token, seed)
        self.who = f"reader {token}"
        self.rx: AsyncReceiverCache | None = None
        self.closed_rx: AsyncReceiverCache | None = None  # the cache close-read closed
        self.handle: Msg | None = None
        self.group: str | None = None  # --group: the cache group this reader is attached to
        self.gone = self.need_reattach = False  # gone: the current generation's writer is
        self.s, self.gen, self.sabotage_seen = Session(), 0, 0
        self.sem, self.tasks = asyncio.Semaphore(opts.reader_concurrency), set[asyncio.Task[None]]()

    async def run(self) -> None:
        self.send("hello", token=self.token)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.heartbeat)
            try:
                await self.serve()
            finally:
                await self.wait_idle()
                await self.detach()
                tg.cancel_scope.cancel()

    async def wait_idle(self) -> None:
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=self.opts.op_deadline * 2)

    def err(self, kind: str, where: str, text: str = "") -> None:
        """A typed error outside a request (counted by the parent)."""
        self.send("count", e={f"{kind} ({where})": 1}, gen=self.gen, text=text)

    def done(self, msg: Msg, result: str, e: dict[str, int] | None = None, /, **c: int) -> None:
        """A request is settled: its outcome and counters."""
        c = {k: v for k, v in dict(c, reads=1, **{f"read_{result}": 1}).items() if v}
        self.send("done", rid=msg["rid"], gen=msg["gen"], c=c, e=e or {})

    # --- the parent's messages -------------------------------------------------------------
    async def maybe_reattach(self) -> None:
        if self.need_reattach:
            await self.wait_idle()
            self.need_reattach = False
            why = "close-read" if self.rx is not None and self.rx is self.closed_rx else "revoked"
            await self.detach()
            await self.attach()
            self.err("reattach", why)

    async def on_req(self, msg: Msg) -> None:
        await self.maybe_reattach()
        if "drop" in self.opts.sabotage and self.drop_this(msg):
            # self-test: a reader that silently loses requests (it tells the parent, which keeps
            # the run going until some were dropped)
            return self.done(msg, "ok", sabotage_dropped=1)
        await self.sem.acquire()
        task = asyncio.ensure_future(self.run_one(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def on_group(self, msg: Msg) -> None:
        """--group: attach to the whole group, once."""
        if self.group is None:
            self.group = str(msg["group"])
            await self.attach()

    async def on_sync(self, msg: Msg) -> Msg:
        """The parent compares ``reads`` with the acknowledgements our slot (found by pid) holds."""
        await self.maybe_reattach()
        await self.wait_idle()
        s = self.s
        return {
            "gen": self.gen,
            "attached": self.rx is not None and not self.gone,
            "pid": os.getpid(),
            "reads": sum(s.reads.values()),
            "reads_by_nonce": [[n, c] for n, c in s.reads.items() if n is not None],
            "uncertain": s.uncertain,
        }

    def drop_this(self, msg: Msg) -> bool:
        """Sabotage: drop every SABOTAGE_EVERY-th request that holds a reference."""
        if self.rx is None or self.stale_gen(msg):
            return False
        if all(ref is None for _h, ref, _d, _n in request_features(msg)):
            return False
        self.sabotage_seen += 1
        return self.sabotage_seen % SABOTAGE_EVERY == 0

    async def run_one(self, msg: Msg) -> None:
        try:
            await self.read_request(msg)
        except Exception as exc:
            self.violation(f"reader harness error: {exc!r}\n{traceback.format_exc()}")
        finally:
            self.sem.release()

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
                await rx.__aenter__()  # attach (the object is entered, closed by aclose)
        except (WriterGoneError, SegmentNotFoundError) as exc:
            return self.err(type(exc).__name__, "attach", str(exc))
        except TimeoutError:
            return self.violation("attach missed its deadline")
        except ShmCacheError as exc:
            return self.violation(f"attach to g{self.gen} raised {exc!r}")
        self.rx, self.gone, self.s = rx, False, Session()

    async def on_handle(self, msg: Msg) -> None:
        """A new writer generation: the old one, if it died, must be seen gone within 1 s."""
        await self.wait_idle()
        if int(msg["gen"]) == self.gen:
            return  # already have it (sent on hello and again with the generation change)
        rx, prev = self.rx, msg.get("prev")
        if rx is not None and not self.gone and prev is not None and rx is not self.closed_rx:
            while True:
                t_call = time.monotonic()
                try:
                    await rx.get_and_update_features([])
                except WriterGoneError:
                    self.err("WriterGoneError", "switch")
                    break
                except ReaderEvictedError:
                    break
                if (late := t_call - float(prev["dead_at"])) > DEAD_WRITER_BOUND:
                    self.violation(f"writer g{self.gen} died {late:.2f} s ago, still not seen gone")
                    break
                await asyncio.sleep(0.05)
        await self.detach()
        self.gen, self.handle, self.need_reattach = int(msg["gen"]), msg["handle"], False
        await self.attach()

    # --- reads ---------------------------------------------------------------------------------
    def stale_gen(self, msg: Msg) -> bool:
        """Not for the writer generation we read (a group reader reads every generation)."""
        return self.group is None and (self.gone or int(msg["gen"]) != self.gen)

    async def read_request(self, msg: Msg) -> None:
        rx, s, o = self.rx, self.s, self.opts
        if rx is None or self.stale_gen(msg):
            return self.done(msg, "skip")
        t0, feats = float(msg["t0"]), request_features(msg)
        refs = [ref for _h, ref, _d, _n in feats if ref is not None]
        nonce = refs[0].nonce if refs else None  # a request holds the references of one shard
        # hand-outs made before this session (or, in a group, before its first read of the
        # shard, which attaches it) may not be owed to it
        seen = s.nonce_seen.get(nonce, time.monotonic()) if nonce is not None else 0.0
        unowed = t0 < s.attached_at or (self.group is not None and nonce is not None and t0 < seen)
        if unowed:
            s.unowed.update((ref.nonce, ref.id) for ref in refs)
        # both forms of a reference the receiver accepts
        specs = [
            FeatureSpec(h, r if r is None or self.rng.random() < 0.5 else r.to_dict())
            for h, r, _d, _n in feats
        ]
        mode, delay = self.cancel_mode(), 0.0
        closing = "close-read" in o.faults and rx is not self.closed_rx
        if closing := closing and self.rng.random() < o.close_read_prob:
            # close-read (see the module docstring); the next message reattaches
            mode, self.closed_rx, self.need_reattach = "none", rx, True
            delay = self.rng.choice((0.0, self.rng.uniform(0, 0.0002), self.rng.uniform(0, 0.002)))
        call = functools.partial(rx.get_and_update_features, specs)
        try:
            async with anyio.create_task_group() as tg:
                if closing:
                    close = functools.partial(close_after, rx.receiver, delay)
                    tg.start_soon(anyio.to_thread.run_sync, close)
                res = await guarded(call, mode=mode, deadline=o.op_deadline, rng=self.rng)
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
            for ref in refs:
                s.acked_seq[ref.nonce] = max(ref.seq, s.acked_seq.get(ref.nonce, 0))
            self.done(msg, "ok", **counts, closed_read_ok=closing)
        elif isinstance(exc, CacheMissError):
            partial = exc.features
            counts = {} if partial is None else self.verify(feats, partial, nonce, partial=True)
            stale = self.stale_indices(feats, partial)
            why, unexplained = await self.classify(feats, stale, t0, unowed, str(msg["d"]))
            causes = {f"stale_explained_{k}": v for k, v in why.items()}
            e = {"CacheMissError (stale genuine refs)": len(stale)}
            self.done(msg, "miss", e, **counts, stale_explained=why.total(), **causes)
            for text in unexplained:
                self.violation(text)
        else:
            s.uncertain += 1  # part of the request may have been read and acknowledged
            kind = type(exc).__name__
            if isinstance(exc, ClosedCacheError) and rx is self.closed_rx:
                # the close-read fault closed this cache: under this very read, or another one
                self.done(msg, "closed_during_read" if closing else "closed_beside_read")
            elif isinstance(exc, ReaderEvictedError):
                self.need_reattach = True
                self.done(msg, kind, {kind: 1})
            elif isinstance(exc, WriterGoneError):
                self.gone = self.group is None  # a group reader goes on with the other shards
                self.done(msg, kind, {kind: 1})
            else:
                self.violation(f"genuine request {msg['rid']} (g{msg['gen']}) raised {exc!r}")
                self.done(msg, f"unexpected_{kind}")

    def verify(
        self, feats: list[Feature], out: Any, nonce: int | None, *, partial: bool = False
    ) -> dict[str, int]:
        """Check every item read against its digest (a wrong one is a violation); each item
        read was acknowledged: counted for the session."""
        if not isinstance(out, list) or len(out) != len(feats):
            out = [f"receiver returned {type(out).__name__} for {len(feats)} features"]
        ok = nbytes = bad = 0
        for (h, ref, digest, n), f in zip(feats, out):
            if not isinstance(f, FeatureSpec) or f.mm_hash != h:
                err: str | None = f if isinstance(f, str) else f"receiver returned {f!r} for {h}"
            elif ref is None:
                kind = type(f.data).__name__
                err = None if f.data is None else f"{h}: inline placeholder came back as {kind}"
            elif f.data is None and partial:
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
        """The genuine references a CacheMissError's partial result ``out`` read around."""
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
                await self.rx.get_and_update_features([FeatureSpec(*feats[i][:2]) for i in todo])
            except ReaderEvictedError:
                self.need_reattach = True
                explained["revoked"] += len(todo)
                return explained, []
            except ShmCacheError:
                pass
        return explained, [
            f"{feats[i][0]} (chunk {getattr(feats[i][1], 'id', '?')}, {delivery}, g{self.gen}) "
            f"was reclaimed {now - t0:.2f} s after its hand-out, before this reader acknowledged it"
            for i in todo
        ]

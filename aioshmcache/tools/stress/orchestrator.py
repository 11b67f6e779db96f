"""The parent: starts and replaces the children, routes their messages, and checks the end state.

The parent forwards each request to its readers (all of them in broadcast, one in one-of-N) and
returns one credit to the writer when every target has reported it (a killed or stopped target
is written off), so the writer runs at most ``--window`` requests ahead. A watchdog calls a child
silent for ``--hang-timeout`` a hang. At the end (and before each planned rotation) the run
quiesces: faults stop, the writer stops issuing requests, every reader reports every request and
syncs, then the writer checks that the cache drains (:meth:`Orchestrator.quiesce_and_check`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from typing import Any, Final

import anyio

from aioshmcache import sweep

from ..framing import Link, pack
from ..progress import Progress
from ..shm import SEGMENT_PREFIX, SHM_DIR, files_with_prefix, remove, segment_files
from .children import Child, child_pids, open_log
from .faults import Faults
from .flow import Owed
from .forking import process_start
from .options import StressOptions
from .protocol import (
    FORK_SLOT_BOUND,
    MAX_FRAME,
    SABOTAGE_GRACE,
    SABOTAGE_MIN_SEEN,
    request_features,
    sock_path,
)
from .report import Tally, as_json, progress_line, summary

__all__ = ["IN_PRIVATE_SHM", "Child", "Orchestrator"]

IN_PRIVATE_SHM: Final = "AIOSHM_STRESS_PRIVATE_SHM"  # set inside the private /dev/shm namespace


class Orchestrator:
    def __init__(self, opts: StressOptions) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.run_id = secrets.token_hex(4)
        self.prefix = f"{SEGMENT_PREFIX}stress-{self.run_id}-"
        self.tmp = tempfile.mkdtemp(prefix="aioshm-stress-")
        # an abstract Unix socket (Linux): no file to clean up, no path length limit
        self.sock = f"@aioshm-stress-{self.run_id}-{os.getpid()}"
        self.tally = Tally()
        self.children: dict[str, Child] = {}
        self.readers: list[Child | None] = [None] * opts.readers
        # --group N: N writer processes, each the writer of its own shard of this group
        self.group = f"stress-{self.run_id}-grp" if opts.group else None
        self.writers: list[Child | None] = [None] * max(1, opts.group)
        self.writer_gen = 0
        self.owed = Owed(self.credit)
        self.old_refs: deque[dict[str, Any]] = deque(maxlen=64)
        self.forked: list[tuple[int, int, float]] = []  # fork fault: pid, start, exit deadline
        self.cur_refs: deque[dict[str, Any]] = deque(maxlen=64)
        self.topology = asyncio.Lock()
        self.faults = Faults(self)
        self.t_start = 0.0
        self.run_elapsed = 0.0
        self.inst = 0
        self.server: asyncio.AbstractServer | None = None
        self.phase = "start"
        self.interrupted = False

    # --- bookkeeping ----------------------------------------------------------------------
    def violation(self, who: str, text: str) -> None:
        self.tally.violations.add(who, text)

    def delivery_for(self, gen: int) -> str:
        d = self.opts.delivery
        if d == "alternate":
            return "broadcast" if gen % 2 else "one_of_n"
        return d

    def done_running(self) -> bool:
        return self.phase != "run"

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    @property
    def writer(self) -> Child | None:
        """The writer (with ``--group``: the first one)."""
        return self.writers[0]

    def live_writers(self) -> list[Child]:
        return [w for w in self.writers if w is not None and not w.eof.is_set()]

    def writer_of(self, gen: int) -> Child | None:
        """The live writer of generation ``gen``, if any."""
        for w in self.writers:
            if w is not None and w.gen == gen and not w.eof.is_set():
                return w
        return None

    @staticmethod
    def nonce_of(w: Child) -> int | None:
        """The nonce of the segment (shard) this writer opened."""
        if w.handle_msg is None:
            return None
        return int(w.handle_msg["handle"]["nonce"])

    def take_refs(self, w: Child) -> None:
        """The recent references of writer ``w`` become old ones (probed after its death)."""
        nonce = self.nonce_of(w)
        mine = [r for r in self.cur_refs if self.group is None or r.get("nonce") == nonce]
        self.old_refs.extend(mine)
        kept = [r for r in self.cur_refs if r not in mine]
        self.cur_refs.clear()
        self.cur_refs.extend(kept)

    def live_readers(self) -> list[Child]:
        return [
            c for c in self.readers if c is not None and c.link is not None and not c.eof.is_set()
        ]

    # --- processes ------------------------------------------------------------------------
    async def spawn(self, role: str, spec: dict[str, Any]) -> Child:
        self.inst += 1
        token = f"{role[0]}{self.inst}"
        spec["opts"] = self.opts.child_dict()
        log_path = os.path.join(self.tmp, f"{token}.log")
        with open_log(log_path) as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "aioshmcache.tools.stress",
                role,
                self.sock,
                token,
                json.dumps(spec),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        child = Child(role, token, proc, log_path)
        child.last_hb = time.monotonic()
        self.children[token] = child
        return child

    async def wait_connected(self, child: Child, within: float = 30.0) -> bool:
        with anyio.move_on_after(within):
            await child.connected.wait()
            return True
        self.violation(child.token, f"{child.role} process did not connect within {within} s")
        await self.hard_kill(child)
        return False

    async def hard_kill(self, child: Child) -> None:
        if not await child.kill(wait_link=False):
            self.violation(child.token, "a SIGKILLed process did not exit within 10 s")

    async def start_writer(self, prev: dict[str, Any] | None, pos: int = 0) -> bool:
        self.writer_gen += 1
        gen = self.writer_gen
        name = self.group if self.group is not None else f"{self.prefix}g{gen}"
        delivery = self.delivery_for(gen)
        child = await self.spawn("writer", {"gen": gen, "name": name, "delivery": delivery})
        child.gen, child.name, child.pos = gen, name, pos
        self.writers[pos] = child
        if not await self.wait_connected(child):
            return False
        with anyio.move_on_after(30):
            await child.got_handle.wait()
        if child.handle_msg is None:
            self.violation(child.token, "writer did not publish its handle within 30 s")
            await self.hard_kill(child)
            return False
        self.tally.stats[f"writer_gens_{delivery}"] += 1
        if self.group is not None:  # readers find the shard themselves
            child.name = str(child.handle_msg["name"])
            return True
        msg = dict(child.handle_msg)
        msg["prev"] = prev
        frame = pack(msg, max_frame=MAX_FRAME)
        for r in self.live_readers():
            r.send_raw(frame)
        return True

    async def start_reader(self, pos: int) -> None:
        child = await self.spawn("reader", {"seed": self.rng.randrange(1 << 30)})
        child.pos = pos
        if await self.wait_connected(child):
            self.tally.stats["readers_started"] += 1

    def register(self, child: Child) -> None:
        """A reader said hello: it receives every request from now on (then the handle)."""
        if child.role == "reader":
            self.readers[child.pos] = child
            if self.group is not None:
                child.send({"t": "group", "group": self.group})
                return
            w = self.writer
            if w is not None and w.handle_msg is not None and not w.eof.is_set():
                child.send(dict(w.handle_msg, prev=None))

    # --- the socket server ------------------------------------------------------------------
    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(reader, writer, max_frame=MAX_FRAME)
        child: Child | None = None
        try:
            hello = await link.recv()
            if (
                hello is None
                or hello.get("t") != "hello"
                or hello.get("token") not in self.children
            ):
                await link.close()
                return
            child = self.children[str(hello["token"])]
            child.link = link
            child.last_hb = time.monotonic()
            self.register(child)
            child.connected.set()
            while True:
                got = await link.recv_raw()
                if got is None:
                    break
                msg, raw = got
                child.last_hb = time.monotonic()
                if child.role == "writer":
                    self.on_writer(child, msg, raw)
                else:
                    self.on_reader(child, msg)
        except Exception as exc:
            who = child.token if child is not None else "?"
            self.violation(who, f"harness: bad frame from child: {exc!r}")
        finally:
            if child is not None:
                child.eof.set()
                if child.role == "reader":
                    self.write_off(child.token)
                for fut in child.replies.values():
                    if not fut.done():
                        fut.set_result({"t": "eof"})
            await link.close()

    def on_writer(self, w: Child, msg: dict[str, Any], raw: bytes) -> None:
        kind = msg["t"]
        if kind == "req":
            self.forward(w, msg, raw)
        elif kind == "probe":
            targets = self.live_readers()
            if targets:
                self.rng.choice(targets).send_raw(raw)
                self.tally.probes["sent"] += 1
        elif kind == "hb":
            w.stats = msg["stats"]
            self.tally.writer_stats[w.gen] = w.stats
        elif kind == "handle":
            w.handle_msg = msg
            w.got_handle.set()
        elif kind in ("stopped", "final", "forked", "slots"):
            if "stats" in msg:
                w.stats = msg["stats"]
                self.tally.writer_stats[w.gen] = w.stats
            fut = w.replies.get(kind)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif kind == "violation":
            self.violation(str(msg["who"]), str(msg["text"]))

    def forward(self, w: Child, msg: dict[str, Any], raw: bytes) -> None:
        gen, rid = int(msg["gen"]), int(msg["rid"])
        self.tally.stats["requests"] += 1
        feats = request_features(msg)
        self.tally.stats["features"] += len(feats)
        for _h, ref, _digest, _n in feats:
            if ref is not None:
                self.cur_refs.append(ref.to_dict())
        readers = self.live_readers()
        if self.delivery_for(gen) == "one_of_n" and readers:
            readers = [self.rng.choice(readers)]
        for r in readers:
            r.send_raw(raw)
            self.tally.stats["deliveries"] += 1
        self.owed.expect((gen, rid), [r.token for r in readers if not r.stopped])

    def credit(self, gen: int) -> None:
        w = self.writer_of(gen)
        if w is not None:
            w.send({"t": "credit", "n": 1})

    def write_off(self, token: str) -> None:
        self.owed.write_off(token)

    def on_reader(self, r: Child, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "done":
            res = str(msg["r"])
            self.tally.stats["reads"] += 1
            self.tally.stats[f"read_{res}"] += 1
            self.tally.stats["items_verified"] += int(msg.get("n", 0))
            self.tally.stats["bytes_verified"] += int(msg.get("b", 0))
            self.tally.stats["items_wrong"] += int(msg.get("bad", 0))
            self.tally.stats["sabotage_dropped"] += int(msg.get("dropped", 0))
            self.tally.stats["closed_read_ok"] += int(msg.get("closing", 0))
            if res == "miss":
                self.tally.errors["CacheMissError (stale genuine refs)"] += int(msg.get("stale", 0))
                for why, n in dict(msg.get("why", {})).items():
                    self.tally.stats["stale_explained"] += int(n)
                    self.tally.stats[f"stale_explained_{why}"] += int(n)
            elif res in ("ReaderEvictedError", "WriterGoneError"):
                self.tally.errors[res] += 1
                if res == "WriterGoneError":
                    self.tally.wgone_gens.add(int(msg["gen"]))
            self.owed.reported(r.token, (int(msg["gen"]), int(msg["rid"])))
        elif kind == "probe_done":
            res = str(msg["r"])
            self.tally.probes[f"{msg['kind']}:{res}"] += 1
            self.tally.probes["answered"] += 1
            if res == "skip":
                self.tally.probes["skipped"] += 1
        elif kind == "err":
            self.tally.errors[f"{msg['kind']} ({msg['where']})"] += 1
            if msg.get("text"):
                self.tally.err_texts[f"{msg['kind']} ({msg['where']})"] = str(msg["text"])
            w = self.writer_of(int(msg["gen"]))
            if (
                msg["kind"] == "SegmentNotFoundError"
                and w is not None
                and w.proc.returncode is None
                and not w.killed_by_us
                and not segment_files(w.name)
            ):
                self.violation(
                    "environment",
                    f"the live writer's segment {w.name} was unlinked by another process "
                    "(someone's /dev/shm cleanup or a buggy sweep); rerun with --private-shm",
                )
            if msg["kind"] == "WriterGoneError":
                self.tally.wgone_gens.add(int(msg["gen"]))
        elif kind == "attached":
            r.attached_gen = int(msg["gen"])
        elif kind == "hb":
            r.stats = msg
        elif kind == "forked":
            fut = r.replies.get(kind)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif kind == "synced":
            fut = r.replies.get(str(msg["token"]))
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif kind == "violation":
            self.violation(str(msg["who"]), str(msg["text"]))

    async def ask(
        self, child: Child, msg: dict[str, Any], reply: str, within: float
    ) -> dict[str, Any] | None:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        child.replies[reply] = fut
        child.send(msg)
        try:
            with anyio.move_on_after(within):
                got = await fut
                return None if got.get("t") == "eof" else got
            return None
        finally:
            child.replies.pop(reply, None)

    async def fork_child(self, c: Child) -> bool:
        """Ask ``c`` to fork a child that outlives it (the fork fault); True if it did."""
        got = await self.ask(c, {"t": "fork", "linger": self.opts.fork_linger}, "forked", 10.0)
        if got is None:
            return False
        pid = int(got["pid"])
        start = process_start(pid)
        if start is not None:
            self.forked.append((pid, start, time.monotonic() + self.opts.fork_linger))
        self.tally.stats["forks"] += 1
        return True

    async def check_slot_dropped(self, pid: int) -> None:
        """A SIGKILLed reader's slot is dead to the writer although its forked child lives."""
        t0 = time.monotonic()
        while True:
            held: list[dict[str, Any]] = []
            for w in self.live_writers():  # with --group: its slot in every shard
                got = await self.ask(w, {"t": "slots"}, "slots", 10.0)
                if got is not None:
                    held += [
                        s for s in got["slots"] if s["attached"] and s["alive"] and s["pid"] == pid
                    ]
            if not held:
                self.tally.stats["fork_slots_dropped"] += 1
                return
            if time.monotonic() - t0 > FORK_SLOT_BOUND:
                self.violation(
                    "fork",
                    f"reader {pid} was SIGKILLed after forking, and its slot {held[0]['slot']} "
                    f"still looks alive {time.monotonic() - t0:.1f} s later (its forked child "
                    "keeps it alive: its debts are never dropped)",
                )
                return
            await asyncio.sleep(0.1)

    async def reap_forked(self) -> None:
        """Every forked child exits once its linger is over (or is killed, as a violation)."""
        for pid, start, exit_by in self.forked:
            # not our child (its parent was killed): polled, no process handle to wait on
            while not self.interrupted and time.monotonic() < exit_by + 30:
                if process_start(pid) != start:
                    break
                await asyncio.sleep(0.1)
            if process_start(pid) == start:
                if not self.interrupted:
                    self.violation("fork", f"forked child {pid} did not exit after its linger")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.forked.clear()

    async def kill_writer(self, *, fork: bool = False) -> None:
        """SIGKILL the writer (with ``--group``: one of them) and start its replacement."""
        async with self.topology:
            live = self.live_writers()
            if not live:
                return
            w = self.rng.choice(live)
            forked = fork and await self.fork_child(w)
            await w.kill(wait_link=True)
            dead_at = time.monotonic()
            self.tally.stats["writer_kills"] += 1
            if forked:
                self.tally.stats["fork_kills_writer"] += 1
            self.tally.dead_gens[w.gen] = "killed"
            self.owed.forget_generation(w.gen)
            self.take_refs(w)
            if self.group is None:
                self.sweep_dead(w)
            prev = {"gen": w.gen, "dead_at": dead_at, "how": "killed"}
            started = await self.start_writer(prev, w.pos)
            if started and self.group is not None:
                self.check_reclaimed(w)
            if "forge" in self.opts.faults:
                self.probe_old_refs()

    def sweep_dead(self, w: Child) -> None:
        """The dead writer's segment must be an orphan to ``sweep``, which removes our run's
        orphans only (``prefix``): other programs' segments are never touched."""
        mine = sweep(prefix=self.prefix)
        if w.name not in mine:
            if w.name in segment_files(w.name):
                self.violation("sweep", f"sweep does not list the dead writer's segment {w.name}")
            else:  # another process on this machine ran sweep() first: fine
                self.tally.stats["swept_by_others"] += 1
        self.tally.stats["swept"] += len(mine)
        left = segment_files(w.name)
        if left:
            self.violation("sweep", f"left after sweeping the dead writer: {left}")

    def check_reclaimed(self, dead: Child) -> None:
        """--group: the dead writer's shard is reclaimed by its replacement (the lowest free
        index is the dead one's, unless another shard closed meanwhile: then it is left for the
        next writer, and the end-of-run check finds it if nobody reclaims it)."""
        new = self.writers[dead.pos]
        if new is not None and new.name == dead.name:
            self.tally.stats["shards_reclaimed"] += 1

    def probe_old_refs(self) -> None:
        """References of a dead writer, shown to the new one: InvalidReferenceError (nonce);
        a group reader may still remember the dead shard's nonce: WriterGoneError."""
        w = self.writer
        if w is None:
            return
        expect = ["InvalidReferenceError"]
        if self.group is not None:
            expect.append("WriterGoneError")
        readers = self.live_readers()
        for ref in list(self.old_refs)[-8:]:
            if not readers:
                break
            self.rng.choice(readers).send(
                {
                    "t": "probe",
                    "gen": w.gen,
                    "kind": "old_writer",
                    "via": "features",
                    "h": "old",
                    "ref": ref,
                    "expect": expect,
                }
            )
            self.tally.probes["sent"] += 1
        self.old_refs.clear()

    # --- watchdog and progress --------------------------------------------------------------
    async def watchdog(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for c in list(self.children.values()):
                if c.eof.is_set() or c.stopped or c.killed_by_us or c.link is None:
                    continue
                if c.proc.returncode is not None:
                    continue
                if now - c.last_hb > self.opts.hang_timeout:
                    self.violation(
                        c.token, f"{c.role} pid {c.pid} silent for {now - c.last_hb:.1f} s (hang)"
                    )
                    c.last_hb = now
                    await self.hard_kill(c)
            for c in list(self.children.values()):
                rc = c.proc.returncode
                if rc is not None and not c.killed_by_us and not c.rc_seen:
                    c.rc_seen = True
                    if rc != 0 and self.phase != "exit":
                        self.violation(c.token, f"{c.role} exited with {rc}: {c.log_tail()}")

    async def progress(self) -> None:
        """A progress line every second on stderr (not with ``--quiet``)."""
        show = Progress(enabled=not self.opts.quiet)
        while True:
            await asyncio.sleep(1.0)
            gen = self.writer_gen
            show(
                progress_line(
                    self.opts,
                    self.tally,
                    elapsed=self.elapsed(),
                    gen=gen,
                    delivery=self.delivery_for(gen),
                    readers=len(self.live_readers()),
                )
            )

    # --- quiescence and checks --------------------------------------------------------------
    async def ensure_readers(self) -> None:
        for pos, c in enumerate(self.readers):
            if c is None or c.eof.is_set():
                await self.start_reader(pos)

    async def quiesce_and_check(self, why: str) -> None:
        """No faults, writers stopped, every request read, then the drain check (per shard)."""
        writers = self.live_writers()
        if not writers:
            return
        await self.ensure_readers()
        stop = {"t": "stop"}
        stopped = await asyncio.gather(
            *(self.ask(w, stop, "stopped", self.opts.op_deadline + 20) for w in writers)
        )
        for w, got in zip(writers, stopped):
            if got is None:
                self.violation(w.token, f"{why}: the writer did not stop")
                return
        with anyio.move_on_after(60) as sc:
            await self.owed.none.wait()
        if sc.cancelled_caught:
            self.violation("quiesce", f"{why}: {len(self.owed)} requests never reported by readers")
            self.owed.clear()
        synced: dict[str, dict[str, Any]] = {}
        for c in self.live_readers():
            tok = secrets.token_hex(4)
            got = await self.ask(c, {"t": "sync", "token": tok}, tok, 60)
            if got is None:
                self.violation(c.token, f"{why}: reader did not catch up (sync)")
            elif not got.get("attached") or (
                self.group is None and int(got["gen"]) != writers[0].gen
            ):
                self.violation(c.token, f"{why}: reader not attached to its writer at quiescence")
            else:
                synced[c.token] = got
        await asyncio.gather(*(self.drain_check(w, why, synced) for w in writers))

    async def drain_check(self, w: Child, why: str, synced: dict[str, dict[str, Any]]) -> None:
        """Writer ``w``'s cache (its shard) drains: every item freeable, then the ring empty."""
        # lost hand-outs lapse after handout_ttl (one-of-N: always; broadcast: once their reader
        # acknowledged a later one), so the drain check gives them that long (see handout_ttl)
        within = 5.0 + self.opts.handout_ttl
        final = await self.ask(w, {"t": "check", "within": within}, "final", within + 30)
        if final is None:
            self.violation(w.token, f"{why}: the writer did not answer the drain check")
            return
        final["why"] = why if self.group is None else f"{why} g{w.gen}"
        self.tally.finals.append(final)
        self.check_acks(synced, final.get("slots", []), self.nonce_of(w))
        if final.get("n_not_freeable"):
            self.violation(
                w.token,
                f"{why}: cache does not drain: {final['n_not_freeable']} of {final['items']} items "
                f"never freeable (e.g. {final['not_freeable'][:5]}); slots {final['slots']}",
            )
        elif final.get("after_items") or final.get("after_bytes"):
            self.violation(
                w.token,
                f"{why}: after freeing everything the ring still holds {final['after_items']} "
                f"items / {final['after_bytes']} bytes",
            )

    def check_acks(
        self, synced: dict[str, dict[str, Any]], slots: list[dict[str, Any]], nonce: int | None
    ) -> None:
        """Every verified read wrote an acknowledgement into its reader's slot: none was lost.

        More acknowledgements than reads is fine (the references of a failed or cancelled read
        are given back, acknowledged unread, so that they pin nothing; stale ones owe nothing and
        are not acknowledged); fewer would be a lost one.
        """
        for token, got in synced.items():
            acked = [
                int(s["acknowledged"])
                for s in slots
                if s.get("attached") and not s.get("revoked") and s.get("pid") == got.get("pid")
            ]
            reads, uncertain = int(got.get("reads", 0)), int(got.get("uncertain", 0))
            if self.group is not None:  # this shard's reads only
                by_nonce = {int(n): int(c) for n, c in got.get("reads_by_nonce", [])}
                reads = by_nonce.get(nonce, 0) if nonce is not None else 0
            if len(acked) == 1 and acked[0] < reads:
                self.violation(
                    f"reader {token}",
                    f"acknowledgements lost: {reads} references read and verified in this "
                    f"session, but the slot's log holds {acked[0]} acknowledgements"
                    + (f" ({uncertain} uncounted)" if uncertain else ""),
                )

    async def close_writer(self, why: str, w: Child | None) -> float:
        if w is None:
            return time.monotonic()
        w.send({"t": "exit"})
        rc = None
        with anyio.move_on_after(30):
            rc = await w.proc.wait()
        closed_at = time.monotonic()
        if rc is None:
            self.violation(w.token, f"{why}: writer did not exit within 30 s")
            await self.hard_kill(w)
        elif rc != 0:
            self.violation(w.token, f"{why}: writer exited with {rc}: {w.log_tail()}")
        w.killed_by_us = True
        self.tally.dead_gens[w.gen] = "closed"
        left = segment_files(w.name)
        if left:
            self.violation(w.token, f"{why}: aclose left {left} in {SHM_DIR}")
        return closed_at

    async def rotate_writer(self) -> None:
        async with self.topology:
            await self.quiesce_and_check("rotation")
            w = self.writer
            closed_at = await self.close_writer("rotation", w)
            self.tally.stats["writer_rotations"] += 1
            if w is not None:
                self.take_refs(w)
                prev = {"gen": w.gen, "dead_at": closed_at, "how": "closed"}
                await self.start_writer(prev, w.pos)
                if "forge" in self.opts.faults:
                    self.probe_old_refs()

    # --- the run ------------------------------------------------------------------------------
    def interrupt(self, task: asyncio.Task[Any]) -> None:
        """SIGINT / SIGTERM: stop the run, then clean up as usual (a second signal is ignored)."""
        if not self.interrupted:
            self.interrupted = True
            task.cancel()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        if me is not None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self.interrupt, me)
        self.server = await asyncio.start_unix_server(self.serve, path=sock_path(self.sock))
        bg: list[asyncio.Task[None]] = [
            asyncio.ensure_future(self.watchdog()),
            asyncio.ensure_future(self.progress()),
        ]
        faults: list[asyncio.Task[None]] = []
        try:
            self.t_start = time.monotonic()
            started = [await self.start_writer(None, pos) for pos in range(len(self.writers))]
            if all(started):
                await self.body(faults)
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
            self.run_elapsed = self.run_elapsed or self.elapsed()
        finally:
            for t in faults + bg:
                t.cancel()
            await asyncio.gather(*faults, *bg, return_exceptions=True)
            await self.kill_all()
            await self.reap_forked()
            self.server.close()
            with anyio.move_on_after(5):
                await self.server.wait_closed()
        return self.finish()

    async def body(self, faults: list[asyncio.Task[None]]) -> None:
        """Readers up, the main phase with its faults, then the final drain and the exit."""
        await asyncio.gather(*(self.start_reader(i) for i in range(self.opts.readers)))
        self.phase = "run"
        faults.extend(self.faults.start())
        await self.main_phase()
        self.run_elapsed = self.elapsed()
        self.phase = "quiesce"
        self.faults.wake()
        await self.faults.pause()
        for t in faults:
            t.cancel()
        await asyncio.gather(*faults, return_exceptions=True)
        async with self.topology:
            await self.quiesce_and_check("end of run")
        self.phase = "exit"
        await self.shutdown_children()

    async def main_phase(self) -> None:
        o = self.opts
        rotate_at: float | None = None
        rotate_ops: int | None = None
        if o.delivery == "alternate":  # both modes in every run, and a mid-run drain check
            if o.duration:
                rotate_at = o.duration / 2
            elif o.ops:
                rotate_ops = o.ops // 2
        while True:
            await asyncio.sleep(0.05)
            over = None
            if o.duration is not None and self.elapsed() >= o.duration:
                over = self.elapsed() - o.duration
            elif o.ops is not None and self.tally.stats["requests"] >= o.ops:
                over = 0.0
            if over is not None and not self.sabotage_pending(over):
                return
            due = (rotate_at is not None and self.elapsed() >= rotate_at) or (
                rotate_ops is not None and self.tally.stats["requests"] >= rotate_ops
            )
            if due:
                rotate_at = rotate_ops = None
                await self.faults.pause()
                await self.rotate_writer()
                self.faults.resume()

    def sabotage_pending(self, overtime: float) -> bool:
        """The self-test goes on until each sabotage was seen a few times (bounded overtime).

        Count-based, not timed: on a loaded machine a fixed duration may hold too few requests
        for the sabotage to have happened at all.
        """
        if overtime > SABOTAGE_GRACE:
            return False
        st, sab = self.tally.stats, self.opts.sabotage
        if "digest" in sab and st["items_wrong"] < SABOTAGE_MIN_SEEN:
            return True
        return "drop" in sab and st["sabotage_dropped"] < SABOTAGE_MIN_SEEN

    async def shutdown_children(self) -> None:
        for c in self.live_readers():
            c.send({"t": "exit"})
        for c in list(self.children.values()):
            if c.role != "reader" or (c.proc.returncode is not None and c.killed_by_us):
                continue
            rc = None
            with anyio.move_on_after(30):
                rc = await c.proc.wait()
            if rc is None:
                self.violation(c.token, "reader did not exit within 30 s of 'exit'")
                await self.hard_kill(c)
            elif rc != 0 and not c.killed_by_us:
                self.violation(c.token, f"reader exited with {rc}: {c.log_tail()}")
        for w in self.live_writers():
            await self.close_writer("end of run", w)

    async def kill_all(self) -> None:
        for c in self.children.values():
            if c.proc.returncode is None:
                c.killed_by_us = True
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGCONT)
                    c.proc.send_signal(signal.SIGKILL)
        for c in self.children.values():
            with anyio.move_on_after(10):
                await c.proc.wait()

    def leftovers(self) -> list[str]:
        """Our segments and semaphores still in /dev/shm (alone in a private one: any)."""
        return files_with_prefix(SEGMENT_PREFIX if os.environ.get(IN_PRIVATE_SHM) else self.prefix)

    def finish(self) -> int:
        """The end-state checks, the report, and the exit status."""
        left = self.leftovers()
        if left and not self.interrupted:  # an interrupted run killed its writer: orphans
            self.violation("end", f"left in {SHM_DIR}: {left}")
        remove(left)
        kids = child_pids()
        if kids:
            self.violation("end", f"child processes left: {kids}")
        stray = self.tally.wgone_gens - set(self.tally.dead_gens)
        if stray and not self.interrupted:
            self.violation("end", f"WriterGoneError for live writer generations {sorted(stray)}")
        for _gen, how in sorted(self.tally.dead_gens.items()):
            self.tally.stats[f"dead_gen_{how}"] += 1
        report = summary(
            self.opts,
            self.tally,
            elapsed=self.run_elapsed,
            writer_gens=self.writer_gen,
            interrupted=self.interrupted,
        )
        print(report, file=sys.stderr if self.opts.quiet else sys.stdout, flush=True)
        if self.opts.json_path:
            with open(self.opts.json_path, "w") as f:
                out = as_json(self.opts, self.tally, elapsed=self.run_elapsed)
                json.dump(out, f, indent=1, sort_keys=True, default=str)
        failed = len(self.tally.violations) > 0
        if not failed and not self.opts.keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)
        elif failed:
            print(f"children's logs kept in {self.tmp}", file=sys.stderr)
        if self.interrupted:
            return 2
        return 1 if failed else 0

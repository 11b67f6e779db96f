"""The parent: starts and replaces the children, routes their messages, injects the faults of
:data:`PERIODIC` and checks the end state.

Flow control: a request goes to its readers (all in broadcast, one in one-of-N); its credit
returns to the writer once every target reported it (a killed or stopped one is written off).
Quiescence (at the end and before the rotation): faults stop, writers stop, every reader syncs,
then each writer's cache (shard) must drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
from asyncio.subprocess import DEVNULL
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio
import msgpack

from aioshmcache import sweep

from ..framing import Link
from ..progress import Progress
from ..shm import SEGMENT_PREFIX, SHM_DIR, files_with_prefix, name_prefix, remove, segment_files
from .child import MAX_FRAME, SABOTAGE_GRACE, SABOTAGE_MIN_SEEN, request_features, sock_path
from .options import FAULTS, StressOptions
from .report import Tally, as_json, progress_line, summary

IN_PRIVATE_SHM: Final = "AIOSHM_STRESS_PRIVATE_SHM"  # set inside the private /dev/shm namespace
Msg = dict[str, Any]


def child_pids() -> list[int]:
    """Live (non-zombie) processes whose parent is this one (``/proc/PID/stat``: the state and
    the parent's pid follow the name)."""
    me, kids = str(os.getpid()).encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/stat", "rb") as f:
            state, ppid = (stat := f.read())[stat.rfind(b")") + 2 :].split()[:2]
            if state != b"Z" and ppid == me:
                kids.append(int(pid))
    return kids


@dataclasses.dataclass(eq=False)
class Child:
    """A child process as the parent sees it: its link, its state under faults, its questions."""

    role: str
    token: str
    proc: asyncio.subprocess.Process
    log_path: str
    pos: int
    gen: int = 0
    name: str = ""
    handle: Msg | None = None  # a writer's, from its hello
    link: Link | None = None
    connected: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    eof: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    last_hb: float = dataclasses.field(default_factory=time.monotonic)
    stopped: bool = False
    busy: bool = False  # a fault is acting on it
    killed_by_us: bool = False
    rc_seen: bool = False
    replies: dict[str, asyncio.Future[Msg]] = dataclasses.field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.link is not None and not self.eof.is_set()

    def send(self, t: str, **kw: Any) -> None:
        self.send_body(msgpack.packb({"t": t, **kw}))

    def send_body(self, body: bytes) -> None:
        if self.link is not None:
            self.link.send_body(body)

    def send_signals(self, *sigs: int) -> None:
        """Send ``sigs`` in turn (a process already reaped gets none)."""
        with contextlib.suppress(ProcessLookupError):
            for sig in sigs:
                self.proc.send_signal(sig)

    async def kill(self, *, wait_link: bool) -> bool:
        """SIGKILL (SIGCONT first: it may be stopped); True once it is reaped (and its link
        closed) within 10 s."""
        self.killed_by_us = True
        self.send_signals(signal.SIGCONT, signal.SIGKILL)
        with anyio.move_on_after(10):
            await self.proc.wait()
            if wait_link:
                await self.eof.wait()
            return True
        return False

    def log_tail(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            return f.read()[-1200:].decode(errors="replace").strip()
        return ""


async def _kill_readers(o: Orchestrator) -> None:
    if (c := o.pick_reader()) is not None:
        await o.kill_reader(c)


async def _stop_readers(o: Orchestrator) -> None:
    """SIGSTOP a reader for a while (up to twice the eviction delay), then SIGCONT."""
    if (c := o.pick_reader()) is None:
        return
    c.stopped = True
    o.write_off(c.token)
    try:
        c.send_signals(signal.SIGSTOP)
        o.tally.stats["reader_stops"] += 1
        top = min(2 * o.opts.evict_after or 2.0, o.opts.hang_timeout / 3)
        with anyio.move_on_after(o.rng.uniform(0.3, top)):
            await o.pausing.wait()
    finally:
        c.send_signals(signal.SIGCONT)
        c.last_hb, c.stopped, c.busy = time.monotonic(), False, False


#: the faults the parent injects, each a small action run every ``--*-every`` seconds or so
#: (``cancel`` and ``close-read`` act inside the children)
PERIODIC: Final[dict[str, Callable[[Orchestrator], Awaitable[None]]]] = {
    "kill-readers": _kill_readers,
    "stop-readers": _stop_readers,
    "kill-writer": lambda o: o.kill_writer(),
}


class Orchestrator:
    def __init__(self, opts: StressOptions) -> None:
        self.opts, self.rng, self.run_id = opts, random.Random(opts.seed), secrets.token_hex(4)
        self.prefix = f"{SEGMENT_PREFIX}{name_prefix()}stress-{self.run_id}-"
        self.tmp = tempfile.mkdtemp(prefix="aioshm-stress-")
        # an abstract Unix socket (Linux): no file to clean up, no path length limit
        self.sock = f"@aioshm-stress-{self.run_id}-{os.getpid()}"
        self.tally, self.children = Tally(), dict[str, Child]()
        self.readers: list[Child | None] = [None] * opts.readers
        # --group N: N writer processes, each the writer of its own shard of this group
        self.group = f"{name_prefix()}stress-{self.run_id}-grp" if opts.group else None
        self.writers: list[Child | None] = [None] * max(1, opts.group)
        self.writer_gen = self.inst = 0
        self.owed: dict[tuple[int, int], set[str]] = {}  # (gen, rid) -> readers yet to report
        self.topology, self.pausing = asyncio.Lock(), asyncio.Event()
        self.acting, self.held = asyncio.Semaphore(len(PERIODIC)), 0  # one token per fault
        self.faults: list[asyncio.Task[None]] = []
        self.t_start, self.run_elapsed = time.monotonic(), 0.0
        self.phase, self.interrupted = "start", False

    def violation(self, who: str, text: str) -> None:
        self.tally.violations.add(who, text)

    def delivery_for(self, gen: int) -> str:
        if self.opts.delivery == "alternate":
            return "broadcast" if gen % 2 else "one_of_n"
        return self.opts.delivery

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def live_writers(self) -> list[Child]:
        return [w for w in self.writers if w is not None and not w.eof.is_set()]

    def live_readers(self) -> list[Child]:
        return [c for c in self.readers if c is not None and c.live]

    def pick_reader(self) -> Child | None:
        """A reader no fault acts on, now marked busy."""
        if cands := [c for c in self.live_readers() if not c.busy and not c.stopped]:
            (c := self.rng.choice(cands)).busy = True
            return c
        return None

    # --- processes ------------------------------------------------------------------------
    async def spawn(self, role: str, pos: int, **spec: Any) -> Child | None:
        """A new child, once it said hello (a writer: with its handle); None (a violation) if
        it did not within 30 s."""
        self.inst += 1
        token = f"{role[0]}{self.inst}"
        args = (role, self.sock, token, json.dumps(dict(spec, opts=self.opts.child_dict())))
        log_path = os.path.join(self.tmp, f"{token}.log")
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __package__, *args, stdin=DEVNULL, stdout=log, stderr=log
            )
        finally:
            os.close(log)
        child = Child(role, token, proc, log_path, pos, spec.get("gen", 0), spec.get("name", ""))
        self.children[token] = child
        with anyio.move_on_after(30):
            await child.connected.wait()
            return child
        self.violation(token, f"{role} process did not say hello within 30 s")
        await self.hard_kill(child)
        return None

    async def hard_kill(self, child: Child) -> None:
        if not await child.kill(wait_link=False):
            self.violation(child.token, "a SIGKILLed process did not exit within 10 s")

    async def start_writer(self, prev: Msg | None, pos: int = 0) -> bool:
        """Writer generation ``writer_gen + 1``; readers get its handle (``prev``: its
        predecessor, which they must have seen gone within 1 s of ``prev["dead_at"]``)."""
        self.writer_gen += 1
        gen, delivery = self.writer_gen, self.delivery_for(self.writer_gen)
        spec = {"gen": gen, "name": self.group or f"{self.prefix}g{gen}", "delivery": delivery}
        w = self.writers[pos] = await self.spawn("writer", pos, **spec)
        if w is None or w.handle is None:
            return False
        self.tally.stats[f"writer_gens_{delivery}"] += 1
        if self.group is not None:  # a group's readers find the shard themselves
            w.name = w.handle["name"]
        else:
            body = msgpack.packb({"t": "handle", **w.handle, "prev": prev})
            for r in self.live_readers():
                r.send_body(body)
        return True

    async def start_reader(self, pos: int) -> None:
        if await self.spawn("reader", pos, seed=self.rng.randrange(1 << 30)) is not None:
            self.tally.stats["readers_started"] += 1

    async def kill_reader(self, c: Child) -> None:
        """SIGKILL, write off what it owed, start a new reader in its place."""
        await c.kill(wait_link=True)
        self.tally.stats["reader_kills"] += 1
        self.write_off(c.token)
        if self.readers[c.pos] is c:
            self.readers[c.pos] = None
        await self.start_reader(c.pos)

    # --- the channel (see .child): one on_<t> method per message a child sends ---------------
    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link, child = Link(reader, writer, max_frame=MAX_FRAME), None
        try:
            hello = (await link.recv() or ({}, b""))[0]
            if (child := self.children.get(hello.get("token", ""))) is None:
                return await link.close()
            child.link, child.last_hb, child.handle = link, time.monotonic(), hello.get("writer")
            if child.role == "reader":  # it gets every request from now on (then the handle)
                self.readers[child.pos] = child
                if self.group is not None:
                    child.send("group", group=self.group)
                elif (w := self.writers[0]) is not None and w.handle and not w.eof.is_set():
                    child.send("handle", **w.handle, prev=None)
            child.connected.set()
            while (got := await link.recv()) is not None:
                child.last_hb = time.monotonic()
                getattr(self, "on_" + got[0]["t"])(child, *got)
        except Exception as exc:
            self.violation(getattr(child, "token", "?"), f"harness: bad frame from child: {exc!r}")
        finally:
            if child is not None:
                child.eof.set()
                self.write_off(child.token)
                for fut in child.replies.values():
                    if not fut.done():
                        fut.set_result({"t": "eof"})
            await link.close()

    def on_req(self, w: Child, msg: Msg, body: bytes) -> None:
        """A writer's request: forwarded unchanged to its readers."""
        feats = request_features(msg)
        self.tally.stats.update(requests=1, features=len(feats))
        readers = self.live_readers()
        if self.delivery_for(w.gen) == "one_of_n" and readers:
            readers = [self.rng.choice(readers)]
        for r in readers:
            r.send_body(body)
        if waiting := {r.token for r in readers if not r.stopped}:
            self.owed[w.gen, int(msg["rid"])] = waiting
        else:
            w.send("credit", n=1)

    def on_hb(self, c: Child, msg: Msg, body: bytes) -> None:
        if "stats" in msg:
            self.tally.writer_stats[c.gen] = msg["stats"]
        if (fut := c.replies.get(msg.get("re", ""))) is not None and not fut.done():
            fut.set_result(msg)

    on_re = on_hb  # an answer (a writer's carries its statistics)

    def on_violation(self, c: Child, msg: Msg, body: bytes) -> None:
        self.violation(str(msg["who"]), str(msg["text"]))

    def on_count(self, r: Child, msg: Msg, body: bytes) -> None:
        """Counters a reader adds: stats ``c``, errors ``e`` (``"Kind (where)": n``)."""
        t, gen, errors = self.tally, int(msg["gen"]), msg.get("e", {})
        t.stats.update(msg.get("c", {}))
        t.errors.update(errors)
        if msg.get("text"):
            t.err_texts.update((k, str(msg["text"])) for k in errors)
        kinds = {k.split()[0] for k in errors}
        if "WriterGoneError" in kinds:
            t.wgone_gens.add(gen)
        if "SegmentNotFoundError" in kinds:  # is the live writer's segment gone?
            for w in self.live_writers():
                if w.gen == gen and not w.killed_by_us and not segment_files(w.name):
                    why = "a /dev/shm cleanup or a buggy sweep; rerun with --private-shm"
                    self.violation("environment", f"{w.name} unlinked by another process: {why}")

    def on_done(self, r: Child, msg: Msg, body: bytes) -> None:
        """A reader settled a request: its counters, and the request's credit."""
        self.on_count(r, msg, body)
        self.reported(r.token, (int(msg["gen"]), int(msg["rid"])))

    def reported(self, token: str, key: tuple[int, int]) -> None:
        if (waiting := self.owed.get(key)) is not None:
            waiting.discard(token)
            if not waiting:
                del self.owed[key]
                for w in self.live_writers():
                    if w.gen == key[0]:
                        w.send("credit", n=1)

    def write_off(self, token: str) -> None:
        """A reader that will not report (killed, stopped) owes nothing any more."""
        for key in list(self.owed):
            self.reported(token, key)

    async def ask(self, child: Child, t: str, limit: float, **kw: Any) -> Msg | None:
        """Send a question; its answer, or None (no answer within ``limit`` s, or EOF)."""
        token = secrets.token_hex(4)
        child.replies[token] = fut = asyncio.get_running_loop().create_future()
        child.send(t, re=token, **kw)
        try:
            with anyio.move_on_after(limit):
                if (got := await fut).get("t") != "eof":
                    return {k: v for k, v in got.items() if k not in ("t", "re")}
            return None
        finally:
            child.replies.pop(token, None)

    # --- a writer's death ----------------------------------------------------------------------
    async def kill_writer(self) -> None:
        """SIGKILL the writer (with ``--group``: one of them) and start its replacement.

        Its segment must be an orphan to ``sweep(prefix=<this run's names>)`` (other programs'
        are never looked at); readers must see ``WriterGoneError`` from it within 1 s; a group's
        replacement must reclaim its shard, and a group reader still holding the dead shard's
        references must get ``WriterGoneError`` for them, never a forged-reference error.
        """
        async with self.topology:
            if not (live := self.live_writers()):
                return
            w = self.rng.choice(live)
            await w.kill(wait_link=True)
            dead_at = time.monotonic()
            self.tally.stats["writer_kills"] += 1
            self.tally.dead_gens[w.gen] = "killed"
            self.owed = {k: v for k, v in self.owed.items() if k[0] != w.gen}  # no credit back
            if self.group is None:
                swept = sweep(prefix=self.prefix)
                if w.name not in swept and w.name in segment_files(w.name):
                    self.violation("sweep", f"sweep does not list the dead writer's {w.name}")
                if left := segment_files(w.name):
                    self.violation("sweep", f"left after sweeping the dead writer: {left}")
            started = await self.start_writer({"gen": w.gen, "dead_at": dead_at}, w.pos)
            # the lowest free shard index is the dead one's, unless another shard closed meanwhile
            new = self.writers[w.pos]
            if started and self.group is not None and new is not None and new.name == w.name:
                self.tally.stats["shards_reclaimed"] += 1

    # --- background tasks ----------------------------------------------------------------------
    async def watchdog(self) -> None:
        """A child silent for ``--hang-timeout`` hangs; one that exits on its own crashed."""
        while True:
            await asyncio.sleep(1.0)
            now, hang = time.monotonic(), self.opts.hang_timeout
            for c in list(self.children.values()):
                rc = c.proc.returncode
                hung = c.live and rc is None and now - c.last_hb > hang
                if hung and not (c.stopped or c.killed_by_us):
                    self.violation(c.token, f"{c.role} silent for {now - c.last_hb:.1f} s (hang)")
                    c.last_hb = now
                    await self.hard_kill(c)
                if rc is not None and not c.killed_by_us and not c.rc_seen:
                    c.rc_seen = True
                    if rc != 0 and self.phase != "exit":
                        self.violation(c.token, f"{c.role} exited with {rc}: {c.log_tail()}")

    async def progress(self) -> None:
        """A progress line every second on stderr (not with ``--quiet``)."""
        show = Progress(enabled=not self.opts.quiet)
        while True:
            await asyncio.sleep(1.0)
            n = len(self.live_readers())
            show(progress_line(self.opts, self.tally, self.elapsed(), self.writer_gen, n))

    async def fault_loop(self, act: Callable[[Orchestrator], Awaitable[None]], mean: float) -> None:
        """One fault: ``act`` every ``mean`` seconds or so (held back while paused)."""
        while True:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * mean if mean > 0 else 1.0)
            async with self.acting:
                if self.phase != "run":
                    return
                await act(self)

    async def pause_faults(self) -> None:
        """Stop injecting and wait until no fault is acting (a stopped reader resumes): take
        every token of ``acting``."""
        self.pausing.set()
        with anyio.move_on_after(self.opts.hang_timeout + 30):
            while self.held < len(PERIODIC):
                await self.acting.acquire()
                self.held += 1
        if self.held < len(PERIODIC):
            self.violation("harness", "fault actions did not finish")

    def resume_faults(self) -> None:
        self.pausing.clear()
        for _ in range(self.held):
            self.acting.release()
        self.held = 0

    # --- quiescence and checks ----------------------------------------------------------------
    async def quiesce_and_check(self, why: str) -> None:
        """Writers stopped, every request read, then the drain check (per shard)."""
        if not (writers := self.live_writers()):
            return
        for pos, c in enumerate(self.readers):
            if c is None or c.eof.is_set():
                await self.start_reader(pos)
        limit = self.opts.op_deadline + 20
        stops = await asyncio.gather(*(self.ask(w, "stop", limit) for w in writers))
        if None in stops:
            return self.violation(writers[stops.index(None)].token, f"{why}: a writer did not stop")
        synced: dict[str, Msg] = {}  # a reader syncs after every request sent to it
        for c in self.live_readers():
            if (got := await self.ask(c, "sync", 60)) is None:
                self.violation(c.token, f"{why}: reader did not catch up (sync)")
            elif not got["attached"] or (self.group is None and got["gen"] != writers[0].gen):
                self.violation(c.token, f"{why}: reader not attached to its writer at quiescence")
            else:
                synced[c.token] = got
        self.owed.clear()
        await asyncio.gather(*(self.drain_check(w, why, synced) for w in writers))

    async def drain_check(self, w: Child, why: str, synced: dict[str, Msg]) -> None:
        """Writer ``w``'s cache drains: every item freeable, then the ring empty; and no reader
        slot holds fewer acknowledgements than the references its reader read and verified."""
        within = 5.0 + self.opts.handout_ttl  # lost hand-outs lapse after handout_ttl
        if (final := await self.ask(w, "check", within + 30, within=within)) is None:
            return self.violation(w.token, f"{why}: the writer did not answer the drain check")
        final = {k: v for k, v in final.items() if k != "stats"}
        final.update(gen=w.gen, why=why if self.group is None else f"{why} g{w.gen}")
        self.tally.finals.append(final)
        # more acknowledgements than reads is fine (a failed or cancelled read's references are
        # given back, acknowledged unread; stale ones owe nothing); fewer is a lost one
        nonce = w.handle["handle"]["nonce"] if w.handle else None
        slots = [s for s in final.get("slots", []) if s["attached"] and not s["revoked"]]
        for token, got in synced.items():
            acked = [s["acknowledged"] for s in slots if s["pid"] == got["pid"]]
            # a group reader's reads of this shard only
            reads = dict(got["reads_by_nonce"]).get(nonce, 0) if self.group else got["reads"]
            if len(acked) == 1 and acked[0] < reads:
                text = f"{reads} references read and verified in this session, the slot's log"
                text += f" holds {acked[0]} ({got['uncertain']} reads uncounted)"
                self.violation(f"reader {token}", f"acknowledgements lost: {text}")
        if stuck := final.get("n_not_freeable"):
            text = f"{stuck} of {final['items']} items never freeable"
            text += f" (e.g. {final['not_freeable'][:5]}); slots {final['slots']}"
            self.violation(w.token, f"{why}: cache does not drain: {text}")
        elif final.get("after_items") or final.get("after_bytes"):
            text = f"{final['after_items']} items / {final['after_bytes']} bytes"
            self.violation(w.token, f"{why}: after freeing everything the ring still holds {text}")

    async def exit_child(self, why: str, c: Child) -> float:
        """Tell ``c`` to exit; it must, with status 0 (a writer: leaving no segment behind)."""
        c.send("exit")
        rc = None
        with anyio.move_on_after(30):
            rc = await c.proc.wait()
        if rc is None:
            self.violation(c.token, f"{why}: {c.role} did not exit within 30 s")
            await self.hard_kill(c)
        elif rc != 0 and not c.killed_by_us:
            self.violation(c.token, f"{why}: {c.role} exited with {rc}: {c.log_tail()}")
        c.killed_by_us = True
        if c.role == "writer":
            self.tally.dead_gens[c.gen] = "closed"
            if left := segment_files(c.name):
                self.violation(c.token, f"{why}: aclose left {left} in {SHM_DIR}")
        return time.monotonic()

    # --- the run ---------------------------------------------------------------------------------
    async def run(self) -> int:
        if (me := asyncio.current_task()) is not None:  # SIGINT / SIGTERM: stop, clean up
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    asyncio.get_running_loop().add_signal_handler(sig, self.interrupt, me)
        server = await asyncio.start_unix_server(self.serve, path=sock_path(self.sock))
        bg = [asyncio.ensure_future(self.watchdog()), asyncio.ensure_future(self.progress())]
        try:
            if all([await self.start_writer(None, pos) for pos in range(len(self.writers))]):
                await self.body()
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
            self.run_elapsed = self.run_elapsed or self.elapsed()
        finally:
            for t in bg + self.faults:
                t.cancel()
            await asyncio.gather(*bg, *self.faults, return_exceptions=True)
            await self.kill_all()
            server.close()
            with anyio.move_on_after(5):
                await server.wait_closed()
        return self.finish()

    def interrupt(self, task: asyncio.Task[Any]) -> None:
        if not self.interrupted:  # a second signal is ignored
            self.interrupted = True
            task.cancel()

    async def body(self) -> None:
        """Readers up, the main phase with its faults, then the final drain and the exit."""
        o, st = self.opts, self.tally.stats
        await asyncio.gather(*(self.start_reader(i) for i in range(o.readers)))
        # --duration counts from here: every process is up (which may take seconds under load)
        self.phase, half, self.t_start = "run", o.delivery == "alternate", time.monotonic()
        for f in (f for f in PERIODIC if f in o.faults):
            loop = self.fault_loop(PERIODIC[f], getattr(o, FAULTS[f]))
            self.faults.append(asyncio.ensure_future(loop))
        while True:  # until --duration or --ops; the self-test until it saw its sabotage
            await asyncio.sleep(0.05)
            done = self.elapsed() / o.duration if o.duration else st["requests"] / (o.ops or 1)
            if done >= 1 and not self.sabotage_pending(self.elapsed() - (o.duration or 0)):
                break
            # alternate delivery: the (first) writer is rotated gracefully at half time, so
            # that a run has both modes and a mid-run drain check
            if half and done >= 0.5:
                half = False
                await self.pause_faults()
                async with self.topology:
                    await self.quiesce_and_check("rotation")
                    if (w := self.writers[0]) is not None:
                        closed_at = await self.exit_child("rotation", w)
                        st["writer_rotations"] += 1
                        await self.start_writer({"gen": w.gen, "dead_at": closed_at}, w.pos)
                self.resume_faults()
        self.run_elapsed, self.phase = self.elapsed(), "quiesce"
        await self.pause_faults()
        async with self.topology:
            await self.quiesce_and_check("end of run")
        self.phase = "exit"
        for c in self.live_readers() + self.live_writers():
            await self.exit_child("end of run", c)

    def sabotage_pending(self, overtime: float) -> bool:
        """The self-test goes on until each sabotage was seen a few times (bounded overtime):
        count-based, as a loaded machine may fit too few requests in a fixed duration."""
        st, sab = self.tally.stats, self.opts.sabotage
        return overtime <= SABOTAGE_GRACE and (
            ("digest" in sab and st["items_wrong"] < SABOTAGE_MIN_SEEN)
            or ("drop" in sab and st["sabotage_dropped"] < SABOTAGE_MIN_SEEN)
        )

    async def kill_all(self) -> None:
        live = [c for c in self.children.values() if c.proc.returncode is None]
        await asyncio.gather(*(c.kill(wait_link=False) for c in live))

    def finish(self) -> int:
        """The end-state checks, the report, and the exit status."""
        t, o = self.tally, self.opts
        # our segments and semaphores still in /dev/shm (alone in a private one: any)
        left = files_with_prefix(SEGMENT_PREFIX if os.environ.get(IN_PRIVATE_SHM) else self.prefix)
        if left and not self.interrupted:  # an interrupted run killed its writer: orphans
            self.violation("end", f"left in {SHM_DIR}: {left}")
        remove(left)
        if kids := child_pids():
            self.violation("end", f"child processes left: {kids}")
        if (stray := t.wgone_gens - set(t.dead_gens)) and not self.interrupted:
            self.violation("end", f"WriterGoneError for live writer generations {sorted(stray)}")
        text = summary(o, t, self.run_elapsed, self.writer_gen, self.interrupted)
        print(text, file=sys.stderr if o.quiet else sys.stdout, flush=True)
        if o.json_path:
            with open(o.json_path, "w") as f:
                json.dump(as_json(o, t, self.run_elapsed), f, indent=1, sort_keys=True, default=str)
        if failed := len(t.violations) > 0:
            print(f"children's logs kept in {self.tmp}", file=sys.stderr)
        elif not o.keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return 2 if self.interrupted else int(failed)

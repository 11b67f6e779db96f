"""The faults the parent injects: readers SIGKILLed and SIGSTOPped, the writer SIGKILLed.

With ``fork``, the writer or a reader (in turn) first forks a child that outlives it for
``--fork-linger`` seconds: the dead process must still look dead (readers see
``WriterGoneError`` within the usual bound, ``sweep`` removes the orphan, the dead reader's slot
and its debts are dropped while the forked child lives).

With ``sweep-restart``, a helper process (``restarts``) runs a burst of writers that crash and
restart under one name of the run while another process sweeps that name: every restarted
writer must keep its segment, every restart must reclaim, nothing may be left.

Each fault is a loop that acts every ``--*-every`` seconds on average. Faults pause (and the
parent waits until none is acting) around quiescence and planned writer rotations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from .orchestrator import Child, Orchestrator

__all__ = ["Faults"]

#: crash-and-restart rounds per ``sweep-restart`` burst (about 15 ms each here)
SWEEP_RESTART_ROUNDS = 40


class Faults:
    """The fault loops of one run, and the switch that pauses them."""

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self.opts = orch.opts
        self.rng = orch.rng
        self.paused = False
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.resumed = asyncio.Event()
        self.pausing = asyncio.Event()

    def start(self) -> list[asyncio.Task[None]]:
        """One task per enabled fault."""
        loops = {
            "kill-readers": self.kill_readers_loop,
            "stop-readers": self.stop_readers_loop,
            "kill-writer": self.kill_writer_loop,
            "fork": self.fork_loop,
            "sweep-restart": self.sweep_restart_loop,
        }
        return [asyncio.ensure_future(loop()) for f, loop in loops.items() if f in self.opts.faults]

    @contextlib.asynccontextmanager
    async def acting(self) -> AsyncIterator[None]:
        """A fault is acting (``pause`` waits for it to finish)."""
        self.active += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if not self.active:
                self.idle.set()

    async def sleep(self, mean: float) -> bool:
        """Sleep about ``mean`` seconds; False once the run is over."""
        await asyncio.sleep(self.rng.uniform(0.5, 1.5) * mean if mean > 0 else 1.0)
        while self.paused and not self.orch.done_running():
            await self.resumed.wait()
        return not self.orch.done_running()

    def pick_reader(self) -> Child | None:
        cands = [c for c in self.orch.live_readers() if not c.busy and not c.stopped]
        return self.rng.choice(cands) if cands else None

    async def pause(self) -> None:
        """Stop injecting and wait until no fault is acting."""
        self.paused = True
        self.pausing.set()
        self.resumed.clear()
        with anyio.move_on_after(self.opts.hang_timeout + 30):
            await self.idle.wait()
            return
        self.orch.violation("harness", "fault actions did not finish")

    def resume(self) -> None:
        self.paused = False
        self.pausing.clear()
        self.resumed.set()

    def wake(self) -> None:
        """Wake the loops that wait for a resume (they see that the run is over)."""
        self.resumed.set()

    async def act_on_readers(self, mean: float, action: Callable[[Child], Awaitable[None]]) -> None:
        """Every ``mean`` seconds or so while the run lasts: ``action`` on a reader not busy."""
        while await self.sleep(mean):
            async with self.acting():
                if self.paused:
                    continue
                c = self.pick_reader()
                if c is None:
                    continue
                c.busy = True
                await action(c)

    async def kill_readers_loop(self) -> None:
        await self.act_on_readers(self.opts.reader_kill_every, self.kill_reader)

    async def kill_reader(self, c: Child) -> None:
        """SIGKILL, write off what it owed, start a new reader in its place."""
        await c.kill(wait_link=True)
        self.orch.tally.stats["reader_kills"] += 1
        self.orch.write_off(c.token)
        if self.orch.readers[c.pos] is c:
            self.orch.readers[c.pos] = None
        await self.orch.start_reader(c.pos)

    async def stop_readers_loop(self) -> None:
        await self.act_on_readers(self.opts.reader_stop_every, self.stop_reader)

    async def stop_reader(self, c: Child) -> None:
        """SIGSTOP for a while (up to twice the eviction delay), then SIGCONT."""
        evict = self.opts.evict_after
        top = 2 * evict if evict > 0 else 2.0
        dur = self.rng.uniform(0.3, min(top, self.opts.hang_timeout / 3))
        c.stopped = True
        self.orch.write_off(c.token)
        try:
            c.proc.send_signal(signal.SIGSTOP)
            self.orch.tally.stats["reader_stops"] += 1
            with anyio.move_on_after(dur):
                await self.pausing.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGCONT)
            c.last_hb = time.monotonic()
            c.stopped = False
            c.busy = False

    async def fork_loop(self) -> None:
        """In turn: the writer forks and is SIGKILLed; a reader forks and is SIGKILLed."""
        turn = 0
        while await self.sleep(self.opts.fork_every):
            async with self.acting():
                if self.paused:
                    continue
                if turn % 2 == 0:
                    await self.orch.kill_writer(fork=True)
                    turn += 1
                    continue
                c = self.pick_reader()
                if c is None:
                    continue
                c.busy = True
                turn += 1
                await self.fork_and_kill_reader(c)

    async def fork_and_kill_reader(self, c: Child) -> None:
        """The reader forks, is SIGKILLed; its slot must be dead while the forked child lives."""
        forked = await self.orch.fork_child(c)
        pid = c.pid
        await self.kill_reader(c)
        if forked:
            self.orch.tally.stats["fork_kills_reader"] += 1
            await self.orch.check_slot_dropped(pid)

    async def kill_writer_loop(self) -> None:
        while await self.sleep(self.opts.writer_kill_every):
            async with self.acting():
                if self.paused:
                    continue
                await self.orch.kill_writer()

    async def sweep_restart_loop(self) -> None:
        name = f"{self.orch.prefix}sr"
        while await self.sleep(self.opts.sweep_restart_every):
            async with self.acting():
                if self.paused:
                    continue
                await self.sweep_restart(name)

    async def sweep_restart(self, name: str) -> None:
        """One burst of crash-and-restart rounds under ``name`` against a sweeping process."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aioshmcache.tools.stress.restarts",
            name,
            str(SWEEP_RESTART_ROUNDS),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out = err = b""
        with anyio.move_on_after(self.opts.hang_timeout + 60) as scope:
            out, err = await proc.communicate()
        if scope.cancelled_caught:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            self.orch.violation("sweep-restart", "the restart-and-sweep burst did not finish")
            return
        try:
            res = json.loads(out.decode(errors="replace").strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = err.decode(errors="replace")[-600:]
            self.orch.violation("sweep-restart", f"no result (exit {proc.returncode}): {tail}")
            return
        self.orch.tally.stats["sweep_restarts"] += res["rounds"]
        if res["lost"]:
            self.orch.violation(
                "sweep-restart",
                f"{res['lost']} of {res['rounds']} writers restarted under {name} lost their "
                "segment to a concurrent sweep",
            )
        if res["failed"]:
            self.orch.violation(
                "sweep-restart",
                f"{res['failed']} restarts under {name} could not reclaim a dead writer's "
                f"name: {res['errors']}",
            )
        if res["left"]:
            self.orch.violation("sweep-restart", f"left after the final sweep: {res['left']}")

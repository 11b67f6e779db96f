"""The demo's load driver: start the example gateway, drive a realistic load, verify, report.

The gateway (:mod:`.app`) runs as ``demo serve`` in a child process of its own session. The load:
seeded synthetic images of Zipf popularity, one per ``POST /v1/embed``, from ``concurrency``
clients; some repeat requests send the hash alone first (a 409: the pixels follow); a 502 / 503
(the engine worker being replaced) is retried. Every answer is checked against the same
computation done locally; the same load runs again with the cache off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any, NamedTuple

import httpx
import numpy as np
import uvloop

from aioshmcache import ShmCacheError, sweep
from aioshmcache._inspect import read_snapshot

from ..progress import Progress
from ..shm import files_with_prefix, name_prefix
from ..units import MiB, fmt_bytes
from . import DemoOptions
from .app import engine_answer, image_hash, preprocess

#: how often a 502 / 503 (engine worker being replaced) is retried, and the pause between tries
RETRIES = 20
RETRY_PAUSE = 0.25


class GatewayProcess:
    """``python -m aioshmcache demo serve ...`` as a child process, in a session of its own.

    ``start`` waits for its address and for ``/healthz`` (the engine worker is up); ``stop``
    sends SIGTERM, SIGKILL to the whole session after ``timeout``, and removes the segments of a
    gateway that could not. The gateway's temporary files (its engine socket's directory) go to
    a directory of its own (``TMPDIR``, :attr:`tmpdir`), which ``stop`` removes: a gateway
    killed outright cannot."""

    def __init__(
        self, args: Sequence[str], *, name: str, procs: int = 1, stderr: IO[Any] | None = None
    ) -> None:
        # name: the segment's, or the group's (procs > 1)
        self.args, self.name, self.procs, self.stderr = list(args), name, procs, stderr
        self.proc: subprocess.Popen[bytes] | None = None
        self.url, self.pid = "", 0
        #: the gateway's ``TMPDIR`` while it runs (made by ``start``, removed by ``stop``)
        self.tmpdir: str | None = None

    def start(self, timeout: float = 60.0) -> str:
        cmd = [sys.executable, "-m", "aioshmcache", "demo", "serve", "--port", "0"]
        cmd += ["--name", self.name, "--gateway-workers", str(self.procs), *self.args]
        # its stdout goes to a file (unlinked: gone with the last descriptor), which nobody has
        # to keep draining as a pipe would need; its first line is ``listening on URL``
        self.tmpdir = tempfile.mkdtemp(prefix="aioshm-gateway-")
        env = {**os.environ, "TMPDIR": self.tmpdir}
        with tempfile.TemporaryFile() as out:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=self.stderr,
                start_new_session=True, env=env,
            )  # fmt: skip
            self.pid = self.proc.pid
            try:
                self._wait_ready(self.proc, out, timeout)
            except BaseException:
                self.stop()
                raise
        return self.url

    def _wait_ready(self, proc: subprocess.Popen[bytes], out: IO[bytes], timeout: float) -> None:
        """Until the gateway prints its URL, then until ``/healthz`` answers 200 and every
        gateway process's segment is open (with N processes: every shard)."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                if (code := proc.poll()) is not None:
                    raise RuntimeError(f"the gateway exited during startup (code {code})")
                first, newline, _ = os.pread(out.fileno(), 4096, 0).partition(b"\n")
                if newline and not first.startswith(b"listening on "):
                    raise RuntimeError(f"unexpected first line from the gateway: {first!r}")
                self.url = first.decode().removeprefix("listening on ") if newline else ""
                with contextlib.suppress(httpx.HTTPError):
                    up = bool(self.url) and client.get(f"{self.url}/healthz").status_code == 200
                    if up and len(self._live_snapshots()) >= self.procs:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway and its engine worker were not ready in time")
                time.sleep(0.05)

    def segments(self) -> list[str]:
        """The gateway's segments in /dev/shm: its one cache, or its group's shards."""
        segment = re.compile(re.escape(f"aioshm-{self.name}") + r"(\.shard\d+)?")
        return [n for n in files_with_prefix(self.name) if segment.fullmatch(n)]

    def _live_snapshots(self) -> list[Any]:
        """The snapshot of every segment of the gateway that is open and has a live writer."""
        snaps = []
        for seg in self.segments():
            with contextlib.suppress(ShmCacheError, OSError, ValueError):  # created or removed now
                snap, alive = read_snapshot(seg)
                if alive:
                    snaps.append(snap)
        return snaps

    def cache_stats(self, timeout: float = 15.0) -> dict[str, Any]:
        """The counters of every segment of the gateway, summed (from shared memory: with N
        gateway processes ``/stats`` reaches one of them, the segments hold them all).

        Waits (bounded) until every gateway process's segment is open: a gateway process that
        uvicorn replaced opens a new shard, and one being created cannot be read yet."""
        deadline = time.monotonic() + timeout
        while len(snaps := self._live_snapshots()) < self.procs and time.monotonic() < deadline:
            time.sleep(0.05)
        return {key: sum(getattr(snap, key) for snap in snaps) for key in _SUMMED}

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the gateway (bounded); returns its exit code. Idempotent."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: a graceful stop
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        # whatever of its session is left (all of it after a timeout; an engine worker whose
        # gateway was killed): its own session, started for it, so nothing else is hit
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(5.0)
        sweep(prefix=self.name)  # what a gateway process that could not clean up left behind
        if self.tmpdir is not None:  # and its temporary files
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        return proc.returncode


#: the counters of every segment of a gateway, summed
_SUMMED: tuple[str, ...] = ("hits", "misses", "sibling_hits", "inline_too_large", "inline_full")
_SUMMED += ("evictions", "bytes_used", "items", "capacity_bytes")


class PlannedRequest(NamedTuple):
    image: int
    hash_first: bool


def synthetic_image(seed: int) -> tuple[bytes, int, int]:
    """A reproducible RGB image, 96-576 px a side: ``(pixels, height, width)``."""
    rng = np.random.default_rng(seed)
    h, w = (int(x) for x in rng.integers(96, 577, size=2))
    # smooth gradients and noise: compresses like a photo would, differs per seed
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    tint = rng.uniform(0.2, 1.0, size=3).astype(np.float32)
    img = (y * tint + x * tint[::-1]) / 2 + rng.normal(0, 8, size=(h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8).tobytes(), h, w


def expected_answer(image: tuple[bytes, int, int]) -> dict[str, Any]:
    """What the engine worker must answer for ``image``: computed here, from the same bytes."""
    pixels, h, w = image
    return engine_answer(image_hash(pixels, h, w), preprocess(pixels, h, w))


def plan_requests(
    n_requests: int, n_images: int, *, zipf: float, seed: int, hash_first: float
) -> list[PlannedRequest]:
    """A reproducible request mix: Zipf popularity; hash first only for an image sent before."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, n_images + 1, dtype=np.float64) ** -zipf
    popularity = rng.permutation(n_images)  # which image has which rank
    ranks = rng.choice(n_images, size=n_requests, p=weights / weights.sum())
    try_hash = rng.random(n_requests) < hash_first
    seen: set[int] = set()
    plan = []
    for rank, hf in zip(ranks.tolist(), try_hash.tolist(), strict=True):
        image = int(popularity[rank])
        plan.append(PlannedRequest(image, bool(hf) and image in seen))
        seen.add(image)
    return plan


@dataclass
class PhaseResult:
    label: str
    requests: int = 0
    ok: int = 0
    failed: int = 0
    verified: int = 0
    preprocessed: int = 0
    inline: int = 0
    drift_409: int = 0
    drift_resent_ok: int = 0
    retried: int = 0
    wall_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    cache: dict[str, Any] = field(default_factory=dict)
    single_flight: dict[str, Any] = field(default_factory=dict)
    gateway_processes: int = 1
    #: distinct images the phase's plan asks for
    images: int = 0
    #: (segment, mm_hash) of every answer sent by reference: which shard held which image
    answered_from: set[tuple[str, str]] = field(default_factory=set)

    @property
    def shard_items(self) -> int:
        """Items the gateway's segments must hold: one per (segment, image) answered by
        reference (exact while nothing is evicted)."""
        return len(self.answered_from)

    @property
    def passed(self) -> bool:
        return self.requests > 0 and self.ok == self.requests and self.verified == self.requests

    def summary(self) -> dict[str, Any]:
        """Every figure of the phase, as the table and ``--json`` give them."""
        skip = ("latencies_ms", "cache", "answered_from")
        out = {k: v for k, v in asdict(self).items() if k not in skip}
        out["shard_items"] = self.shard_items
        latencies = self.latencies_ms or [0.0]
        out |= {f"p{q}_ms": float(np.percentile(latencies, q)) for q in (50, 95, 99)}
        out |= {key: self.cache.get(key, 0) for key in _SUMMED}
        out["throughput_rps"] = self.ok / self.wall_s if self.wall_s > 0 else 0.0
        out["hit_ratio"] = out["hits"] / ((out["hits"] + out["misses"]) or 1)
        return out | {"errors": dict(self.errors), "passed": self.passed}


def check_response(body: dict[str, Any], expected: dict[str, Any]) -> tuple[bool, str]:
    """Check one 200 answer against :func:`expected_answer`: (matched, the first problem)."""
    for key in ("mm_hash", "shape", "crc32"):
        if body.get(key) != expected[key]:
            return False, f"{key} is {body.get(key)!r}, expected {expected[key]!r}"
    return True, ""


def _show(prog: Progress, label: str, total: int, res: PhaseResult, final: bool = False) -> None:
    done = res.ok + res.failed
    rate = res.ok / max(1e-9, prog.elapsed())
    line = f"[{label}] {done}/{total} requests, {res.failed} failed, {rate:.1f} req/s"
    prog.update(line, done / max(1, total), final=final)


async def run_load(
    url: str,
    plan: Sequence[PlannedRequest],
    images: Sequence[tuple[bytes, int, int]],
    expected: Sequence[dict[str, Any]],
    *,
    concurrency: int,
    label: str,
    progress: bool = True,
    use_hashes: bool = True,
) -> PhaseResult:
    """Drive ``plan`` at the gateway with ``concurrency`` clients; check every answer."""
    import base64

    res = PhaseResult(label, requests=len(plan), images=len({r.image for r in plan}))
    full = [
        {"mm_hash": e["mm_hash"], "pixels": base64.b64encode(p).decode(), "height": h, "width": w}
        for (p, h, w), e in zip(images, expected, strict=True)
    ]
    todo = iter(plan)  # shared by the clients: each takes the next request
    prog = Progress(enabled=progress)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def post(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
        """One request; a 502 / 503 (the engine worker being replaced) is tried again."""
        for _ in range(RETRIES):
            r = await client.post("/v1/embed", json=body)
            if r.status_code not in (502, 503):
                break
            res.retried += 1
            await asyncio.sleep(RETRY_PAUSE)
        return r

    async def ask(client: httpx.AsyncClient, req: PlannedRequest) -> httpx.Response:
        """Hash first when planned; the pixels after a 409 (as the example's protocol says)."""
        if req.hash_first and use_hashes:
            r = await post(client, {"mm_hash": expected[req.image]["mm_hash"]})
            if r.status_code != 409:
                return r
            res.drift_409 += 1
            r = await post(client, full[req.image])
            res.drift_resent_ok += r.status_code == 200
            return r
        return await post(client, full[req.image])

    stopping = asyncio.Event()

    async def client_task(client: httpx.AsyncClient) -> None:
        for req in todo:
            if stopping.is_set():
                return  # interrupted: no new request
            t0 = time.perf_counter()
            try:
                r = await ask(client, req)
            except httpx.HTTPError as exc:
                res.failed += 1
                res.errors[type(exc).__name__] += 1
            else:
                res.latencies_ms.append((time.perf_counter() - t0) * 1e3)
                good = r.status_code == 200
                body = r.json() if good else {}
                ok, problem = check_response(body, expected[req.image])
                res.ok += good
                res.failed += not good
                res.verified += ok
                res.preprocessed += bool(body.get("preprocessed"))
                res.inline += body.get("transport") == "inline"
                if good and body.get("transport") == "shm":
                    res.answered_from.add((str(body.get("segment")), str(body.get("mm_hash"))))
                if not good:
                    res.errors[f"HTTP {r.status_code}: {r.text[:120]}"] += 1
                elif not ok:
                    res.errors[f"mismatch: {problem}"] += 1
            _show(prog, label, len(plan), res)

    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        t0 = time.perf_counter()
        clients = asyncio.gather(*(client_task(client) for _ in range(concurrency)))
        with _stop_on_signals(stopping):
            stop: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
            either: list[asyncio.Future[Any]] = [clients, stop]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if stopping.is_set():
                await _wind_down(clients)
                raise KeyboardInterrupt
        await clients
        res.wall_s = time.perf_counter() - t0
        _show(prog, label, len(plan), res, final=True)
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            res.single_flight = (await client.get("/stats")).json()["single_flight"]
    return res


@contextlib.contextmanager
def _stop_on_signals(stopping: asyncio.Event) -> Iterator[None]:
    """Ctrl-C and SIGTERM set ``stopping`` while the load runs (the loop's own handlers).

    Not a cancellation of the running task: one cancel can be lost in a client library's
    shielded clean-up under load, and the load then ran on for minutes after a Ctrl-C. The
    flag is read before every request, so every client stops after the one it is sending.
    """
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        before = signal.getsignal(sig)
        try:
            loop.add_signal_handler(sig, stopping.set)
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread
            continue
        installed.append((sig, before))
    try:
        yield
    finally:
        for sig, before in installed:
            loop.remove_signal_handler(sig)
            if before is not None:  # the loop would leave the default (SIGTERM: death)
                signal.signal(sig, before)


async def _wind_down(clients: asyncio.Future[Any], grace: float = 10.0) -> None:
    """After a stop: the clients end after their request in flight; cancelled after ``grace``."""
    done, _ = await asyncio.wait([clients], timeout=grace)
    if not done:
        clients.cancel()
        await asyncio.wait([clients], timeout=grace)
    if clients.done() and not clients.cancelled():
        clients.exception()  # retrieved: an interrupted load reports nothing more


#: the rows of the results table: (what, its cell for one phase, from the phase's summary)
_TABLE = (
    ("requests ok / failed", "{ok} / {failed}"),
    ("answers verified (local compute)", "{verified} / {requests}"),
    ("throughput", "{throughput_rps:.1f} req/s"),
    ("latency p50 / p95 / p99", "{p50_ms:.0f}/{p95_ms:.0f}/{p99_ms:.0f} ms"),
    ("gateway processes", "{gateway_processes}"),
    ("hit ratio", "{hit_pct:.1f} %"),
    ("  copied from a sibling shard", "{sibling_hits}"),
    ("images preprocessed", "{preprocessed} / {requests}"),
    ("preprocessings saved (single flight)", "{saved}"),
    ("sent inline (socket) / by reference", "{inline} / {by_reference}"),
    ("items inline: too large / full", "{inline_too_large} / {inline_full}"),
    ("evictions", "{evictions}"),
    ("cache used / capacity", "{used_mib:.1f} / {capacity_mib:.0f} MiB"),
    ("items cached", "{items}"),
    ("hash-first 409s -> resent ok", "{drift_409} -> {drift_resent_ok}"),
    ("retried (502/503: engine restarting)", "{retried}"),
)


def format_table(opts: DemoOptions, phases: Sequence[PhaseResult]) -> str:
    """The phases side by side, one column each, and their most frequent errors."""
    cols = []
    for p in phases:
        c = p.summary()
        sf = c["single_flight"]  # per process: shown for one gateway process only
        c["saved"] = sf.get("saved", "-") if sf and p.gateway_processes == 1 else "-"
        c |= {"hit_pct": 100 * c["hit_ratio"], "by_reference": c["ok"] - c["inline"]}
        c |= {"used_mib": c["bytes_used"] / MiB, "capacity_mib": c["capacity_bytes"] / MiB}
        cols.append(c)
    lines = [
        "",
        f"aioshmcache demo: {opts.requests} requests, {opts.concurrency} clients, {opts.images} "
        f"images (Zipf s={opts.zipf}), one image per request,",
        f"  the example gateway (examples/fastapi_app.py) and its engine worker, cache "
        f"{opts.cache_mb:g} MiB, max object {fmt_bytes(int(opts.max_object_mb * MiB))}",
        "",
        f"  {'':<40}" + "".join(f"{c['label']:>22}" for c in cols),
        *(
            f"  {name:<40}" + "".join(f"{cell.format(**c):>22}" for c in cols)
            for name, cell in _TABLE
        ),
        "",
    ]
    lines += [f"  {p.label}: {n} x {err}" for p in phases for err, n in p.errors.most_common(5)]
    return "\n".join(lines)


def run_demo(opts: DemoOptions) -> int:
    """The whole demo; 0 only if every request of every phase succeeded and matched."""
    n_gw, phases = opts.gateway_workers, []
    configs = [("cache on", True, 1)]
    configs += [(f"cache on, {n_gw} gw", True, n_gw)] if n_gw > 1 else []  # one cache group
    configs += [("cache off", False, 1)] if opts.compare else []
    tag = f"{name_prefix()}demo-{os.getpid()}-{int(time.time()) % 100000}"
    t_start = time.perf_counter()
    images = [synthetic_image(opts.seed * 100_003 + k) for k in range(opts.images)]
    expected = [expected_answer(im) for im in images]
    plan = plan_requests(
        opts.requests, opts.images, zipf=opts.zipf, seed=opts.seed, hash_first=opts.hash_first
    )
    gw: GatewayProcess | None = None

    def on_sigterm(signum: int, frame: object) -> None:
        # the same clean shutdown as Ctrl-C: re-raised as SIGINT, so that a running event loop
        # (asyncio.Runner) cancels its main task instead of a KeyboardInterrupt landing in the
        # middle of a cancel scope's exit; without a loop it is a plain KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for i, (label, cache, procs) in enumerate(configs):
            args = ["--cache-mb", str(opts.cache_mb), "--max-object-mb", str(opts.max_object_mb)]
            args += ["--loop", opts.loop] + ([] if cache else ["--no-cache"])
            gw = GatewayProcess(args, name=f"{tag}-{i}", procs=procs)
            print(f"starting the gateway ({label}) ...", file=sys.stderr)
            gw.start()
            print(f"gateway at {gw.url} (pid {gw.pid}, cache {gw.name})", file=sys.stderr)
            load = run_load(
                gw.url, plan, images, expected, concurrency=opts.concurrency, label=label,
                use_hashes=cache,
            )  # fmt: skip
            res = uvloop.run(load)  # uvloop: less client overhead
            res.cache = gw.cache_stats()  # before the stop: the segments go with the gateway
            res.gateway_processes = procs
            phases.append(res)
            gw.stop()
            gw = None
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the gateway and its engine worker ...", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if gw is not None:
            gw.stop()
    print(format_table(opts, phases))
    passed, total = all(p.passed for p in phases), sum(p.requests for p in phases)
    bad, elapsed = sum(p.requests - p.verified for p in phases), time.perf_counter() - t_start
    if passed:
        print(f"PASS: all {total} requests succeeded and matched the local computation ", end="")
    else:
        print(f"FAIL: {bad} of {total} requests failed or did not match ", end="")
    print(f"({elapsed:.1f} s)")
    if opts.json_path:
        with open(opts.json_path, "w") as f:
            phase = [p.summary() for p in phases]
            json.dump({"options": asdict(opts), "phases": phase, "passed": passed}, f, indent=2)
    return 0 if passed else 1

"""The demo's load driver: start the example gateway, drive a realistic load, verify, report.

The gateway is the example app (:mod:`.app`, the code of ``examples/fastapi_app.py``) run by
``python -m aioshmcache demo serve`` in a child process of its own session (Ctrl-C reaches only
this driver, which then stops it: SIGTERM, then SIGKILL after a deadline).

The load: ``images`` distinct synthetic RGB images (seeded numpy, 96-576 px a side) whose
popularity follows a Zipf law (a few hot images, a long tail), one image per ``POST /v1/embed``,
from ``concurrency`` clients sharing one ``httpx.AsyncClient``. A share of the requests for an
image already sent first tries its hash alone (a client that trusts the gateway still holds
it); a 409 then makes the client resend it with its pixels, as the example's protocol says. A
502 or 503 (the engine worker being replaced) is retried a few times, as a client would.

Every answer is checked against the same computation done locally (:func:`expected_answer`:
the preprocessed tensor's shape and CRC-32, which the engine worker computes from what it read).
The same load runs again against a gateway with the cache off, and the table shows both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any, TypeVar

import httpx
import numpy as np

from aioshmcache import ShmCacheError, sweep
from aioshmcache.metrics import read_snapshot

from ..progress import Progress
from ..shm import files_with_prefix, remove, segment_files
from ..units import fmt_bytes
from .app import image_hash, preprocess, tensor_crc
from .cli import DemoOptions

__all__ = [
    "DemoOptions",
    "GatewayProcess",
    "PhaseResult",
    "PlannedRequest",
    "check_response",
    "expected_answer",
    "plan_requests",
    "run_demo",
    "run_load",
    "synthetic_image",
]

T = TypeVar("T")
#: how often a 502 / 503 (engine worker being replaced) is retried, and the pause between tries
RETRIES = 20
RETRY_PAUSE = 0.25


# --- the gateway process -------------------------------------------------------------------
class GatewayProcess:
    """``python -m aioshmcache demo serve ...`` as a child process, with a bounded stop.

    ``start`` waits for the URL line and then for ``/healthz`` to answer 200 (the engine worker
    is up). ``stop`` sends SIGTERM (graceful: each gateway process unlinks its segment, then the
    engine worker stops), SIGKILL to the whole session after ``timeout``, and finally removes
    the segments of a gateway that could not remove them itself.
    """

    def __init__(
        self, args: Sequence[str], *, name: str, procs: int = 1, stderr: IO[Any] | None = None
    ) -> None:
        self.args = list(args)
        self.name = name  # the segment's name, or the group's (procs > 1)
        self.procs = procs
        self.stderr = stderr
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.output: list[str] = []
        self._drain: threading.Thread | None = None

    def start(self, timeout: float = 60.0) -> str:
        cmd = [sys.executable, "-m", "aioshmcache", "demo", "serve", "--port", "0"]
        cmd += ["--name", self.name, "--gateway-workers", str(self.procs), *self.args]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            start_new_session=True,
        )
        try:
            self.url = self._read_url(timeout)
            self._drain = threading.Thread(target=self._drain_stdout, daemon=True)
            self._drain.start()
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _read_url(self, timeout: float) -> str:
        proc = self.proc
        if proc is None or proc.stdout is None:
            raise RuntimeError("gateway not started")
        deadline = time.monotonic() + timeout
        fd = proc.stdout.fileno()
        buf = b""
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError("the gateway did not print its address in time")
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.2))
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(f"the gateway exited early (code {proc.poll()})")
                buf += chunk
        line, _, rest = buf.partition(b"\n")
        if rest:
            self.output.append(rest.decode(errors="replace"))
        text = line.decode().strip()
        if not text.startswith("listening on "):
            raise RuntimeError(f"unexpected first line from the gateway: {text!r}")
        return text.removeprefix("listening on ")

    def _drain_stdout(self) -> None:
        proc = self.proc
        if proc is None or proc.stdout is None:
            return
        for line in proc.stdout:
            self.output.append(line.decode(errors="replace"))

    def _wait_healthy(self, timeout: float) -> None:
        """Until ``/healthz`` answers 200 (with N processes: until every shard is open)."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=2.0) as client:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the gateway exited during startup (code {self.proc.poll()})"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    up = client.get("/healthz").status_code == 200
                    if up and len(self.segments()) >= self.procs:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway's engine worker did not become ready in time")
                time.sleep(0.05)

    def segments(self) -> list[str]:
        """The gateway's segments in /dev/shm: its one cache, or its group's shards."""
        if self.procs == 1:
            return [n for n in segment_files(self.name) if n == f"aioshm-{self.name}"]
        prefix = f"aioshm-{self.name}.shard"
        return [n for n in files_with_prefix(prefix) if n.removeprefix(prefix).isdigit()]

    def cache_stats(self) -> dict[str, Any]:
        """The counters of every segment of the gateway, read from shared memory and summed.

        Why from shared memory: with N gateway processes a ``/stats`` call reaches one of
        them; the segments hold every process's counters.
        """
        total: Counter[str] = Counter()
        for seg in self.segments():
            try:
                snap, _alive = read_snapshot(seg)
            except (ShmCacheError, OSError, ValueError):
                continue  # going away right now
            for key in _SUMMED:
                total[key] += getattr(snap, key)
        out: dict[str, Any] = dict(total)
        looked_up = total["hits"] + total["misses"]
        out["hit_ratio"] = total["hits"] / looked_up if looked_up else 0.0
        return out

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the gateway (bounded); returns its exit code. Idempotent."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # whatever of its session is left (all of it after a timeout; an engine worker whose
        # gateway was killed): its own session, started for it, so nothing else is hit
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(5.0)
        if proc.stdout is not None:
            proc.stdout.close()
        if self._drain is not None:
            self._drain.join(1.0)
        self._remove_orphans()
        return proc.returncode

    def _remove_orphans(self) -> None:
        """If a gateway process died without cleaning up, remove its segment."""
        dead = sweep(dry_run=True)  # what lost its writer (nothing removed by this)
        for seg in self.segments():
            if seg in dead:
                remove(segment_files(seg))

    def __enter__(self) -> GatewayProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_SUMMED = (
    "hits",
    "misses",
    "sibling_hits",
    "inline_too_large",
    "inline_full",
    "evictions",
    "bytes_used",
    "items",
    "capacity_bytes",
)


# --- the load ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedRequest:
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
    item = preprocess(pixels, h, w)
    return {
        "mm_hash": image_hash(pixels, h, w),
        "crc32": tensor_crc(item),
        "shape": list(item["pixel_values"].shape),
    }


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

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else 0.0

    @property
    def throughput(self) -> float:
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def passed(self) -> bool:
        return self.requests > 0 and self.ok == self.requests and self.verified == self.requests

    def summary(self) -> dict[str, Any]:
        cache = self.cache
        return {
            "label": self.label,
            "requests": self.requests,
            "ok": self.ok,
            "failed": self.failed,
            "verified": self.verified,
            "throughput_rps": self.throughput,
            "p50_ms": self.percentile(50),
            "p95_ms": self.percentile(95),
            "p99_ms": self.percentile(99),
            "wall_s": self.wall_s,
            "preprocessed": self.preprocessed,
            "inline": self.inline,
            "drift_409": self.drift_409,
            "drift_resent_ok": self.drift_resent_ok,
            "retried": self.retried,
            "gateway_processes": self.gateway_processes,
            "hit_ratio": cache.get("hit_ratio", 0.0),
            **{key: cache.get(key, 0) for key in _SUMMED},
            "single_flight": dict(self.single_flight),
            "errors": dict(self.errors),
            "passed": self.passed,
        }


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

    res = PhaseResult(label, requests=len(plan))
    full = [
        {"mm_hash": e["mm_hash"], "pixels": base64.b64encode(p).decode(), "height": h, "width": w}
        for (p, h, w), e in zip(images, expected, strict=True)
    ]
    queue: asyncio.Queue[PlannedRequest] = asyncio.Queue()
    for r in plan:
        queue.put_nowait(r)
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

    async def client_task(client: httpx.AsyncClient) -> None:
        while True:
            try:
                req = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            try:
                r = await ask(client, req)
            except httpx.HTTPError as exc:
                res.failed += 1
                res.errors[type(exc).__name__] += 1
                _show(prog, label, len(plan), res)
                continue
            res.latencies_ms.append((time.perf_counter() - t0) * 1e3)
            if r.status_code != 200:
                res.failed += 1
                res.errors[f"HTTP {r.status_code}: {r.text[:120]}"] += 1
            else:
                body = r.json()
                ok, problem = check_response(body, expected[req.image])
                res.ok += 1
                res.preprocessed += bool(body.get("preprocessed"))
                res.inline += body.get("transport") == "inline"
                if ok:
                    res.verified += 1
                else:
                    res.errors[f"mismatch: {problem}"] += 1
            _show(prog, label, len(plan), res)

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.5)
            _show(prog, label, len(plan), res)

    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        t0 = time.perf_counter()
        tick = asyncio.ensure_future(ticker())
        try:
            await asyncio.gather(*(client_task(client) for _ in range(concurrency)))
        finally:
            tick.cancel()
        res.wall_s = time.perf_counter() - t0
        _show(prog, label, len(plan), res, final=True)
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            res.single_flight = (await client.get("/stats")).json()["single_flight"]
    return res


# --- the report ------------------------------------------------------------------------
def format_table(opts: DemoOptions, phases: Sequence[PhaseResult]) -> str:
    sums = [p.summary() for p in phases]

    def row(name: str, fn: Any) -> str:
        return f"  {name:<40}" + "".join(f"{fn(s):>22}" for s in sums)

    lines = [
        "",
        f"aioshmcache demo: {opts.requests} requests, {opts.concurrency} clients, {opts.images} "
        f"images (Zipf s={opts.zipf}), one image per request,",
        f"  the example gateway (examples/fastapi_app.py) and its engine worker, cache "
        f"{opts.cache_mb:g} MiB, max object {fmt_bytes(int(opts.max_object_mb * (1 << 20)))}",
        "",
        f"  {'':<40}" + "".join(f"{s['label']:>22}" for s in sums),
        row("requests ok / failed", lambda s: f"{s['ok']} / {s['failed']}"),
        row("answers verified (local compute)", lambda s: f"{s['verified']} / {s['requests']}"),
        row("throughput", lambda s: f"{s['throughput_rps']:.1f} req/s"),
        row(
            "latency p50 / p95 / p99",
            lambda s: f"{s['p50_ms']:.0f}/{s['p95_ms']:.0f}/{s['p99_ms']:.0f} ms",
        ),
        row("gateway processes", lambda s: str(s["gateway_processes"])),
        row("hit ratio", lambda s: f"{100 * s['hit_ratio']:.1f} %"),
        row("  copied from a sibling shard", lambda s: str(s["sibling_hits"])),
        row("images preprocessed", lambda s: f"{s['preprocessed']} / {s['requests']}"),
        row("preprocessings saved (single flight)", _saved_cell),
        row("sent inline (socket) / by reference", _transport_cell),
        row(
            "items inline: too large / full",
            lambda s: f"{s['inline_too_large']} / {s['inline_full']}",
        ),
        row("evictions", lambda s: str(s["evictions"])),
        row(
            "cache used / capacity",
            lambda s: (
                f"{s['bytes_used'] / (1 << 20):.1f} / {s['capacity_bytes'] / (1 << 20):.0f} MiB"
            ),
        ),
        row("items cached", lambda s: str(s["items"])),
        row(
            "hash-first 409s -> resent ok", lambda s: f"{s['drift_409']} -> {s['drift_resent_ok']}"
        ),
        row("retried (502/503: engine restarting)", lambda s: str(s["retried"])),
        "",
    ]
    for p in phases:
        for err, n in p.errors.most_common(5):
            lines.append(f"  {p.label}: {n} x {err}")
    return "\n".join(lines)


def _saved_cell(s: dict[str, Any]) -> str:
    """Single flight is per process: shown for one gateway process only."""
    sf = s["single_flight"]
    return str(sf.get("saved", "-")) if sf and s["gateway_processes"] == 1 else "-"


def _transport_cell(s: dict[str, Any]) -> str:
    return f"{s['inline']} / {s['ok'] - s['inline']}"


def _gateway_args(opts: DemoOptions, *, cache: bool) -> list[str]:
    args = ["--cache-mb", str(opts.cache_mb), "--max-object-mb", str(opts.max_object_mb)]
    args += ["--loop", opts.loop]
    return args if cache else [*args, "--no-cache"]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run the driver on uvloop when it is installed (less client overhead), else asyncio."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is an optional extra
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def run_demo(opts: DemoOptions) -> int:
    """The whole demo; 0 only if every request of every phase succeeded and matched."""
    phases: list[PhaseResult] = []
    n_gw = opts.gateway_workers
    configs = [("cache on", True, 1)]
    if n_gw > 1:  # the same load on N gateway processes (one cache group), next to 1
        configs.append((f"cache on, {n_gw} gw", True, n_gw))
    if opts.compare:
        configs.append(("cache off", False, 1))
    tag = f"demo-{os.getpid()}-{int(time.time()) % 100000}"
    t_start = time.perf_counter()
    images: list[tuple[bytes, int, int]] = []
    expected: list[dict[str, Any]] = []
    plan = plan_requests(
        opts.requests, opts.images, zipf=opts.zipf, seed=opts.seed, hash_first=opts.hash_first
    )
    gw: GatewayProcess | None = None
    boot: threading.Thread | None = None

    def on_sigterm(signum: int, frame: object) -> None:
        # the same clean shutdown as Ctrl-C: re-raised as SIGINT, so that a running event loop
        # (asyncio.Runner) cancels its main task instead of a KeyboardInterrupt landing in the
        # middle of a cancel scope's exit; without a loop it is a plain KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        for i, (label, cache, procs) in enumerate(configs):
            gw = GatewayProcess(_gateway_args(opts, cache=cache), name=f"{tag}-{i}", procs=procs)
            print(f"starting the gateway ({label}) ...", file=sys.stderr)
            if not images:  # make the images and their answers while the first gateway boots
                errors: list[BaseException] = []

                def start(g: GatewayProcess = gw, errs: list[BaseException] = errors) -> None:
                    try:
                        g.start()
                    except BaseException as exc:  # re-raised below, in the main thread
                        errs.append(exc)

                boot = threading.Thread(target=start, daemon=True)
                boot.start()
                images = [synthetic_image(opts.seed * 100_003 + k) for k in range(opts.images)]
                expected = [expected_answer(im) for im in images]
                boot.join()
                boot = None
                if errors:
                    raise errors[0]
            else:
                gw.start()
            print(f"gateway at {gw.url} (pid {gw.pid}, cache {gw.name})", file=sys.stderr)
            res = _run(
                run_load(
                    gw.url,
                    plan,
                    images,
                    expected,
                    concurrency=opts.concurrency,
                    label=label,
                    progress=opts.progress,
                    use_hashes=cache,
                )
            )
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
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        if boot is not None:  # interrupted while the gateway was booting: let it finish first
            boot.join(70.0)
        if gw is not None:
            gw.stop()
    print(format_table(opts, phases))
    passed = all(p.passed for p in phases)
    total = sum(p.requests for p in phases)
    elapsed = time.perf_counter() - t_start
    if passed:
        print(
            f"PASS: all {total} requests succeeded and matched the local computation "
            f"({elapsed:.1f} s)"
        )
    else:
        print(
            f"FAIL: {sum(p.requests - p.verified for p in phases)} of {total} requests failed "
            f"or did not match ({elapsed:.1f} s)"
        )
    if opts.json_path:
        with open(opts.json_path, "w") as f:
            summary = {"options": asdict(opts), "phases": [p.summary() for p in phases]}
            json.dump({**summary, "passed": passed}, f, indent=2)
    return 0 if passed else 1

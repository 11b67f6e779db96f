"""The demo's load driver: start the gateway, drive a realistic load, verify, print a table.

The load: ``images`` distinct synthetic photos (seeded numpy + Pillow; PNG and JPEG, 96-576 px),
whose popularity follows a Zipf law (a few hot images, a long tail), 1..``max_per_request``
images per request, half as JSON with base64 and half as multipart uploads, from
``concurrency`` clients sharing one ``httpx.AsyncClient``. A share of requests whose images were
all sent before first try hashes only (a client that trusts the server still holds them); a
409 then makes the client resend the missing ones with their bytes, as an engine client would.

Every response is checked against :func:`~aioshmcache.tools.demo.imaging.expected_summary` computed
locally from the same bytes: shape, patch grid, token count, the CRC-32 of the tensors and the
embedding, for every worker that answered (in broadcast mode, every worker).

The gateway runs in its own process (``python -m aioshmcache demo serve``, in its own session so
that Ctrl-C reaches only this driver, which then stops it: SIGTERM, then SIGKILL after a
deadline). The same load runs a second time against a gateway with the cache off, and the two
are printed side by side.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any, TypeVar

import httpx
import numpy as np

from aioshmcache import sweep

from ..progress import Progress
from ..shm import files_with_prefix, remove, segment_files
from ..units import fmt_bytes
from .group import GROUP_STATS_LINE
from .imaging import ProcessorConfig, expected_summary, synthetic_image
from .pool import SOCKET_DIR_PREFIX
from .settings import DemoOptions, GatewaySettings

__all__ = [
    "DemoOptions",
    "GatewayProcess",
    "PhaseResult",
    "PlannedRequest",
    "check_response",
    "make_images",
    "plan_requests",
    "run_demo",
    "run_load",
]

T = TypeVar("T")
_PNG = b"\x89PNG"


# --- the gateway process -------------------------------------------------------------------
class GatewayProcess:
    """``python -m aioshmcache demo serve ...`` as a child process, with a bounded stop.

    ``start`` waits for the URL line and then for ``/healthz`` to answer 200 (workers attached).
    ``stop`` sends SIGTERM (graceful: workers stopped, segment unlinked), SIGKILL after
    ``timeout``, and finally sweeps the segment if the gateway could not remove it itself.
    """

    def __init__(self, args: Sequence[str], *, name: str, stderr: IO[Any] | None = None) -> None:
        self.args = list(args)
        self.name = name if name.startswith("aioshm-") else f"aioshm-{name}"
        self.stderr = stderr
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.output: list[str] = []
        self._drain: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> str:
        cmd = [
            sys.executable,
            "-m",
            "aioshmcache",
            "demo",
            "serve",
            "--port",
            "0",
            "--name",
            self.name,
            "--exit-with-parent",
            *self.args,
        ]
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
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=2.0) as client:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the gateway exited during startup (code {self.proc.poll()})"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/healthz").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway's workers did not become ready in time")
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def stop(self, timeout: float = 15.0) -> int | None:
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
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its workers share its session
                proc.wait(5.0)
        if proc.stdout is not None:
            proc.stdout.close()
        if self._drain is not None:
            self._drain.join(1.0)
        self._remove_orphan()
        return proc.returncode

    def group_stats(self) -> dict[str, Any] | None:
        """``--gateway-workers``: the merged stats the serving process printed on its way out."""
        for chunk in reversed(self.output):
            for line in chunk.splitlines():
                if line.startswith(GROUP_STATS_LINE):
                    got: dict[str, Any] = json.loads(line.removeprefix(GROUP_STATS_LINE))
                    return got
        return None

    def _remove_orphan(self) -> None:
        """If the gateway died without cleaning up, remove its segment and socket directory."""
        pattern = os.path.join(tempfile.gettempdir(), f"{SOCKET_DIR_PREFIX}{self.name}-*")
        for d in glob.glob(pattern):
            shutil.rmtree(d, ignore_errors=True)
        dead = sweep(dry_run=True)  # what lost its writer (nothing removed by this)
        for seg in [self.name, *files_with_prefix(self.name + ".shard")]:
            if seg in dead:  # the segment (or a group shard) of a gateway that died
                remove(segment_files(seg))

    def __enter__(self) -> GatewayProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the load ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedRequest:
    images: tuple[int, ...]
    multipart: bool
    hash_first: bool


def make_images(n: int, seed: int) -> list[bytes]:
    """``n`` distinct synthetic images (PNG and JPEG, random sizes), reproducible from ``seed``."""
    return [synthetic_image(seed * 100_003 + i) for i in range(n)]


def plan_requests(
    n_requests: int,
    n_images: int,
    *,
    max_per_request: int,
    zipf: float,
    seed: int,
    hash_first: float,
) -> list[PlannedRequest]:
    """A reproducible request mix: Zipf popularity, 1..max images, JSON or multipart."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, n_images + 1, dtype=np.float64)
    log_p = -zipf * np.log(ranks)
    popularity = rng.permutation(n_images)  # which image has which rank
    k_max = min(max_per_request, n_images)
    sizes = rng.integers(1, k_max + 1, size=n_requests)
    multipart = rng.random(n_requests) < 0.5
    try_hash = rng.random(n_requests) < hash_first
    seen: set[int] = set()
    plan = []
    for start in range(0, n_requests, 4096):
        # Gumbel top-k: k distinct images per request, drawn in proportion to their Zipf weight
        keys = log_p + rng.gumbel(size=(min(4096, n_requests - start), n_images))
        top = np.argsort(-keys, axis=1)[:, :k_max]
        for j, row in enumerate(top.tolist(), start):
            picks = tuple(int(popularity[r]) for r in row[: sizes[j]])
            hf = bool(try_hash[j]) and all(i in seen for i in picks)
            plan.append(PlannedRequest(picks, bool(multipart[j]), hf))
            seen.update(picks)
    return plan


@dataclass
class PhaseResult:
    label: str
    requests: int = 0
    ok: int = 0
    failed: int = 0
    verified: int = 0
    worker_checks: int = 0
    worker_checks_ok: int = 0
    drift_409: int = 0
    drift_resent_ok: int = 0
    wall_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    stats: dict[str, Any] = field(default_factory=dict)
    gateway_processes: int = 1

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else 0.0

    @property
    def throughput(self) -> float:
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def passed(self) -> bool:
        return (
            self.requests > 0
            and self.ok == self.requests
            and self.verified == self.requests
            and self.worker_checks_ok == self.worker_checks
        )

    def summary(self) -> dict[str, Any]:
        cache = self.stats.get("cache", {})
        gw = self.stats.get("gateway", {})
        return {
            "label": self.label,
            "requests": self.requests,
            "ok": self.ok,
            "failed": self.failed,
            "verified": self.verified,
            "worker_checks": self.worker_checks,
            "worker_checks_ok": self.worker_checks_ok,
            "throughput_rps": self.throughput,
            "p50_ms": self.percentile(50),
            "p95_ms": self.percentile(95),
            "p99_ms": self.percentile(99),
            "wall_s": self.wall_s,
            "drift_409": self.drift_409,
            "drift_resent_ok": self.drift_resent_ok,
            "gateway_processes": self.gateway_processes,
            "hit_ratio": cache.get("hit_ratio", 0.0),
            "sibling_hits": cache.get("sibling_hits", 0),
            "hits": cache.get("hits", 0),
            "misses": cache.get("misses", 0),
            "inline_too_large": cache.get("inline_too_large", 0),
            "inline_full": cache.get("inline_full", 0),
            "evictions": cache.get("evictions", 0),
            "bytes_used": cache.get("bytes_used", 0),
            "capacity_bytes": cache.get("capacity_bytes", 0),
            "items": cache.get("items", 0),
            "single_flight": dict(self.stats.get("single_flight", {})),
            "preprocessed": gw.get("preprocessed", 0),
            "preprocess_skipped": gw.get("preprocess_skipped", 0),
            "bytes_from_cache": gw.get("bytes_from_cache", 0),
            "bytes_put": gw.get("bytes_put", 0),
            "bytes_inline": gw.get("bytes_inline", 0),
            "loop_lag_p99_ms": self.stats.get("loop_lag", {}).get("p99_ms", 0.0),
            "loop_lag_max_ms": self.stats.get("loop_lag", {}).get("max_ms", 0.0),
            "worker_restarts": self.stats.get("worker_restarts", 0),
            "errors": dict(self.errors),
            "passed": self.passed,
        }


def check_response(
    body: dict[str, Any], sent: Sequence[str], expected: dict[str, dict[str, Any]], n_workers: int
) -> tuple[bool, int, int, str]:
    """Check one 200 answer: (verified, worker checks, worker checks matched, first problem)."""
    problem = ""
    images = body.get("images", [])
    if sorted(im.get("mm_hash") for im in images) != sorted(sent):
        problem = "the answer's images are not the ones sent"
    checks = matched = 0
    workers = body.get("workers", [])
    if len(workers) != n_workers:
        problem = problem or f"{len(workers)} workers answered, expected {n_workers}"
    for w in workers:
        for res in w.get("results", []):
            checks += 1
            exp = expected.get(res.get("mm_hash", ""))
            if exp is None:
                problem = problem or "a worker answered for an unknown image"
                continue
            same = (
                res["shape"] == exp["shape"]
                and res["grid_thw"] == exp["grid_thw"]
                and res["crc32"] == exp["crc32"]
                and res["num_image_tokens"] == exp["num_image_tokens"]
                and np.allclose(res["embedding"], exp["embedding"], rtol=1e-6, atol=1e-9)
            )
            if same:
                matched += 1
            else:
                problem = problem or f"worker {w.get('worker')} disagrees on {res['mm_hash']}"
    for im in images:
        exp = expected.get(im.get("mm_hash", ""))
        if exp is None or im.get("crc32") != exp["crc32"]:
            problem = problem or "an image's checksum is wrong"
    return not problem, checks, matched, problem


def _show(prog: Progress, label: str, total: int, res: PhaseResult, final: bool = False) -> None:
    done = res.ok + res.failed
    rate = res.ok / max(1e-9, prog.elapsed())
    line = f"[{label}] {done}/{total} requests, {res.failed} failed, {rate:.1f} req/s"
    prog.update(line, done / max(1, total), final=final)


async def run_load(
    url: str,
    plan: Sequence[PlannedRequest],
    images: Sequence[bytes],
    expected: Sequence[dict[str, Any]],
    *,
    concurrency: int,
    n_workers: int,
    label: str,
    progress: bool = True,
    use_hashes: bool = True,
) -> PhaseResult:
    """Drive ``plan`` at the gateway with ``concurrency`` clients; check every answer."""
    res = PhaseResult(label, requests=len(plan))
    by_hash = {e["mm_hash"]: e for e in expected}
    hashes = [e["mm_hash"] for e in expected]
    b64 = [base64.b64encode(b).decode() for b in images]
    names = [f"img{i}.{'png' if b.startswith(_PNG) else 'jpg'}" for i, b in enumerate(images)]
    queue: asyncio.Queue[PlannedRequest] = asyncio.Queue()
    for r in plan:
        queue.put_nowait(r)
    prog = Progress(enabled=progress)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def send(
        client: httpx.AsyncClient, req: PlannedRequest, with_data: set[int]
    ) -> httpx.Response:
        if req.multipart:
            files = [("images", (names[i], images[i])) for i in req.images if i in with_data]
            data: dict[str, Any] = {"prompt": f"Describe these {len(req.images)} images."}
            only = [hashes[i] for i in req.images if i not in with_data]
            if only:
                data["mm_hashes"] = only
            return await client.post("/v1/generate/upload", data=data, files=files or None)
        body = {
            "prompt": f"Describe these {len(req.images)} images.",
            "images": [
                {"data": b64[i]} if i in with_data else {"mm_hash": hashes[i]} for i in req.images
            ],
        }
        return await client.post("/v1/generate", json=body)

    async def client_task(client: httpx.AsyncClient) -> None:
        while True:
            try:
                req = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            try:
                all_data = set(req.images)
                if req.hash_first and use_hashes:
                    with_data: set[int] = set()
                    r = await send(client, req, with_data)
                    for _ in range(3):  # more of them may be evicted meanwhile: resend again
                        if r.status_code != 409:
                            break
                        res.drift_409 += 1
                        missing = set(r.json().get("missing", ()))
                        with_data |= {i for i in req.images if hashes[i] in missing}
                        r = await send(client, req, with_data)
                        if r.status_code == 200:
                            res.drift_resent_ok += 1
                else:
                    r = await send(client, req, all_data)
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
                ok, checks, matched, problem = check_response(
                    r.json(), [hashes[i] for i in req.images], by_hash, n_workers
                )
                res.ok += 1
                res.worker_checks += checks
                res.worker_checks_ok += matched
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
        with contextlib.suppress(httpx.HTTPError):
            await client.post("/stats/reset")
        t0 = time.perf_counter()
        tick = asyncio.ensure_future(ticker())
        try:
            await asyncio.gather(*(client_task(client) for _ in range(concurrency)))
        finally:
            tick.cancel()
        res.wall_s = time.perf_counter() - t0
        _show(prog, label, len(plan), res, final=True)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            res.stats = (await client.get("/stats")).json()
    return res


# --- the report ------------------------------------------------------------------------
def format_table(opts: DemoOptions, phases: Sequence[PhaseResult]) -> str:
    sums = [p.summary() for p in phases]

    def row(name: str, fn: Any) -> str:
        return f"  {name:<40}" + "".join(f"{fn(s):>22}" for s in sums)

    lines = [
        "",
        f"aioshmcache demo: {opts.requests} requests, {opts.concurrency} clients, {opts.images} "
        f"images (Zipf s={opts.zipf}), 1-{opts.max_per_request} images/request,",
        f"  {opts.workers} workers ({opts.delivery}), cache {opts.cache_mb:g} MiB, "
        f"max object {fmt_bytes(_max_object_bytes(opts))}",
        "",
        f"  {'':<40}" + "".join(f"{s['label']:>22}" for s in sums),
        row("requests ok / failed", lambda s: f"{s['ok']} / {s['failed']}"),
        row("answers verified (local compute)", lambda s: f"{s['verified']} / {s['requests']}"),
        row("worker checks matched", lambda s: f"{s['worker_checks_ok']} / {s['worker_checks']}"),
        row("throughput", lambda s: f"{s['throughput_rps']:.1f} req/s"),
        row(
            "latency p50 / p95 / p99",
            lambda s: f"{s['p50_ms']:.0f}/{s['p95_ms']:.0f}/{s['p99_ms']:.0f} ms",
        ),
        row("gateway processes", lambda s: str(s["gateway_processes"])),
        row("hit ratio", lambda s: f"{100 * s['hit_ratio']:.1f} %"),
        row("  copied from a sibling shard", lambda s: str(s["sibling_hits"])),
        row(
            "images preprocessed / skipped",
            lambda s: f"{s['preprocessed']} / {s['preprocess_skipped']}",
        ),
        row("preprocessings saved (single flight)", _saved_cell),
        row("single flight: calls = hits+runs+saved", _flight_cell),
        row("bytes served from cache", lambda s: fmt_bytes(s["bytes_from_cache"])),
        row("bytes copied into cache", lambda s: fmt_bytes(s["bytes_put"])),
        row("bytes sent inline (socket)", lambda s: fmt_bytes(s["bytes_inline"])),
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
        row("drift 409s -> resent ok", lambda s: f"{s['drift_409']} -> {s['drift_resent_ok']}"),
        row(
            "gateway loop lag p99 / max",
            lambda s: f"{s['loop_lag_p99_ms']:.1f}/{s['loop_lag_max_ms']:.1f} ms",
        ),
        row("worker restarts", lambda s: str(s["worker_restarts"])),
        "",
    ]
    for p in phases:
        for err, n in p.errors.most_common(5):
            lines.append(f"  {p.label}: {n} x {err}")
    return "\n".join(lines)


def _saved_cell(s: dict[str, Any]) -> str:
    sf = s["single_flight"]
    return str(sf["saved"]) if sf else "-"


def _flight_cell(s: dict[str, Any]) -> str:
    """``calls = hits+runs+saved``; the rest (failed with a flight, cancelled) in brackets."""
    sf = s["single_flight"]
    if not sf:
        return "-"
    rest = sf["calls"] - sf["hits"] - sf["runs"] - sf["saved"]
    cell = f"{sf['calls']} = {sf['hits']}+{sf['runs']}+{sf['saved']}"
    return cell + (f" (+{rest})" if rest else "")


def _max_object_bytes(opts: DemoOptions) -> int:
    return GatewaySettings(max_object_mb=opts.max_object_mb).max_object_bytes


def _gateway_args(opts: DemoOptions, *, cache: bool) -> list[str]:
    args = [
        "--workers",
        str(opts.workers),
        "--delivery",
        opts.delivery,
        "--cache-mb",
        str(opts.cache_mb),
        "--loop",
        opts.loop,
    ]
    if opts.max_object_mb is not None:
        args += ["--max-object-mb", str(opts.max_object_mb)]
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
    processor = ProcessorConfig()
    phases: list[PhaseResult] = []
    n_gw = opts.gateway_workers
    configs = [("cache on", True, 1)]
    if n_gw > 1:  # the same load on N gateway processes (one cache group), next to 1
        configs.append((f"cache on, {n_gw} gw", True, n_gw))
    if opts.compare:
        configs.append(("cache off", False, 1))
    tag = f"demo-{os.getpid()}-{int(time.time()) % 100000}"
    t_start = time.perf_counter()
    images: list[bytes] = []
    expected: list[dict[str, Any]] = []
    plan = plan_requests(
        opts.requests,
        opts.images,
        max_per_request=opts.max_per_request,
        zipf=opts.zipf,
        seed=opts.seed,
        hash_first=opts.hash_first,
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
            args = [*_gateway_args(opts, cache=cache), "--gateway-workers", str(procs)]
            gw = GatewayProcess(args, name=f"{tag}-{i}")
            print(f"starting the gateway ({label}, {opts.workers} workers) ...", file=sys.stderr)
            if not images:  # generate the images while the first gateway boots
                errors: list[BaseException] = []

                def start(g: GatewayProcess = gw, errs: list[BaseException] = errors) -> None:
                    try:
                        g.start()
                    except BaseException as exc:  # re-raised below, in the main thread
                        errs.append(exc)

                boot = threading.Thread(target=start, daemon=True)
                boot.start()
                images = make_images(opts.images, opts.seed)
                expected = [expected_summary(b, processor) for b in images]
                boot.join()
                boot = None
                if errors:
                    raise errors[0]
            else:
                gw.start()
            print(
                f"gateway at {gw.url} (pid {gw.pid}, segment {gw.name}), "
                f"{len(images)} images ready",
                file=sys.stderr,
            )
            n_targets = opts.workers if opts.delivery == "broadcast" else 1
            res = _run(
                run_load(
                    gw.url,
                    plan,
                    images,
                    expected,
                    concurrency=opts.concurrency,
                    n_workers=n_targets,
                    label=label,
                    progress=opts.progress,
                    use_hashes=cache,
                )
            )
            phases.append(res)
            gw.stop()
            if procs > 1:  # one /stats call reached one process: the group's merged stats
                merged = gw.group_stats()
                if merged is None:
                    raise RuntimeError("the gateway processes did not report their stats")
                res.stats = merged
            res.gateway_processes = procs
            gw = None
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the gateway and its workers ...", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        if boot is not None:  # interrupted while the gateway was booting: let it finish first
            boot.join(40.0)
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
            json.dump(
                {
                    "options": asdict(opts),
                    "phases": [p.summary() for p in phases],
                    "passed": passed,
                },
                f,
                indent=2,
            )
    return 0 if passed else 1

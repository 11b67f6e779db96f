"""The round trip, ours and the peers': writer → another process (or server) → reply.

* aioshmcache: the writer ``put``s the array, sends the ``ShmRef`` over a ``Pipe`` to a reader
  process, which reads it (a copy, or a lease: zero-copy view + ack) and replies its size.
* ``multiprocessing.Pipe`` / ``Queue``: the array goes to the other process, which replies its
  size (the same shape of work as ours) or echoes the array back (the "echo" rows).
* Redis: a real ``redis-server`` (Debian's), started here on 127.0.0.1 on a free port without
  persistence and stopped afterwards; ``SET`` then ``GET`` through ``redis.asyncio`` on uvloop.
* Ray (if installed): ``ray.get(ray.put(arr))`` in this process; Ray's ``get`` of a numpy array
  is itself a zero-copy view of its object store. ``ray.init`` starts several daemons that load
  the machine, so Ray runs in a phase of its own, with our round trip measured again alongside
  it: the ratios against Ray come from that phase.

Every mechanism is measured in interleaved runs with the others and with the ``np.copyto``
baseline of the same size.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from aioshmcache import ShmObjectStore

from ..progress import Progress
from ..units import MiB, fmt_bytes
from .params import Params, bench_config
from .procs import LazyWorker, Worker
from .report import Report, Target
from .timing import Samples, ShmBuffer, memcpy_into, source_array, timed

__all__ = ["run_peers_suite"]

S_RT = "Round trip: writer → reader process → reply, vs peers"
S_RAY = "Round trip vs Ray (measured while Ray runs)"

_clock = time.perf_counter_ns

Op = Callable[[], None]


# --- redis-server ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """A private ``redis-server`` on 127.0.0.1, no persistence; ``stop`` ends it."""

    def __init__(self, binary: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
                "--loglevel",
                "warning",
                "--dir",
                "/tmp",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10.0
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited at start: {err.strip()[:300]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("redis-server did not answer PING within 10 s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


class RedisClient:
    """``redis.asyncio`` on its own (uvloop) event loop, driven synchronously per run."""

    def __init__(self, port: int) -> None:
        import redis.asyncio

        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            self.loop_name = "uvloop"
        except ImportError:
            self.loop = asyncio.new_event_loop()
            self.loop_name = "asyncio"
        self.client: Any = redis.asyncio.Redis(host="127.0.0.1", port=port)
        self.loop.run_until_complete(self.client.ping())

    def set_get(self, arr: Any, n: int, out: list[float]) -> None:
        import numpy as np

        async def run() -> None:
            c = self.client
            data = memoryview(arr)  # redis-py sends bytes-like values as they are
            for _ in range(n):
                t0 = _clock()
                await c.set("bench", data)
                raw = await c.get("bench")
                back = np.frombuffer(raw, dtype=np.uint8)
                out.append((_clock() - t0) * 1e-9)
                if back.nbytes != arr.nbytes:
                    raise RuntimeError("redis returned a different size")

        self.loop.run_until_complete(run())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.client.delete("bench"))
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


@contextlib.contextmanager
def redis_peer(report: Report, progress: Progress) -> Iterator[RedisClient | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        report.skip("redis: redis-server is not installed (apt-get install redis-server)")
        yield None
        return
    try:
        importlib.import_module("redis.asyncio")
    except ImportError:
        report.skip("redis: the redis client is not installed (pip install 'aioshmcache[bench]')")
        yield None
        return
    progress(f"redis: starting {binary} on 127.0.0.1")
    try:
        server = RedisServer(binary)
    except (OSError, RuntimeError) as exc:
        report.skip(f"redis: redis-server would not start here ({exc})")
        yield None
        return
    client: RedisClient | None = None
    try:
        client = RedisClient(server.port)
        yield client
    finally:
        if client is not None:
            client.close()
        server.stop()


# --- aioshmcache round trip and the multiprocessing peers ----------------------------------------


class OurRoundTrip:
    """Writer puts, the worker (a reader process) reads the ``ShmRef`` it is sent and replies."""

    def __init__(self, worker: Worker, size: int) -> None:
        self.worker = worker
        ring = max(8 * MiB, 6 * (size + 4096))
        self.store = ShmObjectStore.create(bench_config(ring, size + 64 * 1024, 1))
        self.seq = 0
        worker.attach(self.store.handle())
        self.mode: str | None = None

    def _serve(self, mode: str) -> None:
        if self.mode != mode:
            self.stop_serving()
            self.worker.send("serve_refs", mode)
            self.mode = mode

    def stop_serving(self) -> None:
        if self.mode is not None:
            self.worker.send_refs(None)
            self.worker.reply()
            self.mode = None

    def run(self, mode: str, item: dict[str, Any], n: int, out: list[float]) -> None:
        self._serve(mode)
        store, conn = self.store, self.worker.conn
        for _ in range(n):
            key = f"rt{self.seq}"
            self.seq += 1
            t0 = _clock()
            conn.send(store.put(key, item))
            nb = conn.recv()
            out.append((_clock() - t0) * 1e-9)
            if not isinstance(nb, int):
                raise RuntimeError(f"bench worker: {nb!r}")

    def close(self) -> None:
        try:
            self.stop_serving()
            self.worker.detach()
        finally:
            self.store.close()


def _pipe(worker: Worker, echo: bool, arr: Any, n: int, out: list[float]) -> None:
    worker.send("pipe_echo", echo)
    conn = worker.conn
    for _ in range(n):
        t0 = _clock()
        conn.send(arr)
        conn.recv()
        out.append((_clock() - t0) * 1e-9)
    conn.send(None)
    worker.reply()


def _queue(worker: Worker, echo: bool, arr: Any, n: int, out: list[float]) -> None:
    worker.send("queue_echo", echo)
    q_in, q_out = worker.q_in, worker.q_out
    for _ in range(n):
        t0 = _clock()
        q_in.put(arr)
        q_out.get(timeout=120.0)
        out.append((_clock() - t0) * 1e-9)
    q_in.put(None)
    worker.reply()


_SERIES = {
    "np.copyto (baseline)": "np.copyto (baseline)",
    "aioshmcache (reader copies)": "aioshmcache (copy)",
    "aioshmcache (reader leases)": "aioshmcache (lease)",
    "Pipe (array → reader, size back)": "Pipe",
    "Queue (array → reader, size back)": "Queue",
    "Pipe echo (array both ways)": "Pipe echo",
    "Queue echo (array both ways)": "Queue echo",
}


def bench_roundtrip(
    p: Params, report: Report, progress: Progress, worker: Worker, redis: RedisClient | None
) -> None:
    shm = ShmBuffer(max(p.peer_sizes))
    try:
        for size in p.peer_sizes:
            progress(
                f"round trip: {fmt_bytes(size)}, aioshmcache vs Pipe / Queue"
                + (" / redis" if redis else "")
                + f" ({p.runs} runs)"
            )
            _roundtrip_one(p, report, worker, redis, shm, size)
    finally:
        shm.close()


def _roundtrip_one(
    p: Params,
    report: Report,
    worker: Worker,
    redis: RedisClient | None,
    shm: ShmBuffer,
    size: int,
) -> None:
    n = p.n_ops(size, peers=True)
    arr = source_array(size)
    item = {"data": arr}
    names = [
        "np.copyto (baseline)",
        "aioshmcache (reader copies)",
        "aioshmcache (reader leases)",
        "Pipe (array → reader, size back)",
        "Queue (array → reader, size back)",
        "Pipe echo (array both ways)",
        "Queue echo (array both ways)",
    ]
    if redis is not None:
        names.append(f"redis.asyncio SET + GET ({redis.loop_name})")
    samples = {k: Samples() for k in names}
    ours = OurRoundTrip(worker, size)
    try:
        ours.run("copy", item, max(2, n // 5), [])  # warm-up: both processes, the pipe, the ring
        ours.run("lease", item, max(2, n // 5), [])
        for _ in range(p.runs):
            memcpy_into(shm.view(size), arr, n, samples[names[0]].new_run())
            ours.run("copy", item, n, samples[names[1]].new_run())
            ours.run("lease", item, n, samples[names[2]].new_run())
            ours.stop_serving()
            _pipe(worker, False, arr, n, samples[names[3]].new_run())
            _queue(worker, False, arr, n, samples[names[4]].new_run())
            _pipe(worker, True, arr, n, samples[names[5]].new_run())
            _queue(worker, True, arr, n, samples[names[6]].new_run())
            if redis is not None:
                redis.set_get(arr, n, samples[names[7]].new_run())
    finally:
        ours.close()
    sz = fmt_bytes(size)
    base = samples[names[0]].stat()
    stats = {k: v.stat() for k, v in samples.items()}
    for k in names:
        series = _SERIES.get(k, k.split(" (")[0])
        vs = None if k == names[0] else ("np.copyto", base)
        report.row(S_RT, k, sz, stats[k], vs=vs, plot="roundtrip", series=series, x=size)
    # aioshmcache against each peer, same size, same runs
    for mode, key in (("reader copies", names[1]), ("reader leases", names[2])):
        mine = stats[key].median
        for peer in names[3:]:
            if "echo" in peer:
                continue
            tgt = None
            if size == 16 * MiB and peer.startswith("redis"):
                tgt = Target("ratio", ">=", 20.0)
            short = peer.split(" (")[0]
            label = f"aioshmcache ({mode}) vs {short}"
            report.row(S_RT, label, sz, mine, vs=(short, stats[peer]), target=tgt)


# --- Ray --------------------------------------------------------------------------------------


def bench_ray(p: Params, report: Report, progress: Progress, worker: Worker, *, want: bool) -> None:
    if not want:
        report.skip("Ray: skipped (--quick skips it unless --ray is given: ray.init takes ~5 s)")
        return
    try:
        ray: Any = importlib.import_module("ray")
    except ImportError:
        report.skip("Ray: not installed (pip install ray) — the Ray comparison is skipped")
        return
    progress("Ray: ray.init (starts its daemons, ~5 s)")
    import numpy as np

    biggest = max(p.peer_sizes)
    temp = tempfile.mkdtemp(prefix="aioshmbench-ray-")  # Ray's sessions and logs: removed after
    try:
        ray.init(
            num_cpus=1,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=max(512 * MiB, 8 * biggest),
            logging_level="ERROR",
            _temp_dir=temp,
        )
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    try:
        ray.get(ray.put(np.zeros(16, np.uint8)))
        for size in p.peer_sizes:
            progress(
                f"Ray: {fmt_bytes(size)}, ray.get(ray.put(arr)) vs aioshmcache ({p.runs} runs)"
            )
            n = p.n_ops(size, peers=True)
            arr = source_array(size)
            item = {"data": arr}
            ray_s, copy_s, lease_s = Samples(), Samples(), Samples()
            ours = OurRoundTrip(worker, size)
            try:
                ours.run("lease", item, 2, [])
                for _ in range(max(2, n // 5)):
                    ray.get(ray.put(arr))
                for _ in range(p.runs):
                    run = ray_s.new_run()
                    for _ in range(n):
                        timed(run, _ray_round_trip, ray, arr)
                    ours.run("copy", item, n, copy_s.new_run())
                    ours.run("lease", item, n, lease_s.new_run())
            finally:
                ours.close()
            sz = fmt_bytes(size)
            rs = ray_s.stat()
            report.row(
                S_RAY,
                "Ray ray.get(ray.put(arr)) (one process)",
                sz,
                rs,
                plot="roundtrip",
                series="Ray put + get",
                x=size,
            )
            tgt = Target("ratio", ">=", 1.5) if size == 16 * MiB else None
            for label, smp in (("reader copies", copy_s), ("reader leases", lease_s)):
                report.row(
                    S_RAY,
                    f"aioshmcache ({label}) vs Ray put + get",
                    sz,
                    smp.stat(),
                    vs=("Ray", rs),
                    target=tgt,
                )
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _ray_round_trip(ray: Any, arr: Any) -> None:
    """``ray.get(ray.put(arr))``: Ray's put and (zero-copy) get of one array."""
    ray.get(ray.put(arr))


def run_peers_suite(
    p: Params, report: Report, progress: Progress, *, want_ray: bool, want_redis: bool = True
) -> None:
    with LazyWorker() as lw:
        if want_redis:
            with redis_peer(report, progress) as redis:
                ok = report.attempt(
                    "round trip", lambda: bench_roundtrip(p, report, progress, lw.get(), redis)
                )
        else:
            ok = report.attempt(
                "round trip", lambda: bench_roundtrip(p, report, progress, lw.get(), None)
            )
        if not ok:
            lw.reset()
        report.attempt("Ray", lambda: bench_ray(p, report, progress, lw.get(), want=want_ray))

"""Issue 29: machine instructions per channel round trip, one side at a time (callgrind).

``python bench/bench_channel_ir.py [--side gateway|worker] [--calls N] [--base M]`` runs the
gateway and the engine worker of ``bench_channel.py``'s ``channel ref`` row (a 1 KiB item by
reference: the gateway's hand-out, ``cache.get_and_update_features([FeatureSpec(h, None)])``,
then ``engine.call([f], payload)``; the worker, ``serve_engine`` with an ``AsyncReceiverCache``
over the sender's handle, copies the item out and answers ``{"n": bytes}``), uvloop on both
sides, with ONE side under ``valgrind --tool=callgrind``, twice: ``N`` sequential calls and
``M`` (after the same warm-up). It prints ``(Ir(N) - Ir(M)) / (N - M)``: instructions per round
trip of that side (the whole process, every thread), which do not depend on the machine's load
as a wall clock does on a shared machine. ``OPENBLAS_NUM_THREADS=1``: numpy's BLAS threads
otherwise spin, and their instructions grow with the run's length.

The async faces' checkpoint rule (``aio.CHECKPOINT_AFTER``: an awaitable call yields to the loop
when 0.5 ms have passed since it last did) is set out of reach in both processes: under
valgrind every call runs ~50x slower, so the rule would fire on every call (a loop round and
the request's slow path on each hand-out and read), which it does not in a real run (calls
~50-100 us apart). The count rule (``CHECKPOINT_EVERY``) stays.

``--inner-gateway N SIDE TMP`` and ``--inner-worker HANDLE PATH`` are the two processes (what
valgrind executes); the gateway starts the worker and stops it (SIGTERM) after its calls.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench_lean_ir import callgrind_total  # this directory: run as a script

WARM = 300
KiB = 1 << 10
_ENV = {"OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _steady() -> None:
    """The checkpoint rule's time bound out of reach (module docstring)."""
    import aioshmcache.aio

    aioshmcache.aio.CHECKPOINT_AFTER = 1e9  # type: ignore[misc]


def _valgrind(out: str) -> list[str]:
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]


async def _read_n(features: list[Any], payload: Any) -> dict[str, int]:
    return {"n": sum(int(f.data["x"].nbytes) for f in features)}


def inner_worker(handle: str, path: str) -> None:
    """The engine worker: ``serve_engine`` until SIGTERM; prints ``ready`` once it listens."""
    import uvloop

    from aioshmcache import AsyncReceiverCache
    from aioshmcache.channel import serve_engine

    _steady()

    def ready() -> None:
        print("ready", flush=True)

    async def main() -> None:
        async with AsyncReceiverCache.attach(handle) as rx:
            await serve_engine(path, _read_n, rx, shutdown_signals=(signal.SIGTERM,), ready=ready)

    uvloop.run(main())


def inner_gateway(calls: int, side: str, tmp: str) -> None:
    """The gateway: start the worker (under valgrind for ``side == "worker"``), ``WARM`` calls,
    then ``calls`` more; stop the worker and wait for it (its callgrind output is then written)."""
    import numpy as np
    import uvloop

    from aioshmcache import AsyncSenderCache, CacheConfig, FeatureSpec
    from aioshmcache.channel import EngineClient

    _steady()
    path = os.path.join(tmp, "engine.sock")
    item = {"x": np.random.default_rng(1).integers(0, 255, KiB, np.uint8)}

    async def main() -> None:
        config = CacheConfig(64 << 20, 16 << 20, 1, name=f"bench-chir-{os.getpid()}")
        async with AsyncSenderCache.from_config(config) as cache:
            cmd = [sys.executable, __file__, "--inner-worker", cache.handle().to_json(), path]
            if side == "worker":
                cmd = _valgrind(os.path.join(tmp, f"worker-{calls}.out")) + cmd
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=subprocess.PIPE, env=dict(os.environ, **_ENV)
            )
            try:
                assert proc.stdout is not None
                if (await proc.stdout.readline()).strip() != b"ready":
                    raise SystemExit("the worker did not start")
                async with EngineClient.connect(path, cache=cache, max_connections=1) as engine:
                    await cache.get_and_update_features([FeatureSpec("item", item)])
                    for _ in range(WARM + calls):
                        [f] = await cache.get_and_update_features([FeatureSpec("item", None)])
                        if (await engine.call([f], None, timeout=600))["n"] != KiB:
                            raise SystemExit("wrong answer")
            finally:
                proc.send_signal(signal.SIGTERM)
                await proc.wait()

    uvloop.run(main())


def _ir(side: str, calls: int) -> int:
    """One run of ``calls`` calls, ``side`` under callgrind: its total instructions."""
    with tempfile.TemporaryDirectory(prefix="aioshm-chir-") as tmp:
        out = os.path.join(tmp, f"{side}-{calls}.out")
        cmd = [sys.executable, __file__, "--inner-gateway", str(calls), side, tmp]
        if side == "gateway":
            cmd = _valgrind(out) + cmd
        subprocess.run(cmd, env=dict(os.environ, **_ENV), check=True, capture_output=True)
        return callgrind_total(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--inner-gateway", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--inner-worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=("gateway", "worker"), default="gateway")
    ap.add_argument("--calls", type=int, default=2500)
    ap.add_argument("--base", type=int, default=500)
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (the counts are alike)")
    a = ap.parse_args(argv)
    if a.inner_worker:
        inner_worker(*a.inner_worker)
        return 0
    if a.inner_gateway:
        calls, side, tmp = a.inner_gateway
        inner_gateway(int(calls), side, tmp)
        return 0
    if a.calls <= a.base:
        raise SystemExit("--calls must be more than --base")
    runs = (a.calls, a.base)
    with ThreadPoolExecutor(a.jobs) as pool:
        irs = dict(zip(runs, pool.map(lambda n: _ir(a.side, n), runs)))
    per = (irs[a.calls] - irs[a.base]) / (a.calls - a.base)
    print("load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(
        f"{a.side}: {per / 1000:.1f} k instructions per round trip "
        f"(Ir {irs[a.calls]} - {irs[a.base]}, {a.calls} - {a.base} calls)"
    )
    return 0


if __name__ == "__main__":  # the guard matters: the gateway starts the worker process
    sys.exit(main(sys.argv[1:]))

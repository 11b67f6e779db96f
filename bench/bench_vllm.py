"""vLLM 0.33's own store side by side: the compiled-core issue's table, in one command.

``python bench/bench_vllm.py --vllm-file PATH [--hog N] [--label TEXT]`` runs
``python -m aioshmcache bench --suite vllm --vllm-file PATH`` and writes its report to
``bench/runs/<UTC date-time>-vllm[-LABEL][-hogN]/``. With ``--hog N``, N busy-loop processes
(one Python ``while True: pass`` each) run beside it for the whole run and are killed afterwards
(by their own pids, on every path). vLLM's file is never part of this repository: see
bench/README.md for where it comes from.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from aioshmcache.tools.bench import main as bench_main

RUNS = Path(__file__).resolve().parent / "runs"


@contextlib.contextmanager
def cpu_hog(n: int) -> Iterator[list[int]]:
    """``n`` busy-loop processes for the length of the block; their pids."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(n)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/bench_vllm.py", description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-file", type=Path, required=True, help="vLLM's shm_object_storage.py")
    ap.add_argument("--hog", type=int, default=0, metavar="N", help="N busy-loop processes beside")
    ap.add_argument("--label", default="", help="a word for the run's folder name")
    ap.add_argument("--quick", action="store_true", help="the smoke run (fewer sizes and rounds)")
    a = ap.parse_args(argv)
    parts = [time.strftime("%Y-%m-%d-%H%M", time.gmtime()), "vllm", a.label]
    parts += [f"hog{a.hog}" if a.hog else "", "quick" if a.quick else ""]
    out = RUNS / "-".join(p for p in parts if p)
    args = ["--suite", "vllm", "--vllm-file", str(a.vllm_file), "--results-dir", str(out)]
    args += ["--quick"] if a.quick else []
    with cpu_hog(a.hog) as pids:
        if pids:
            print(f"bench_vllm: CPU hog beside, pids {pids}", file=sys.stderr)
        return bench_main(args)


if __name__ == "__main__":  # the guard matters: the benchmark spawns worker processes
    sys.exit(main(sys.argv[1:]))

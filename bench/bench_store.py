"""Store benchmarks: put / get / lease vs np.copyto into shared memory (1 KiB to 64 MiB),
the 1 KiB steady state with a reader process, churn, and a full collection with many live
entries.

A thin wrapper: ``python bench/bench_store.py [--quick] [--results-dir [DIR]]`` is
``python -m aioshmcache bench --suite store ...``; the code lives in ``aioshmcache.tools.bench``.
"""

from __future__ import annotations

import sys

from aioshmcache.tools.bench import main

if __name__ == "__main__":  # the guard matters: the benchmark spawns worker processes
    sys.exit(main(["--suite", "store", *sys.argv[1:]]))

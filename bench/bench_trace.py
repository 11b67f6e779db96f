"""Miss ratio and bytes written per request of FIFO and second-chance eviction on seeded Zipf
traces (skews 0.8 / 1.0 / 1.2, capacity 5 % and 10 % of the distinct bytes) replayed through the
real cache, against an LRU model of the same capacity in bytes.

A thin wrapper: ``python bench/bench_trace.py [--quick] [--check] [--results-dir [DIR]]`` is
``python -m aioshmcache bench --suite trace ...``; the code lives in
``aioshmcache.tools.bench.trace``.
"""

from __future__ import annotations

import sys

from aioshmcache.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["--suite", "trace", *sys.argv[1:]]))

"""Async benchmarks: an async cache hit, a 16 MiB put through the thread pool,
loop lag of a 1 ms ticker while 16 MiB items stream, and the inline-vs-thread threshold
behind aio.DEFAULT_INLINE_THRESHOLD.

A thin wrapper: ``python bench/bench_async.py [--quick] [--results-dir [DIR]]`` is
``python -m aioshmcache bench --suite async ...``; the code lives in ``aioshmcache.tools.bench``.
"""

from __future__ import annotations

import sys

from aioshmcache.tools.bench import main

if __name__ == "__main__":  # the guard matters: the benchmark spawns worker processes
    sys.exit(main(["--suite", "async", *sys.argv[1:]]))

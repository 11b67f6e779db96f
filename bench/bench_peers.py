"""Round trip writer -> reader process -> reply against the peers: a multiprocessing Pipe
and redis.asyncio against a private redis-server.

A thin wrapper: ``python bench/bench_peers.py [--quick] [--results-dir [DIR]]`` is
``python -m aioshmcache bench --suite peers ...``; the code lives in ``aioshmcache.tools.bench``.
"""

from __future__ import annotations

import sys

from aioshmcache.tools.bench import main

if __name__ == "__main__":  # the guard matters: the benchmark spawns worker processes
    sys.exit(main(["--suite", "peers", *sys.argv[1:]]))

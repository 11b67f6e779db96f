"""Cache groups: preprocessings of a Zipf load with 1 and 4 gateway writer processes of one group
(and 4 plain caches, for scale), the cost of a sibling look-up and of a sibling hit (the copy
into the own shard, 1 MiB and 16 MiB) against np.copyto into warm shared memory.

A thin wrapper: ``python bench/bench_group.py [--quick] [--results-dir [DIR]]`` is
``python -m aioshmcache bench --suite group ...``; the code lives in
``aioshmcache.tools.bench.group``.
"""

from __future__ import annotations

import sys

from aioshmcache.tools.bench import main

if __name__ == "__main__":  # the guard matters: the benchmark spawns gateway processes
    sys.exit(main(["--suite", "group", *sys.argv[1:]]))

"""``python -m aioshmcache demo``: the example gateway under uvicorn, its engine worker, a load run.

    python -m aioshmcache demo [run] [--requests N --concurrency C --gateway-workers N --quick ...]
    python -m aioshmcache demo serve [--port P --gateway-workers N --no-cache ...]

``serve`` (:mod:`.cli`) runs the example app (:mod:`.app`, which ``examples/fastapi_app.py``
imports) under uvicorn with its engine worker. ``run`` (:mod:`.load`) starts ``serve`` in a
subprocess, drives a Zipf-distributed image load at it, checks every answer against a local
computation and prints a table: cache on, on N gateway processes of one cache group
(``--gateway-workers N``), and off. Only the public API is used.
"""

from __future__ import annotations

import importlib
import sys
from typing import Final

__all__ = ["INSTALL_HINT", "main"]

#: what each subcommand imports, of the ``examples`` extra (import name = distribution name)
_NEEDS: Final = {"run": ("httpx", "fastapi", "uvicorn", "uvloop"), "serve": ("fastapi", "uvicorn")}
INSTALL_HINT: Final = "pip install 'aioshmcache[examples]'"


def main(argv: list[str]) -> int:
    """Entry point of ``python -m aioshmcache demo ...``; returns the exit code."""
    command = argv[0] if argv and argv[0] in _NEEDS else "run"
    args = argv[1:] if argv and argv[0] == command else list(argv)
    try:
        for name in _NEEDS[command]:
            importlib.import_module(name)
    except ImportError as exc:  # the first one missing (or a package it needs)
        print(
            f"python -m aioshmcache demo needs the 'examples' extra, and {exc.name} is not "
            f"installed. Install it with:\n\n    {INSTALL_HINT}\n",
            file=sys.stderr,
        )
        return 1
    from .cli import run_main, serve_main

    return serve_main(args) if command == "serve" else run_main(args)

"""``python -m aioshmcache demo``: a FastAPI multimodal gateway, engine workers, and a load run.

Subcommands (the first argument; the default is ``run``)::

    python -m aioshmcache demo [run] [--requests N --concurrency C --images K --workers W
                                      --delivery broadcast|one_of_n --cache-mb M --quick ...]
    python -m aioshmcache demo serve [--port P --workers W --delivery ... --no-cache ...]
    python -m aioshmcache demo worker ...      (started by the gateway, not by hand)

``run`` starts the gateway (``serve``) in a subprocess on 127.0.0.1 on a free port, drives a
Zipf-distributed multimodal load at it with ``httpx.AsyncClient``, checks every answer against
the same computation done locally, and prints a results table — then does it again with the
cache off, side by side. Modules: :mod:`.imaging` (decode, preprocess, hash), :mod:`.gateway`
(the FastAPI app and its lifespan), :mod:`.pool` and :mod:`.worker` (the engine workers and
their channel, :mod:`.ipc`), :mod:`.load` (the load driver and the table). Only the public API
of ``aioshmcache`` is used.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Entry point of ``python -m aioshmcache demo ...``; returns the exit code."""
    args = list(argv)
    command = args[0] if args and args[0] in ("run", "serve", "worker") else "run"
    if args and args[0] == command:
        args = args[1:]
    if command == "worker":  # keep the worker's imports light: no FastAPI, uvicorn or httpx
        from .worker import main as worker_main

        return worker_main(args)
    from .cli import run_main, serve_main

    return serve_main(args) if command == "serve" else run_main(args)

"""The tools behind ``python -m aioshmcache demo|bench|stress``, apart from the library.

Nothing here is imported by the core (``aioshmcache`` and its modules): ``aioshmcache.cli``
imports a tool only inside its subcommand. The tools use only the public API; what they needed
and the public API lacks is kept in one place, :mod:`aioshmcache.tools._core_gaps`.

Shared by the tools: :mod:`.framing` (length-prefixed msgpack frames), :mod:`.lag` (the
event-loop lag meter), :mod:`.progress` (progress lines), :mod:`.units` (sizes, durations,
formatting), :mod:`.shm` (leftover segments in /dev/shm), :mod:`.defaults` (CLI defaults).
"""

"""STOPGAP: the only place where a tool reaches into the core's private modules.

tests/test_tools_boundary.py allows private imports here only, and only these:

* ``SEGMENT_PREFIX`` and the semaphore naming: until the core lists a cache's files publicly.
* ``retag_reference``: the stress harness re-tags forged references with the segment's secret
  (what an attacker who maps the segment could do): an attack on purpose, for a test hook.
"""

from __future__ import annotations

from typing import Any

from aioshmcache import SenderCache
from aioshmcache._types import SEGMENT_PREFIX, reference_tag

__all__ = ["SEGMENT_PREFIX", "retag_reference", "semaphore_prefix"]


def semaphore_prefix(segment: str) -> str:
    """Every wake-up semaphore of segment ``segment`` starts with this (``sem.<name>.``)."""
    return f"sem.{segment}."


def retag_reference(sender: SenderCache, ref: dict[str, Any]) -> int | None:
    """The tag ``ref``'s fields would carry if the writer had issued it; None if unknown."""
    secret = getattr(sender.store, "_secret", None)
    if not isinstance(secret, int):
        return None
    return reference_tag(
        secret,
        ref["epoch"],
        ref["address"],
        ref["id"],
        ref["length"],
        ref.get("position", 0),
        ref.get("seq", 0),
    )

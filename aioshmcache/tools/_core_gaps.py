"""STOPGAP: the only place where a tool reaches into the core's private modules.

Each name below is something a tool needs and the public API does not offer yet; the boundary
test (tests/test_tools_boundary.py) allows private imports in this module only, and only these.
Replace each with public API when the core gains it:

* ``SEGMENT_PREFIX`` and the semaphore naming: a public listing of a cache's files in /dev/shm
  (``aioshmcache.list_segments()`` or similar) would make both unnecessary.
* ``retag_reference``: the stress harness forges references re-tagged with the segment's secret
  (what an attacker who can map the segment could do). This is an attack on purpose; it should
  stay out of the public API and move to a test-support hook of the core.
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

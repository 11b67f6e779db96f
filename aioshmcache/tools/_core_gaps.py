"""STOPGAP: the only place where a tool reaches into the core's private modules.

tests/test_tools_boundary.py allows private imports here only, and only this one:
``SEGMENT_PREFIX`` and the semaphore naming, until the core lists a cache's files publicly.
"""

from __future__ import annotations

from aioshmcache._types import SEGMENT_PREFIX

__all__ = ["SEGMENT_PREFIX", "semaphore_prefix"]


def semaphore_prefix(segment: str) -> str:
    """Every wake-up semaphore of segment ``segment`` starts with this (``sem.<name>.``)."""
    return f"sem.{segment}."

"""What a tool leaves in /dev/shm: segment and semaphore files by name or prefix.

The names of a cache's files come from the core's naming rules (``aioshm-<name>`` and
``sem.<segment>.<nonce>.wake``), through the documented internal API of ``aioshmcache._layout``
(docs/design.md lists what the tools may use).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Final

from aioshmcache._layout import SEGMENT_PREFIX, SHM_DIR, parse_semaphore_file

__all__ = [
    "NAME_PREFIX_ENV",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "files_with_prefix",
    "name_prefix",
    "remove",
    "segment_files",
]

#: the environment variable whose value the tools put in front of every name they make up
#: (a test run sets its own prefix: its leak check then sees what the tools' processes left)
NAME_PREFIX_ENV: Final = "AIOSHM_NAME_PREFIX"


def name_prefix() -> str:
    """``$AIOSHM_NAME_PREFIX`` if it is a valid start of a name (letters, digits, ``-_``), else
    empty."""
    prefix = os.environ.get(NAME_PREFIX_ENV, "")
    ok = len(prefix) <= 32 and all(c.isascii() and (c.isalnum() or c in "-_") for c in prefix)
    return prefix if ok else ""


def _names() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except OSError:
        return []


def _segment_of(filename: str) -> str:
    """The segment a /dev/shm file belongs to: itself, or the segment of a wake semaphore."""
    parsed = parse_semaphore_file(filename)
    return filename if parsed is None else parsed[0]


def segment_files(name: str) -> list[str]:
    """Segment ``name`` (with or without the prefix) and its semaphores, if they exist."""
    seg = name if name.startswith(SEGMENT_PREFIX) else SEGMENT_PREFIX + name
    return sorted(n for n in _names() if _segment_of(n) == seg)


def files_with_prefix(prefix: str) -> list[str]:
    """Every segment whose name starts with ``prefix`` (prefix included), and its semaphores."""
    seg = prefix if prefix.startswith(SEGMENT_PREFIX) else SEGMENT_PREFIX + prefix
    return sorted(n for n in _names() if _segment_of(n).startswith(seg))


def remove(names: Iterable[str]) -> None:
    """Unlink these files of /dev/shm (already gone is fine)."""
    for n in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, n))

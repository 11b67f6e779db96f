"""Progress lines on stderr, the same for every tool."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``[  12.3 s] what runs now`` lines, or one line rewritten in place on a terminal."""

    def __init__(self, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.t0 = time.monotonic()
        self.enabled = enabled
        self._stream = stream
        self._step = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, msg: str) -> None:
        """One line, prefixed with the time since the start."""
        if self.enabled:
            print(f"[{self.elapsed():6.1f} s] {msg}", file=self._stream or sys.stderr, flush=True)

    def update(self, line: str, fraction: float, *, final: bool = False) -> None:
        """A counter: rewritten in place on a terminal, else a line every 10 % (and the last)."""
        if not self.enabled:
            return
        stream = self._stream or sys.stderr  # looked up now: pytest's capture replaces it
        if stream.isatty():
            stream.write("\r" + line.ljust(72) + ("\n" if final else ""))
            stream.flush()
            return
        step = int(10 * fraction)
        if step > self._step or (final and step < 10):
            self._step = step
            print(line, file=stream, flush=True)

"""Flow control: which readers still owe a report of which request.

The parent forwards each request to its readers and returns one credit to the writer when every
target has reported it; a killed or stopped target is written off. So the writer runs at most
``--window`` requests ahead, and quiescence is "nothing owed".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

__all__ = ["Owed"]

Key = tuple[int, int]  # (writer generation, request id)


class Owed:
    """Requests forwarded and not yet reported by all of their readers."""

    def __init__(self, credit: Callable[[int], None]) -> None:
        self.credit = credit  # called with the generation when a request is fully reported
        self.pending: dict[Key, set[str]] = {}
        self.none = asyncio.Event()
        self.none.set()

    def __len__(self) -> int:
        return len(self.pending)

    def expect(self, key: Key, tokens: Iterable[str]) -> None:
        """``tokens`` each owe a report of ``key`` (none: the credit comes back at once)."""
        waiting = set(tokens)
        if not waiting:
            self.credit(key[0])
            return
        self.pending[key] = waiting
        self.none.clear()

    def reported(self, token: str, key: Key) -> None:
        waiting = self.pending.get(key)
        if waiting is None:
            return
        waiting.discard(token)
        if not waiting:
            del self.pending[key]
            self.credit(key[0])
            self._check_empty()

    def write_off(self, token: str) -> None:
        """A reader that will not report (killed, stopped) owes nothing any more."""
        for key in list(self.pending):
            self.reported(token, key)

    def forget_generation(self, gen: int) -> None:
        """A dead writer's requests: nobody owes it anything, and no credit goes back."""
        for key in [k for k in self.pending if k[0] == gen]:
            del self.pending[key]
        self._check_empty()

    def clear(self) -> None:
        self.pending.clear()
        self._check_empty()

    def _check_empty(self) -> None:
        if not self.pending:
            self.none.set()

"""What ``invalidate`` guarantees about references handed out before it (issue 19, item 9).

The decision (``SenderCache.invalidate``'s docstring): after ``invalidate(h)`` no request is
given the old copy, but references handed out before stay valid until acknowledged (each is
still owed); the old chunk is freed once they are, and only then do further copies of those
references read as stale.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aioshmcache import ReceiverCache, SenderCache, ShmRef, StaleReferenceError


def _item(v: int) -> dict[str, Any]:
    return {"x": np.full(4096, v, dtype=np.int64)}


def test_invalidate_keeps_earlier_references_readable_and_re_puts(make_config: Any) -> None:
    with (
        SenderCache(make_config(4 << 20, 1 << 20, 2)) as tx,
        ReceiverCache.attach(tx.handle()) as rx1,
        ReceiverCache.attach(tx.handle()) as rx2,
    ):
        old, _ = tx.get_and_update_item((_item(1), []), "h")
        one_chunk = tx.snapshot().bytes_used
        assert tx.invalidate("h") is True and tx.invalidate("h") is False
        assert not tx.is_cached("h")
        # the next request is a miss: a new chunk and a new reference
        new, _ = tx.get_and_update_item((_item(1), []), "h")
        assert type(new) is ShmRef and new.id != old.id
        assert tx.snapshot().bytes_used == 2 * one_chunk  # the old chunk is still owed
        # every reader owed the earlier hand-out reads it, correct, not stale
        for rx in (rx1, rx2):
            assert np.array_equal(rx.get_and_update_item(old, "h")["x"], _item(1)["x"])
        # once acknowledged by everyone, the old chunk is freed (the new one is still owed);
        # a copy of the old reference is now stale (nothing is owed for it any more)
        tx.remove_dangling_items()
        assert tx.snapshot().bytes_used == one_chunk
        with pytest.raises(StaleReferenceError):
            rx1.get_and_update_item(old, "h")
        for rx in (rx1, rx2):
            assert np.array_equal(rx.get_and_update_item(new, "h")["x"], _item(1)["x"])
        assert np.array_equal(
            rx1.get_and_update_item(tx.get_and_update_item(None, "h")[0], "h")["x"], _item(1)["x"]
        )


def test_docstrings_say_what_invalidate_does() -> None:
    """The docstrings state the guarantee the test above checks."""
    from aioshmcache import AsyncSenderCache

    def words(doc: str | None) -> str:
        return " ".join((doc or "").split())

    assert "References handed out *before* stay valid" in words(SenderCache.invalidate.__doc__)
    assert "stay readable until acknowledged" in words(AsyncSenderCache.invalidate.__doc__)

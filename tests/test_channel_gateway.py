"""The gateway's usual call (``EngineClient.call``) and the paths it falls back to.

The usual call (an idle pooled connection, a send that needs no drain, an answer that arrives
in one read) takes a short path; each test checks that path is taken, and that what it leaves
to the general path (a pool wait, a drain, an answer in pieces, a deadline) behaves as before.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aioshmcache.errors import EngineTimeoutError

from ._channel_procs import crc
from .test_channel import _connected, _features, _item


async def test_the_usual_call_reads_only_the_loop_s_clock(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call's deadline is on the loop's clock from the start (``loop.time()``, which every
    wait takes as it is): the usual call reads no other clock, and a call past its deadline is
    still ``EngineTimeoutError``."""
    from aioshmcache import _channel_client

    reads: list[float] = []

    def monotonic() -> float:
        reads.append(now := time.monotonic())
        return now

    monkeypatch.setattr(_channel_client, "time", types.SimpleNamespace(monotonic=monotonic))
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (cache, _rx, engine):
        for i in range(3):  # a new connection, then the idle one
            [f] = await _features(cache, range(i, i + 1))
            out = await engine.call([f], {"op": "crc"}, timeout=30)
            assert out["crcs"] == [crc(_item(i)["x"])]
        assert reads == []
        with pytest.raises(EngineTimeoutError, match="answer"):
            await engine.call([], {"op": "sleep", "s": 1.0}, timeout=0.2)
        assert reads == []
        assert (await engine.call([], {"op": "echo", "n": 1}, timeout=30))["payload"]["n"] == 1
        assert cache.snapshot().readers[0].lag == 0

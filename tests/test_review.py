"""Regression tests for bugs found in review: each failed before its fix."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from aioshmcache import (
    AsyncReceiverCache,
    AsyncSenderCache,
    FeatureSpec,
    InvalidReferenceError,
    ReceiverCache,
    SenderCache,
    SerdeError,
    ShmRef,
)

MiB = 1 << 20


def test_a_rejected_request_owes_nothing(make_config: Any) -> None:
    with SenderCache(make_config()) as tx, ReceiverCache.attach(tx.handle()) as rx:
        ref, _ = tx.get_and_update_item(({"a": np.ones(10)}, ()), "a")
        forged = ShmRef(ref.nonce, ref.epoch, ref.address + 64, ref.id, ref.length, ref.tag)
        with pytest.raises(InvalidReferenceError):
            rx.get_and_update_features([FeatureSpec("a", ref), FeatureSpec("b", forged)])
        assert tx.is_freeable("a")  # the valid one was given back, not left owed forever
        ref2, _ = tx.get_and_update_item(None, "a")
        with (
            pytest.raises(InvalidReferenceError),
            rx.lease([FeatureSpec("a", ref2), FeatureSpec("b", forged)]),
        ):
            pass
        assert tx.is_freeable("a")


async def test_async_rejected_request_owes_nothing(make_config: Any) -> None:
    async with (
        AsyncSenderCache.from_config(make_config()) as tx,
        AsyncReceiverCache.attach(tx.handle()) as rx,
    ):
        [f] = await tx.get_and_update_features([FeatureSpec("a", {"a": np.ones(10)})])
        with pytest.raises(TypeError):
            await rx.get_and_update_features([f, "junk"])  # type: ignore[list-item]
        assert tx.is_freeable("a")


async def test_a_failing_item_aborts_the_request_s_allocations(make_config: Any) -> None:
    async with AsyncSenderCache.from_config(make_config(8 * MiB, 2 * MiB, 1)) as tx:
        with pytest.raises(SerdeError):
            await tx.get_and_update_features(
                [FeatureSpec("a", {"x": np.ones(100)}), FeatureSpec("b", {"x": {1, 2}})]
            )
        store = tx.sender.store
        assert not store._pending and not store.is_pending("a")
        store.evict(0)
        assert store.ring.n_chunks == 0  # nothing left in WRITING state at the head
        [f] = await tx.get_and_update_features([FeatureSpec("a", {"x": np.ones(100)})])
        assert isinstance(f.data, ShmRef)


async def test_a_failing_big_copy_aborts_the_rest(make_config: Any) -> None:
    from aioshmcache import MsgpackSerde

    class FailingSerde(MsgpackSerde):
        calls = 0

        def write(self, plan: Any, buf: memoryview) -> None:
            FailingSerde.calls += 1
            if FailingSerde.calls == 1:
                raise SerdeError("injected")
            super().write(plan, buf)

    sender = SenderCache(make_config(16 * MiB, 4 * MiB, 1), serde=FailingSerde())
    try:
        async with AsyncSenderCache(sender, inline_threshold_bytes=1) as tx:
            big = [FeatureSpec(k, {"x": np.ones(MiB, np.uint8)}) for k in "ab"]
            with pytest.raises(SerdeError):
                await tx.get_and_update_features(big)
            assert not sender.store._pending
            sender.store.evict(0)
            assert sender.store.ring.n_chunks == 0
    finally:
        sender.close()


def test_sync_put_while_another_thread_waits_for_the_same_key(make_config: Any) -> None:
    with SenderCache(make_config(2 * MiB, MiB, 1)) as tx, ReceiverCache.attach(tx.handle()) as rx:
        held = [
            tx.get_and_update_item(({"x": np.ones(900_000, np.uint8)}, ()), f"o{i}")[0]
            for i in range(2)
        ]
        big = {"x": np.ones(900_000, np.uint8)}
        results: dict[str, Any] = {}

        def waiter() -> None:
            results["A"] = tx.get_and_update_item((big, ()), "k", wait_for_space=2.0)

        t = threading.Thread(target=waiter)
        t.start()
        while not tx.store.is_pending("k"):
            pass
        results["B"] = tx.get_and_update_item((big, ()), "k")  # no DuplicateKeyError
        rx.get_and_update_item(held[0], "o0")
        t.join(10)
        assert isinstance(results["A"][0], ShmRef)
        assert results["B"][0] is big

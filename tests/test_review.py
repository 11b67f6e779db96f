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
    StaleReferenceError,
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


def test_full_ack_log_never_blocks_nor_loses(make_config: Any) -> None:
    with SenderCache(make_config(4 * MiB, MiB, 1, ack_log_entries=64)) as tx:
        refs = [tx.get_and_update_item(({"i": i}, ()), f"k{i}")[0] for i in range(100)]
        with ReceiverCache.attach(tx.handle()) as rx:
            refs = [tx.get_and_update_item(None, f"k{i}")[0] for i in range(100)]
            for i, r in enumerate(refs):  # the writer is idle: the log fills up
                assert rx.get_and_update_item(r, f"k{i}") == {"i": i}
            assert rx.store.slot is not None and rx.store.slot.flush() > 0
            tx.store.drain()  # the writer drains; the next reader call flushes the rest
            rx.get_and_update_features([])
            assert rx.store.slot.flush() == 0
            assert all(tx.is_freeable(f"k{i}") for i in range(100))


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


def test_handmade_refs_with_bad_fields_are_invalid(make_config: Any) -> None:
    with SenderCache(make_config()) as tx, ReceiverCache.attach(tx.handle()) as rx:
        ref, _ = tx.get_and_update_item(({"a": 1}, ()), "a")
        for bad in (
            ShmRef(ref.nonce, ref.epoch, "x", ref.id, ref.length),  # type: ignore[arg-type]
            ShmRef(ref.nonce, ref.epoch, ref.address, -1, ref.length),
            ShmRef(ref.nonce, ref.epoch, ref.address, ref.id, 1 << 70),
        ):
            with pytest.raises(InvalidReferenceError):
                rx.get_and_update_item(bad, "a")
            assert tx.release(bad) is False
        # a dict of arrays whose keys happen to be reference field names is inline data
        inline = {"id": np.arange(3)}
        assert rx.get_and_update_item(inline, "i") is inline


def test_reused_bytes_that_forge_the_old_chunk_header_are_still_stale(make_config: Any) -> None:
    """The next occupant's payload writes a perfect copy of the freed chunk's header."""
    from aioshmcache._layout import CHUNK_MAGIC, COMMITTED

    with (
        SenderCache(make_config(1 << 16, 1 << 15, 1)) as tx,
        ReceiverCache.attach(tx.handle()) as rx,
    ):
        filler, _ = tx.get_and_update_item(({"f": np.zeros(900, np.uint8)}, ()), "filler")
        ref, _ = tx.get_and_update_item(({"a": np.arange(10)}, ()), "a")
        assert ref.address > 0
        rx.get_and_update_item(ref, "a")
        rx.get_and_update_item(filler, "filler")
        tx.invalidate("a")
        tx.invalidate("filler")
        tx.remove_dangling_items()  # both freed: the ring is empty, the next put starts at 0
        assert tx.store.ring.n_chunks == 0
        pattern = np.zeros(8, np.uint64)
        pattern[:4] = [ref.id, ref.length, COMMITTED, ref.id ^ ref.length ^ CHUNK_MAGIC]
        forged = np.tile(pattern, 400)  # a forged header at every 64-byte boundary
        tx.get_and_update_item(({"x": forged}, ()), "b")
        words = tx.store.ring.buf.cast("Q")
        i = ref.address // 8
        assert list(words[i : i + 4]) == list(pattern[:4])  # the old header is back, verbatim
        words.release()
        with pytest.raises(StaleReferenceError):
            rx.get_and_update_item(ref, "a")


def test_each_handout_is_settled_by_exactly_its_own_acknowledgement(make_config: Any) -> None:
    """A late reader reading an older reference must not settle its debt for a newer hand-out;
    release() undoes exactly the sessions a hand-out was made to."""
    with SenderCache(make_config(1 << 20, 1 << 18, 2)) as tx:
        h1, _ = tx.get_and_update_item(({"a": np.ones(4)}, ()), "a")  # nobody attached yet
        with ReceiverCache.attach(tx.handle()) as late:
            h2, _ = tx.get_and_update_item(None, "a")  # owed by `late`
            assert late.get_and_update_item(h1, "a")["a"].sum() == 4  # not owed: settles nothing
            assert not tx.is_freeable("a")
            assert tx.release(h1) is False  # nobody owed h1
            assert tx.release(h2) is True and tx.release(h2) is False
            assert tx.is_freeable("a")
            h3, _ = tx.get_and_update_item(None, "a")
            assert late.release(h3) is True and late.release(h3) is False
            assert tx.is_freeable("a")

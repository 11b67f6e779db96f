"""``aioshmcache.vllm``: vLLM's processor-cache method names, in one adapter module only.

The scenarios the sync and async faces share run against the adapters too
(``test_parity.py::test_sync_async_and_vllm_faces_agree``); here: the names and call shapes,
that the faces no longer carry them, and a vLLM request's flow end to end.
"""

from __future__ import annotations

import inspect
import uuid
from typing import Any

import numpy as np
import pytest

from aioshmcache import (
    AsyncReceiverCache,
    AsyncSenderCache,
    CacheConfig,
    CacheInfo,
    CacheMissError,
    FeatureSpec,
    ReceiverCache,
    SenderCache,
    ShmRef,
)
from aioshmcache.cache import GroupReceiverCache
from aioshmcache.vllm import VllmReceiverCache, VllmSenderCache

from .conftest import RUN_PREFIX

#: vLLM 0.33's processor-cache interface (vllm/multimodal/cache/base.py), as facts: each
#: method's parameters (name, default; ``*`` marks keyword-only ones)
SENDER = {
    "is_cached_item": ["mm_hash"],
    "is_cached": ["mm_hashes"],
    "get_and_update_item": ["mm_item", "mm_hash"],
    "get_and_update": ["mm_items", "mm_hashes"],
    "touch_sender_cache_item": ["mm_hash"],
    "release_sender_touches": [],
    "validate_input_item": ["mm_item", "mm_hash"],
    "invalidate": ["mm_hash"],
    "clear_cache": [],
    "make_stats": ["*delta=False"],
    "remove_dangling_items": [],
    "close": [],
}
RECEIVER = {
    "get_and_update_features": ["mm_features"],
    "get_and_update_item": ["mm_item", "mm_hash"],
    "get_and_update": ["mm_items", "mm_hashes"],
    "touch_receiver_cache_item": ["mm_hash", "mm_item=None"],
    "clear_cache": [],
    "close": [],
}
VLLM_ONLY = {
    "is_cached_item",
    "touch_sender_cache_item",
    "touch_receiver_cache_item",
    "clear_cache",
}


def _params(fn: Any) -> list[str]:
    """The parameters vLLM's callers use: positional ones, and keyword-only ones with ``*``;
    keyword-only options of our own with a default (``wait_for_space``) are left out."""
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        default = "" if p.default is p.empty else f"={p.default!r}"
        if p.kind is p.KEYWORD_ONLY:
            if p.name == "wait_for_space":
                continue
            out.append(f"*{p.name}{default}")
        else:
            out.append(f"{p.name}{default}")
    return out


@pytest.mark.parametrize(
    ("cls", "interface"), [(VllmSenderCache, SENDER), (VllmReceiverCache, RECEIVER)]
)
def test_the_adapters_have_vllms_names_and_parameters(cls: type, interface: dict[str, Any]) -> None:
    public = {n for n in dir(cls) if not n.startswith("_")}
    assert public == set(interface)
    for name, params in interface.items():
        assert _params(getattr(cls, name)) == params, name


@pytest.mark.parametrize(
    "cls",
    [SenderCache, ReceiverCache, GroupReceiverCache, AsyncSenderCache, AsyncReceiverCache],
)
def test_the_faces_carry_one_name_per_job(cls: type) -> None:
    """The vLLM names live in ``aioshmcache.vllm`` only; the faces keep ``is_cached``,
    ``touch`` and ``clear``."""
    assert not VLLM_ONLY & set(dir(cls))
    assert {"touch", "clear"} <= set(dir(cls))


def test_a_vllm_request_flows_through_the_adapters(make_config: Any) -> None:
    """P0 looks up, then updates the request's items; P1 reads them; a clear makes the next
    read a miss that names the items; the stats and the lifetime are vLLM's."""
    item = {"pixel_values": np.arange(1000, dtype=np.float32)}
    p0 = VllmSenderCache(SenderCache(make_config()))
    try:
        p1 = VllmReceiverCache(ReceiverCache.attach(p0.sender.handle()))
        try:
            assert p0.is_cached(["a", "b"]) == [False, False]
            hashes = ["a", "b"]
            items = [None if p0.is_cached_item(h) else (item, [f"upd-{h}"]) for h in hashes]
            out = p0.get_and_update(items, hashes)
            assert [type(d) for d, _ in out] == [ShmRef, ShmRef]
            assert [u for _, u in out] == [["upd-a"], ["upd-b"]]
            assert p0.is_cached(hashes) == [True, True]
            p0.touch_sender_cache_item("a")
            again = p0.get_and_update_item(None, "a")  # a hit: the kept prompt updates
            assert type(again[0]) is ShmRef and again[1] == ["upd-a"]
            assert p0.make_stats(delta=True) == CacheInfo(hits=1, total=3)
            assert p0.make_stats(delta=True) == CacheInfo(hits=0, total=0)

            feats = [FeatureSpec(h, d) for h, (d, _) in zip(hashes, out)]
            for f in feats:
                p1.touch_receiver_cache_item(f.mm_hash, f.data)
            got = p1.get_and_update_features(feats)
            assert all(np.array_equal(g.data["pixel_values"], item["pixel_values"]) for g in got)
            assert feats[0].data is out[0][0]  # the input is left as it was
            back = p1.get_and_update_item(again[0], "a")
            assert np.array_equal(back["pixel_values"], item["pixel_values"])

            stale = p0.get_and_update([None, None], hashes)
            p0.clear_cache()  # every reference handed out before is stale now
            with pytest.raises(CacheMissError) as miss:
                p1.get_and_update([d for d, _ in stale], hashes)
            assert miss.value.mm_hashes == ("a", "b")
            assert p0.is_cached(hashes) == [False, False]
            p0.invalidate("a")  # nothing cached: a no-op
            p0.remove_dangling_items()
            p1.clear_cache()
            assert p1.receiver.make_stats() == CacheInfo(0, 0)
        finally:
            p1.close()
        assert p1.receiver.closed
    finally:
        p0.close()
    assert p0.sender.closed


def test_the_receiver_adapter_takes_a_group_reader() -> None:
    """Any reader will do: the adapter is typed for ``Receiver``, which a group reader is."""
    group = f"{RUN_PREFIX}vl{uuid.uuid4().hex[:10]}"
    with SenderCache(CacheConfig(1 << 20, 1 << 18, 2, group=group)) as tx:
        [f] = tx.get_and_update_features([FeatureSpec("h", {"x": np.arange(8)})])
        p1 = VllmReceiverCache(ReceiverCache.attach_group(group))
        try:
            p1.touch_receiver_cache_item("h", f.data)
            [got] = p1.get_and_update_features([f])
            assert np.array_equal(got.data["x"], np.arange(8))
        finally:
            p1.close()


def test_the_adapters_refuse_what_they_cannot_wrap(make_config: Any) -> None:
    with pytest.raises(TypeError, match="SenderCache"):
        VllmSenderCache(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ReceiverCache"):
        VllmReceiverCache(object())  # type: ignore[arg-type]
    with (
        SenderCache(make_config()) as tx,
        ReceiverCache.attach(tx.handle()) as rx,
        pytest.raises(ValueError, match="2 items for 1 hashes"),
    ):
        VllmReceiverCache(rx).get_and_update([None, None], ["a"])


#: a copy job of a request (over the store's 1 MiB copy-under-lock threshold)
_BIG = {"x": np.zeros(3 << 19, dtype=np.uint8)}
_SMALL = {"x": np.arange(64, dtype=np.float32)}


@pytest.mark.parametrize("item", [_SMALL, _BIG], ids=["small", "copy-job"])
def test_a_look_up_after_an_item_of_its_hash_is_that_item_s_hit(
    make_config: Any, item: dict[str, Any]
) -> None:
    """vLLM's sender decides a request's items in order: ``[item, None]`` of one new hash puts
    the first and answers the second as its hit (the kept updates), as one call or as
    features; a look-up before the item, or after one served inline, is still a miss that
    takes nothing."""
    with (
        SenderCache(make_config(8 << 20, 2 << 20)) as tx,
        ReceiverCache.attach(tx.handle()) as rx,
    ):
        out = tx.get_and_update([(item, ["u"]), None], ["a", "a"])
        assert [type(d) for d, _ in out] == [ShmRef, ShmRef]
        assert [u for _, u in out] == [["u"], ["u"]]
        assert tx.make_stats() == CacheInfo(hits=1, total=2)
        for d, _ in out:
            assert np.array_equal(rx.get_and_update_item(d, "a")["x"], item["x"])
        feats = tx.get_and_update_features(
            [FeatureSpec("b", item, prompt_updates=("v",)), FeatureSpec("b", None)]
        )
        assert [type(f.data) for f in feats] == [ShmRef, ShmRef]
        assert feats[1].prompt_updates == ("v",)
        rx.get_and_update_features(feats)
        with pytest.raises(CacheMissError):
            tx.get_and_update([None, (item, ["u"])], ["c", "c"])
        assert not tx.is_cached("c")
        huge = {"x": np.zeros(3 << 20, dtype=np.uint8)}  # over max_object_bytes: inline
        with pytest.raises(CacheMissError):
            tx.get_and_update([(huge, ["u"]), None], ["d", "d"])
        assert not tx.is_cached("d")
        assert all(tx.is_freeable(h) for h in ("a", "b"))  # the failed requests owe nothing


def test_the_sender_adapter_answers_vllm_s_other_calls(make_config: Any) -> None:
    """What vLLM 0.33's own callers also call on a processor cache: the processor's
    ``release_sender_touches`` after each request's updates, the token-in-token-out server's
    ``validate_input_item`` on a pair from outside (a ``ValueError`` for a handle that is not the
    hash's current one), the renderer's ``make_stats(delta=True)`` and ``clear_cache`` (the stats
    restart there); ``remove_dangling_items`` frees no cached item."""
    item = {"x": np.arange(16)}
    p0 = VllmSenderCache(SenderCache(make_config()))
    try:
        with ReceiverCache.attach(p0.sender.handle()) as rx:
            p0.touch_sender_cache_item("a")
            [(ref, _)] = p0.get_and_update([(item, ["u"])], ["a"])
            p0.release_sender_touches()
            p0.validate_input_item(ref, "a")  # the hash's own reference
            p0.validate_input_item(item, "a")  # inline data: nothing to check
            p0.validate_input_item(ref.to_dict(), "a")
            (ref_b, _) = p0.get_and_update_item((item, ["v"]), "b")
            for bad, h in [(ref_b, "a"), (ref, "b"), (ref, "z")]:
                with pytest.raises(ValueError):
                    p0.validate_input_item(bad, h)
            rx.get_and_update_features([FeatureSpec("a", ref), FeatureSpec("b", ref_b)])
            p0.remove_dangling_items()  # read: freeable, yet still cached
            assert p0.is_cached(["a", "b"]) == [True, True]
            assert set(p0.sender._prompt_updates) == {"a", "b"}
            p0.get_and_update_item(None, "a")
            assert p0.make_stats(delta=True) == CacheInfo(hits=1, total=3)
            p0.get_and_update_item(None, "b")
            p0.clear_cache()
            assert p0.make_stats() == CacheInfo(0, 0)
            assert p0.make_stats(delta=True) == CacheInfo(0, 0)
            with pytest.raises(ValueError):
                p0.validate_input_item(ref, "a")  # cleared: not a live reference
            p0.get_and_update_item((item, ["u"]), "a")
            assert p0.make_stats() == CacheInfo(hits=0, total=1)
            assert p0.make_stats(delta=True) == CacheInfo(hits=0, total=1)
            assert p0.sender.make_stats() == CacheInfo(hits=2, total=5)  # the cache's own
    finally:
        p0.close()

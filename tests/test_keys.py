"""``aioshmcache.keys``: keys the server derives from the bytes, claims checked against them.

``content_key`` is stable (a published format any client can compute), separates namespaces and
the three kinds of key, accepts the buffer types it names and refuses the rest with
``TypeError``; a claim that does not name its body raises ``KeyMismatchError`` and the safe flow
caches nothing; ``lookup_key`` reaches only content keys and scopes a look-up to its namespace.
Through the fleet tier (a real ``redis-server``), the fleet example's request never gives one
body another's answer.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

import aioshmcache
from aioshmcache import (
    AsyncSenderCache,
    CacheConfig,
    KeyMismatchError,
    ReceiverCache,
    ShmCacheError,
    content_key,
    lookup_key,
    tenant_key,
)
from aioshmcache.keys import NS_TAG
from aioshmcache.tier import RedisTier
from aioshmcache.tools.redis_server import RedisServer, redis_binaries

from . import _tier_hosts as hosts

ROOT = Path(__file__).resolve().parent.parent


def test_a_content_key_is_the_published_sha256_digest() -> None:
    body = b"an image's bytes"
    key = content_key(body)
    assert key == "sha256:" + hashlib.sha256(body).hexdigest()  # any client computes it
    assert content_key(b"") == (
        "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
    ns = b"tenant-a"
    inner = hashlib.sha256(body).digest()
    outer = hashlib.sha256(NS_TAG + len(ns).to_bytes(8, "big") + ns + inner).hexdigest()
    assert content_key(body, namespace="tenant-a") == "ns-sha256:" + outer
    assert content_key(body) == content_key(body)  # stable: no salt, no state
    assert aioshmcache.content_key is content_key


def test_every_buffer_type_named_gives_the_same_key() -> None:
    body = bytes(range(256)) * 10
    arr = np.frombuffer(body, np.uint8)
    want = content_key(body)
    assert content_key(bytearray(body)) == want
    assert content_key(memoryview(body)) == want
    assert content_key(arr.data) == want
    assert content_key(arr.view(np.float32).data) == want  # the bytes, not the items
    assert content_key(memoryview(body)[10:20]) == content_key(body[10:20])


@pytest.mark.parametrize(
    "bad", ["text", 12, None, [1, 2], np.zeros(4, np.uint8), memoryview(b"abcdef")[::2]]
)
def test_a_body_of_another_type_is_a_type_error(bad: Any) -> None:
    with pytest.raises(TypeError):
        content_key(bad)


def test_a_namespace_claim_or_tenant_of_another_type_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        content_key(b"x", namespace=b"tenant")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        content_key(b"x", claimed=b"sha256:00")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        lookup_key(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tenant_key(7, tenant="t")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tenant_key("id", tenant=None)  # type: ignore[arg-type]


def test_namespaces_and_kinds_never_share_a_key() -> None:
    body = b"the same bytes"
    keys = {
        content_key(body),
        content_key(body, namespace=""),
        content_key(body, namespace="a"),
        content_key(body, namespace="b"),
        content_key(body, namespace="ab"),
        tenant_key(content_key(body), tenant=""),
        tenant_key("id", tenant="a"),
        tenant_key("id", tenant="b"),
    }
    assert len(keys) == 8
    # the length prefix: moving bytes between tenant and identifier changes the key
    assert tenant_key("bc", tenant="a") != tenant_key("c", tenant="ab")
    # a body that spells out another namespaced key's hashed bytes does not collide with it
    ns = b"a"
    spelled = NS_TAG + len(ns).to_bytes(8, "big") + ns + hashlib.sha256(body).digest()
    assert content_key(spelled) != content_key(body, namespace="a")
    assert content_key(spelled).removeprefix("sha256:") == content_key(
        body, namespace="a"
    ).removeprefix("ns-sha256:")  # the same digest: the prefix is what keeps them apart


@given(st.binary(max_size=64), st.binary(max_size=64), st.text(max_size=8), st.text(max_size=8))
def test_distinct_pairs_get_distinct_keys(a: bytes, b: bytes, na: str, nb: str) -> None:
    if (a, na) != (b, nb):
        assert content_key(a, namespace=na) != content_key(b, namespace=nb)
    if a != b:
        assert content_key(a) != content_key(b)
    if (na, a.hex()) != (nb, b.hex()):
        assert tenant_key(a.hex(), tenant=na) != tenant_key(b.hex(), tenant=nb)


def test_a_namespace_keeps_every_str_apart_even_lone_surrogates() -> None:
    assert content_key(b"x", namespace="\ud800") != content_key(b"x", namespace="\ud801")


def test_a_claim_is_checked_against_the_body() -> None:
    body, other = b"README.md", b"pyproject.toml"
    key = content_key(body)
    assert content_key(body, claimed=key) == key
    ns_key = content_key(body, namespace="t")
    # in a namespace the claim may be the plain key (what a client computes) or the scoped one
    assert content_key(body, namespace="t", claimed=key) == ns_key
    assert content_key(body, namespace="t", claimed=ns_key) == ns_key
    for claim in ("photo-1", content_key(other), content_key(body, namespace="u"), key.upper()):
        with pytest.raises(KeyMismatchError) as info:
            content_key(body, namespace="t", claimed=claim)
        assert info.value.claimed == claim
    assert issubclass(KeyMismatchError, ShmCacheError) and issubclass(KeyMismatchError, ValueError)


def test_a_look_up_reaches_only_content_keys_and_is_scoped_by_the_server() -> None:
    body = b"an image"
    key = content_key(body)
    assert lookup_key(key) == key
    assert lookup_key(content_key(body, namespace="t")) == content_key(body, namespace="t")
    # the server scopes a plain claim to the requester's namespace: exactly the put's key
    assert lookup_key(key, namespace="t") == content_key(body, namespace="t")
    refused = [
        "photo-1",
        tenant_key("photo-1", tenant="t"),  # an unverified id is never reachable by a hash
        key + "0",
        key.upper(),
        "sha256:" + "g" * 64,
        " " + key,
    ]
    for claim in refused:
        with pytest.raises(KeyMismatchError):
            lookup_key(claim)
    with pytest.raises(KeyMismatchError):  # another tenant's scoped key is not a claim here
        lookup_key(content_key(body, namespace="u"), namespace="t")


def _item(body: bytes) -> dict[str, Any]:
    return {"pixel_values": np.frombuffer(body, np.uint8).astype(np.float32)}


async def test_a_mismatched_claim_caches_nothing(make_config: Any) -> None:
    """The safe flow: key first (it raises before ``make``), then ``get_or_put``."""
    a, b = b"first image" * 100, b"second image" * 100
    made: list[bytes] = []

    async def embed(cache: AsyncSenderCache, body: bytes, claimed: str | None) -> Any:
        key = content_key(body, claimed=claimed)

        def make() -> dict[str, Any]:
            made.append(body)
            return _item(body)

        return await cache.get_or_put(key, make)

    async with AsyncSenderCache.from_config(make_config(1 << 20, 64 << 10, 1)) as cache:
        with pytest.raises(KeyMismatchError):
            await embed(cache, b, content_key(a))  # B's bytes under A's hash
        assert made == [] and not cache.is_cached(content_key(a))
        assert not cache.is_cached(content_key(b))
        assert cache.snapshot().items == 0
        await embed(cache, a, content_key(a))
        with pytest.raises(KeyMismatchError):
            await embed(cache, b, content_key(a))
        assert made == [a] and not cache.is_cached(content_key(b))
        assert [cache.is_cached(content_key(x)) for x in (a, b)] == [True, False]


# --- through the fleet tier: the fleet example's request against a real redis-server ----------


def _fleet_app() -> Any:
    """examples/fleet_app.py, imported (it is a script, not a module of the package)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import fleet_app
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return fleet_app


@pytest.mark.e2e
@pytest.mark.skipif(redis_binaries() is None, reason="redis-server is not installed")
async def test_through_the_tier_a_body_never_gets_another_s_answer(shm_name: str) -> None:
    """Host ``a`` puts image A (in its memory and in Redis); on host ``b`` a client sends B's
    bytes claiming A's key: refused before any look-up, nothing cached, Redis untouched; B
    without a claim gets B's tensor and A gets A's, on both hosts."""
    fleet = _fleet_app()
    img_a, img_b = fleet.image_bytes(1), fleet.image_bytes(2)
    made: list[str] = []
    with RedisServer() as server:
        client = aioredis.Redis.from_url(server.url)
        ta, tb = (RedisTier(server.url, **hosts.tier_options(server.url)) for _ in "ab")
        config = CacheConfig(16 << 20, 4 << 20, 1, name=shm_name)
        try:
            async with (
                AsyncSenderCache.from_config(config, tier=ta) as a,
                AsyncSenderCache.from_config(replace(config, name=shm_name + "b"), tier=tb) as b,
            ):
                with ReceiverCache.attach(a.handle()) as ra, ReceiverCache.attach(b.handle()) as rb:

                    async def ask(host: AsyncSenderCache, rx: ReceiverCache, **kw: Any) -> Any:
                        [got] = rx.get_and_update_features([await fleet.embed(host, **kw)])
                        return got.data["pixel_values"]

                    def tensor(raw: bytes) -> Any:
                        return fleet.preprocess(raw)["pixel_values"]

                    key_a = content_key(img_a)
                    np.testing.assert_array_equal(
                        await ask(a, ra, raw=img_a, claimed=key_a, made=made), tensor(img_a)
                    )
                    assert await ta.flush(30)
                    in_redis, looked_up = await client.dbsize(), tb.stats().lookups
                    assert in_redis >= 1
                    for claim in (key_a, "photo-1"):
                        with pytest.raises(KeyMismatchError):
                            await ask(b, rb, raw=img_b, claimed=claim, made=made)
                    assert made == [key_a] and b.snapshot().items == 0
                    assert not b.is_cached(key_a) and tb.stats().lookups == looked_up
                    assert await tb.flush(30) and await client.dbsize() == in_redis
                    for host, rx in ((b, rb), (a, ra)):
                        for raw in (img_b, img_a):
                            got = await ask(host, rx, raw=raw, claimed=content_key(raw))
                            np.testing.assert_array_equal(got, tensor(raw))
        finally:
            await client.aclose()

"""Value types cross process boundaries: pickle, msgpack and JSON round trips, validation."""

from __future__ import annotations

import json
import pickle

import msgpack
import pytest

from aioshmcache import CacheHandle, CacheInfo, FeatureSpec, InvalidReferenceError, ShmRef

REF = ShmRef(nonce=(1 << 64) - 1, epoch=3, address=4096, id=(1 << 40) + 7, length=123, tag=99)


def test_ref_round_trips_everywhere() -> None:
    assert pickle.loads(pickle.dumps(REF)) == REF
    assert ShmRef.from_dict(msgpack.unpackb(msgpack.packb(REF.to_dict()))) == REF
    assert ShmRef.from_dict(json.loads(json.dumps(REF.to_dict()))) == REF
    assert hash(REF) == hash(ShmRef.from_dict(REF.to_dict()))
    with pytest.raises(AttributeError):
        REF.id = 5  # type: ignore[misc]


def test_handle_round_trips() -> None:
    h = CacheHandle("aioshm-x", 12345, 1)
    assert pickle.loads(pickle.dumps(h)) == h
    assert CacheHandle.from_dict(msgpack.unpackb(msgpack.packb(h.to_dict()))) == h
    with pytest.raises(InvalidReferenceError):
        CacheHandle.from_dict({"name": "aioshm-x"})


@pytest.mark.parametrize(
    "bad",
    [
        {"nonce": 1},
        {**REF.to_dict(), "extra": 1},
        {**REF.to_dict(), "id": -1},
        {**REF.to_dict(), "id": 1 << 64},
        {**REF.to_dict(), "length": 1.5},
        {**REF.to_dict(), "address": True},
        [1, 2, 3],
        "ref",
    ],
)
def test_ref_from_dict_validates(bad: object) -> None:
    with pytest.raises(InvalidReferenceError):
        ShmRef.from_dict(bad)


def test_cache_info_and_feature_spec() -> None:
    a, b = CacheInfo(3, 10), CacheInfo(1, 4)
    assert (a - b) == CacheInfo(2, 6) and (a - b).misses == 4
    assert CacheInfo(0, 0).hit_ratio == 0.0
    f = FeatureSpec("h", None, identifier="i", prompt_updates=("u",))
    g = f.with_data(REF)
    assert g.data is REF and g.identifier == "i" and g.prompt_updates == ("u",) and f.data is None

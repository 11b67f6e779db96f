"""Value types cross process boundaries: pickle, msgpack and JSON round trips, validation."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pickle
from typing import Any

import msgpack
import pytest

from aioshmcache import (
    CacheHandle,
    CacheInfo,
    CacheSnapshot,
    FeatureSpec,
    InvalidReferenceError,
    ShmRef,
)
from aioshmcache._types import coerce_handle
from aioshmcache.store import ReaderSlotInfo

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


@dataclasses.dataclass(frozen=True, slots=True)
class _GeneratedSpec:
    """``FeatureSpec``'s fields with the dataclass's own generated ``__init__``."""

    mm_hash: str
    data: Any
    identifier: str | None = dataclasses.field(default=None, kw_only=True)
    prompt_updates: Any = dataclasses.field(default=(), kw_only=True)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("h", None), {}),
        (("h", REF), {"identifier": "i"}),
        (("h",), {"data": {"x": 1}, "prompt_updates": ["u"]}),
        ((), {"mm_hash": "h", "data": None, "identifier": None, "prompt_updates": ("u",)}),
        (("h", None, "i"), {}),  # identifier is keyword-only
        (("h",), {}),  # data is required
        (("h", None), {"other": 1}),
        (("h", None), {"mm_hash": "g"}),
    ],
)
def test_feature_spec_init_is_the_dataclass_s(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """``FeatureSpec.__init__`` (its own, faster) takes and sets what the generated one does,
    and refuses what it refuses."""
    try:
        want = _GeneratedSpec(*args, **kwargs)
    except TypeError:
        with pytest.raises(TypeError):
            FeatureSpec(*args, **kwargs)
        return
    got = FeatureSpec(*args, **kwargs)
    names = [f.name for f in dataclasses.fields(FeatureSpec)]
    assert names == [f.name for f in dataclasses.fields(_GeneratedSpec)]
    assert all(getattr(got, n) is getattr(want, n) for n in names)
    assert got == FeatureSpec(*args, **kwargs)
    assert dataclasses.replace(got, data=REF).data is REF
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.data = 1  # type: ignore[misc]
    params = inspect.signature(FeatureSpec).parameters
    assert [(p.name, p.kind, p.default) for p in params.values()] == [
        (p.name, p.kind, p.default) for p in inspect.signature(_GeneratedSpec).parameters.values()
    ]
    assert inspect.signature(FeatureSpec).return_annotation is None  # not the string "None"


def test_a_feature_spec_subclass_is_set_as_the_dataclass_sets_it() -> None:
    """A review's case: a subclass that makes a field a property refuses it at construction, as
    the generated ``__init__`` (``object.__setattr__``, through the class) does; a plain
    subclass is built as a ``FeatureSpec``."""

    class Prop(FeatureSpec):
        __slots__ = ()

        @property
        def identifier(self) -> str:
            return "prop"

    class Plain(FeatureSpec):
        __slots__ = ()

    with pytest.raises(AttributeError):
        Prop("h", 1, identifier="x")
    spec = Plain("h", 1, identifier="x", prompt_updates=["u"])
    assert (spec.mm_hash, spec.data, spec.identifier, spec.prompt_updates) == ("h", 1, "x", ["u"])


def test_prompt_updates_given_as_an_iterator_are_kept_whole() -> None:
    """A review's case: a request reads a spec's updates more than once (its look-up, then its
    put), so a one-shot iterator is kept as a tuple; sequences are kept as given."""
    assert FeatureSpec("h", 1, prompt_updates=iter([1, 2])).prompt_updates == (1, 2)
    assert FeatureSpec("h", 1, prompt_updates=(u for u in "ab")).prompt_updates == ("a", "b")
    given = ["u"]
    assert FeatureSpec("h", 1, prompt_updates=given).prompt_updates is given


# --- handles that travel ------------------------------------------------------------------------

HANDLE = CacheHandle("aioshm-x", (1 << 64) - 1, 1)


def test_handle_json_and_msgpack_round_trips() -> None:
    text = HANDLE.to_json()
    assert json.loads(text) == HANDLE.to_dict() and " " not in text
    assert CacheHandle.from_json(text) == HANDLE
    assert CacheHandle.from_json(text.encode()) == HANDLE
    assert CacheHandle.from_msgpack(HANDLE.to_msgpack()) == HANDLE
    assert CacheHandle.from_msgpack(memoryview(HANDLE.to_msgpack())) == HANDLE
    assert msgpack.unpackb(HANDLE.to_msgpack()) == HANDLE.to_dict()
    assert CacheHandle.from_dict(json.loads(json.dumps(HANDLE.to_dict()))) == HANDLE
    assert pickle.loads(pickle.dumps(HANDLE)) == HANDLE
    assert (
        CacheHandle.from_json('{"name": "x", "nonce": 5, "layout_version": 1}').name == "aioshm-x"
    )


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "{",
        "[1, 2]",
        '"aioshm-x"',
        '{"name": "aioshm-x"}',
        '{"name": "aioshm-x", "nonce": -1, "layout_version": 1}',
        '{"name": "aioshm-x", "nonce": 1.5, "layout_version": 1}',
        '{"name": "bad name!", "nonce": 1, "layout_version": 1}',
        '{"name": 5, "nonce": 1, "layout_version": 1}',
        b"\xff\xfe",
        "{" + " " * 5000 + "}",
    ],
)
def test_handle_from_json_refuses_what_is_not_a_handle(bad: str | bytes) -> None:
    with pytest.raises(ValueError):  # InvalidReferenceError or segment_name's ValueError
        CacheHandle.from_json(bad)


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({"name": "aioshm-x"}),
        msgpack.packb({1: 2}),
        msgpack.packb(HANDLE.to_dict()) + b"\x00",
        msgpack.packb(msgpack.ExtType(1, b"x")),
        b"\xdf\xff\xff\xff\xff",
        bytes(5000),
    ],
)
def test_handle_from_msgpack_refuses_what_is_not_a_handle(bad: bytes) -> None:
    with pytest.raises(InvalidReferenceError):
        CacheHandle.from_msgpack(bad)


@pytest.mark.parametrize(
    "given",
    [
        HANDLE,
        HANDLE.to_dict(),
        HANDLE.to_json(),
        "  " + HANDLE.to_json() + "\n",
        json.dumps(HANDLE.to_dict(), indent=2),
    ],
    ids=["handle", "dict", "json", "json-with-spaces", "json-indented"],
)
def test_coerce_handle_accepts_every_form_of_a_handle(given: object) -> None:
    assert coerce_handle(given) == HANDLE


@pytest.mark.parametrize(
    ("given", "name"),
    [("x", "aioshm-x"), ("aioshm-x", "aioshm-x"), ("/aioshm-y.1", "aioshm-y.1")],
)
def test_coerce_handle_normalises_bare_names(given: str, name: str) -> None:
    got = coerce_handle(given)
    assert type(got) is str and got == name


@pytest.mark.parametrize(
    ("given", "error", "says"),
    [
        (5, TypeError, "got int"),
        (None, TypeError, "got NoneType"),
        (["aioshm-x"], TypeError, "got list"),
        (b"aioshm-x", TypeError, "from_msgpack"),
        (HANDLE.to_msgpack(), TypeError, "got bytes"),
        ("", ValueError, "empty string"),
        ("   ", ValueError, "empty string"),
        ("bad name!", ValueError, "'bad name!'"),
        ("x" * 300, ValueError, "..."),
        ("{not json", InvalidReferenceError, "JSON"),
        ('{"name": "x"}', InvalidReferenceError, "nonce"),
        ({"name": "x", "nonce": "7", "layout_version": 1}, InvalidReferenceError, "nonce"),
        ({"nonce": 1}, InvalidReferenceError, "name"),
    ],
)
def test_coerce_handle_says_what_it_got(given: object, error: type[Exception], says: str) -> None:
    with pytest.raises(error) as info:
        coerce_handle(given)
    assert says in str(info.value)


def test_snapshot_to_dict_is_plain_json() -> None:
    reader = ReaderSlotInfo(
        slot=0, attached=True, alive=True, pid=42, acknowledged=7, lag=1, revoked=False
    )
    snap = CacheSnapshot(
        name="aioshm-x",
        hits=3,
        misses=2,
        inline_too_large=1,
        inline_full=0,
        evictions=4,
        bytes_used=100,
        items=2,
        capacity_bytes=4096,
        epoch=1,
        readers=(reader,),
    )
    d = snap.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["hits"] == 3 and d["capacity_bytes"] == 4096 and d["name"] == "aioshm-x"
    assert d["readers"] == [
        {
            "slot": 0,
            "attached": True,
            "alive": True,
            "pid": 42,
            "acknowledged": 7,
            "lag": 1,
            "revoked": False,
        }
    ]
    assert type(d["readers"]) is list


def test_attach_takes_every_form_of_a_handle(make_config: Any) -> None:
    """``attach`` takes a handle, its dict, its JSON or a name; anything else says what it got."""
    from aioshmcache import ReceiverCache, SegmentNotFoundError, SenderCache

    with SenderCache(make_config(1 << 16, 1 << 12, 4)) as sender:
        h = sender.handle()
        for given in (h, h.to_dict(), h.to_json(), h.name, h.name.removeprefix("aioshm-")):
            with ReceiverCache.attach(given) as receiver:
                assert receiver.handle() == h
        with pytest.raises(TypeError, match="got bytes"):
            ReceiverCache.attach(h.to_json().encode())
        # the JSON form keeps the instance check: a handle of a gone segment instance fails
        stale = CacheHandle(h.name, h.nonce ^ 1, h.layout_version).to_json()
        with pytest.raises((InvalidReferenceError, SegmentNotFoundError)):
            ReceiverCache.attach(stale)


DEEP_JSON = [
    "[" * 4000,
    "{" + '"a":[' * 1000,
    '{"name": [[[[[[[[1]]]]]]]], "nonce": 1, "layout_version": 1}',
    ("[" * 4000).encode(),
    ("[" * 2000).encode("utf-16"),
]


@pytest.mark.parametrize("deep", DEEP_JSON, ids=["lists", "objects", "field", "bytes", "utf16"])
def test_a_deeply_nested_json_handle_is_an_invalid_reference(deep: str | bytes) -> None:
    """4 KB of ``[[[[`` is refused as not a handle, never a RecursionError (issue 19, item 5)."""
    with pytest.raises(InvalidReferenceError):
        CacheHandle.from_json(deep)
    if isinstance(deep, str) and deep.startswith("{"):
        with pytest.raises(InvalidReferenceError):
            coerce_handle(deep)
    with pytest.raises(InvalidReferenceError):
        coerce_handle("{" + "[" * 4000)


def test_brackets_inside_json_strings_are_not_nesting() -> None:
    text = '{"name": "a\\"[[{", "nonce": 1, "layout_version": 1}'
    with pytest.raises(InvalidReferenceError, match="name"):  # parsed: the name is what is wrong
        CacheHandle.from_json(text)


def test_a_bad_handle_name_is_an_invalid_reference() -> None:
    with pytest.raises(InvalidReferenceError, match="name"):
        CacheHandle.from_dict({"name": "bad name!", "nonce": 1, "layout_version": 1})


async def test_async_attach_takes_the_json_and_refuses_a_bad_handle_at_once(
    make_config: Any,
) -> None:
    """``AsyncReceiverCache.attach(text)`` is all a worker needs (no public ``coerce_handle``).

    Review (issue 23): ``coerce_handle`` duplicated ``attach``; docs told workers to call
    ``attach(coerce_handle(text))`` to have a bad handle refused at once. ``attach`` now refuses
    it itself, before the cache is entered.
    """
    import aioshmcache
    from aioshmcache import AsyncReceiverCache, AsyncSenderCache

    assert not hasattr(aioshmcache, "coerce_handle")
    with pytest.raises(InvalidReferenceError):
        AsyncReceiverCache.attach('{"name": "aioshm-x"}')  # no nonce: refused, nothing entered
    with pytest.raises(TypeError, match="got bytes"):
        AsyncReceiverCache.attach(b"aioshm-x")
    async with (
        AsyncSenderCache.from_config(make_config()) as tx,
        AsyncReceiverCache.attach(tx.handle().to_json()) as rx,
    ):
        assert rx.handle() == tx.handle()


def test_attach_with_a_deeply_nested_json_handle_is_an_invalid_reference() -> None:
    from aioshmcache import ReceiverCache

    with pytest.raises(InvalidReferenceError):
        ReceiverCache.attach("{" + "[" * 4000)

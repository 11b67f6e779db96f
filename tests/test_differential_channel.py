"""Differential tests of the channel's compiled steps (``aioshmcache/_core_chan.c``) against
their references, the channel's own Python functions: the frame cuts (``FrameDecoder``), the
bounded unpack of an envelope (``wire.unpack_bounded``), the version-4 call's decode
(``_channel_format.decode_call``) and its encode (``_channel_format.call_frames``'s version-4
form). On random valid inputs both give the same values (types included) and the same bytes;
on malformed, truncated, forged or hostile inputs the compiled step declines (``None``) whatever
the reference refuses, so the reference raises its typed error; it may also decline what it
does not handle (the reference then decides). Skipped where the C core is not built.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from aioshmcache import _channel_format as F
from aioshmcache import wire
from aioshmcache._types import FeatureSpec, ShmRef
from aioshmcache.errors import FrameTooLargeError, SerdeError, WireError

from .test_core import c_core

C = c_core()
pytestmark = pytest.mark.skipif(C is None, reason="the C core is not built here")
if C is not None:
    C.configure_chan(FeatureSpec, ShmRef)

#: 150 examples each: seventeen of these tests run in the default suite, whose time is bounded
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U64 = 2**64 - 1
PLAIN = msgpack.Packer(strict_types=True)  # the channel's plain envelopes' packer

# --- strategies ------------------------------------------------------------------------------

plain_atoms = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=U64)
    | st.floats()
    | st.text(max_size=40)
    | st.text(min_size=30, max_size=300)  # str 8 / 16 headers
    | st.binary(max_size=300)
)
plain = st.recursive(
    plain_atoms,
    lambda children: (
        st.lists(children, max_size=20)
        | st.dictionaries(st.text(max_size=10) | st.binary(max_size=6), children, max_size=18)
    ),
    max_leaves=30,
)
# what plain msgpack does not carry (the encoder declines it: the reference decides)
odd = st.sampled_from(
    [
        (1, 2),
        np.int64(3),
        np.float32(1.5),
        2**64,
        -(2**63) - 1,
        "\ud800",
        bytearray(b"ab"),
        {1: 2},
        [[[[[[]]]]]] * 2,
        type("Sub", (int,), {})(5),
    ]
)
payloads = plain | st.recursive(
    odd | plain_atoms, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(), c)
)
refs = st.builds(ShmRef, *[st.integers(0, U64)] * 8)
hashes = st.text(max_size=70)
idents = st.none() | st.text(max_size=40)
features = st.builds(
    lambda h, d, i: FeatureSpec(h, d, identifier=i), hashes, st.none() | refs, idents
)
# features the version-4 call does not carry (or carries only through the reference)
odd_features = st.one_of(
    st.builds(lambda h: FeatureSpec(h, {"x": 1}), hashes),
    st.builds(lambda h: FeatureSpec(h, None, prompt_updates=[1]), hashes),
    st.builds(lambda h: FeatureSpec(h, None, prompt_updates=[]), hashes),
    st.builds(lambda h: FeatureSpec(h, None, identifier=3), hashes),  # type: ignore[arg-type]
    st.builds(lambda: FeatureSpec(7, None)),  # type: ignore[arg-type]
    st.builds(lambda: FeatureSpec("h", ShmRef(-1, 0, 0, 0, 0, 0, 0, 0))),
    st.builds(lambda: FeatureSpec("h", ShmRef(2**64, 0, 0, 0, 0, 0, 0, 0))),
    st.builds(lambda: FeatureSpec("h", ShmRef(True, 0, 0, 0, 0, 0, 0, 0))),
    st.builds(lambda: FeatureSpec("h", ShmRef(np.uint64(1), 0, 0, 0, 0, 0, 0, 0))),  # type: ignore[arg-type]
    st.builds(lambda: FeatureSpec("h", (1, 2, 3, 4, 5, 6, 7, 8))),
)
feature_lists = st.lists(features, max_size=12)


def mutated(data: bytes, draw: Callable[..., Any]) -> bytes:
    """``data`` cut short, with bytes changed, inserted or appended."""
    how = draw(st.sampled_from(["cut", "flip", "insert", "append"]))
    if not data or how == "append":
        more: bytes = draw(st.binary(min_size=1, max_size=8))
        return data + more
    i = draw(st.integers(0, len(data) - 1))
    if how == "cut":
        return data[:i]
    if how == "flip":
        return data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1 :]
    inserted: bytes = draw(st.binary(min_size=1, max_size=4))
    return data[:i] + inserted + data[i:]


@st.composite
def hostile_envelopes(draw: st.DrawFn) -> bytes:
    base = msgpack.packb([F.TAG, 1, "ok", draw(plain)], use_bin_type=True)
    return mutated(base, draw)


@st.composite
def hostile_calls(draw: st.DrawFn) -> bytes:
    head = one_message(draw(plain), draw(feature_lists))
    assert head is not None
    return mutated(head, draw)


# --- comparison ------------------------------------------------------------------------------


def one_message(payload: Any, specs: Sequence[Any]) -> bytes | None:
    """The version-4 call ``call_frames`` makes of ``payload`` and ``specs`` (its second frame
    empty), or None: it makes the two-frame form, or cannot encode the call."""
    try:
        head, body = F.call_frames(payload, specs)
    except Exception:  # whatever the reference raises: not version 4
        return None
    return head if body == b"" else None


def same(a: Any, b: Any) -> bool:
    """Equal, of the same types all the way down (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return a == b or (math.isnan(a) and math.isnan(b))
    if type(a) is list:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a) is FeatureSpec:
        return (
            same(a.mm_hash, b.mm_hash)
            and same(a.identifier, b.identifier)
            and same(a.prompt_updates, b.prompt_updates)
            and same(a.data, b.data)
        )
    if type(a) is tuple or type(a) is ShmRef:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def outcome(fn: Callable[[], Any]) -> Any:
    """The reference's value, or the type of the error it raised."""
    try:
        return fn()
    except (WireError, SerdeError, FrameTooLargeError) as exc:
        return type(exc)


# --- the envelope's bounded unpack -----------------------------------------------------------


def reference_unpack(data: bytes) -> Any:
    return outcome(lambda: wire.unpack_bounded(data, maps=True))


def check_unpack(data: bytes) -> Any:
    """The compiled unpack against the reference; the compiled result."""
    assert C is not None
    got = C.chan_unpack(data)
    ref = reference_unpack(data)
    if got is not None:
        assert wire.is_plain(data) and type(got) is list
        assert same(got, ref), (data, got, ref)
    elif not wire.is_plain(data):
        pass  # not an array: never taken (``decode`` reads it with the serde)
    return got


@SETTINGS
@given(value=st.lists(plain, max_size=6), single=st.booleans())
def test_valid_envelopes_unpack_alike(value: list[Any], single: bool) -> None:
    try:
        data = msgpack.packb(value, use_single_float=single, use_bin_type=True)
    except OverflowError:  # a double too large for float 32
        assume(False)
    assert check_unpack(data) is not None  # the usual message is taken, not declined


@SETTINGS
@given(data=hostile_envelopes())
def test_malformed_envelopes_are_declined_or_alike(data: bytes) -> None:
    check_unpack(data)


@SETTINGS
@given(data=st.binary(max_size=64).map(lambda b: b"\x94" + b))
@example(data=b"\x91\xc1")
@example(data=b"\x91\xd4\x01\x00")  # an extension record
@example(data=b"\x91\x81\x01\x02")  # an int map key
@example(data=b"\x91\x81\x90\x02")  # a list map key
@example(data=b"\x91\xa2\xff\xfe")  # bad UTF-8
@example(data=b"\xdd\xff\xff\xff\xff")  # announces 4 G elements
@example(data=b"\x92\xc0\xc0\xc0")  # trailing byte
def test_random_bytes_are_declined_or_alike(data: bytes) -> None:
    check_unpack(data)


def test_deep_and_wide_messages_are_declined_where_the_reference_refuses() -> None:
    deep = b"\x91" * 2000 + b"\xc0"  # past msgpack's nesting limit
    assert isinstance(reference_unpack(deep), type)
    assert check_unpack(deep) is None
    wide = msgpack.packb([[]] * 40_000)  # over 32,768 containers
    assert reference_unpack(wide) is WireError
    assert check_unpack(wide) is None
    fits = msgpack.packb([[]] * 30_000)
    assert check_unpack(fits) is not None


# --- the version-4 call ----------------------------------------------------------------------


def reference_call(head: bytes) -> Any:
    """``decode_call`` by its Python steps only (the compiled one switched off)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(F, "_core_call4", lambda head: None)
        m.setattr(F, "_core_unpack", lambda data: None)
        return outcome(lambda: F.decode_call(head, b""))


def check_call(head: bytes) -> Any:
    assert C is not None
    got = C.chan_call4(head)
    ref = reference_call(head)
    if got is not None:
        assert type(ref) is tuple and ref[0] == F.ONE_MESSAGE_VERSION, (head, ref)
        assert same(got[0], ref[1]) and same(got[1], ref[2]), (head, got, ref)
        # the channel's own decode takes the compiled one: the same call
        version, payload, specs = F.decode_call(head, b"")
        assert version == 4 and same(payload, ref[1]) and same(specs, ref[2])
    return got


@SETTINGS
@given(payload=plain, specs=feature_lists)
def test_valid_calls_decode_alike(payload: Any, specs: list[FeatureSpec]) -> None:
    head = one_message(payload, specs)
    assert head is not None
    got = check_call(head)
    assert got is not None  # the usual call is taken
    assert same(got[1], specs)


@SETTINGS
@given(head=hostile_calls())
def test_malformed_calls_are_declined_or_alike(head: bytes) -> None:
    check_call(head)


@pytest.mark.parametrize(
    "row",
    [
        [1, None, None],  # hash not a str
        ["h", 3, None],  # identifier not a str
        ["h", None, b"\x00" * 63],  # short reference
        ["h", None, "x" * 64],  # a str reference
        ["h", None],  # two fields
        ["h", None, None, None],  # four
        ("h", None, {"nonce": 1}),  # a map
    ],
)
def test_forged_rows_are_declined_and_refused(row: Any) -> None:
    assert C is not None
    head = msgpack.packb([F.TAG, 4, "call", None, [row]], use_bin_type=True)
    assert C.chan_call4(head) is None
    assert reference_call(head) is WireError


def test_other_calls_are_declined() -> None:
    assert C is not None
    v3 = F.call_envelope(None)
    assert C.chan_call4(v3) is None
    assert F.decode_call(v3, F.pack_call_features([]))[0] == 3
    bad_verb = msgpack.packb([F.TAG, 4, "cal", None, []])
    assert C.chan_call4(bad_verb) is None and reference_call(bad_verb) is WireError
    too_many = msgpack.packb([F.TAG, 4, "call", None, [["h", None, None]] * 4097])
    assert C.chan_call4(too_many) is None and reference_call(too_many) is WireError
    with pytest.raises(WireError):  # a second frame after a version-4 call: the reference's
        F.decode_call(one_message(None, []) or b"", b"x")


# --- the version-4 call's frames -------------------------------------------------------------


def reference_frames(payload: Any, specs: Sequence[Any], max_bytes: int) -> bytes | None:
    one = one_message(payload, specs)
    if one is None or len(one) > max_bytes:
        return None
    return wire.encode_frame(one) + wire.encode_frame(b"")


def check_frames(payload: Any, specs: Sequence[Any], max_bytes: int = 1 << 30) -> bytes | None:
    assert C is not None
    got: bytes | None = C.chan_call4_frames(payload, specs, max_bytes)
    ref = reference_frames(payload, specs, max_bytes)
    if ref is None:
        assert got is None
    elif got is not None:
        assert got == ref
    return got


@SETTINGS
@given(payload=plain, specs=feature_lists, as_tuple=st.booleans())
def test_valid_calls_encode_to_the_same_bytes(
    payload: Any, specs: list[FeatureSpec], as_tuple: bool
) -> None:
    assert check_frames(payload, tuple(specs) if as_tuple else specs) is not None


@SETTINGS
@given(
    payload=payloads,
    specs=st.lists(features | odd_features, max_size=6),
    max_bytes=st.integers(0, 400) | st.just(1 << 30),
)
def test_odd_calls_encode_alike_or_are_declined(
    payload: Any, specs: list[Any], max_bytes: int
) -> None:
    check_frames(payload, specs, max_bytes)


def test_declines_what_the_one_message_refuses() -> None:
    assert C is not None
    spec = FeatureSpec("h", None)
    for payload in [(1,), np.int64(1), 2**64, "\udc80", {1: 2}, [b"x"] * 2]:
        got = C.chan_call4_frames(payload, [spec], 1 << 20)
        ref = reference_frames(payload, [spec], 1 << 20)
        assert got == ref
    assert C.chan_call4_frames(None, [spec] * 4097, 1 << 30) is None  # over MAX_FEATURES
    assert C.chan_call4_frames(None, iter([spec]), 1 << 30) is None  # not a list or tuple
    deep: list[Any] = []
    for _ in range(100):
        deep = [deep]
    assert reference_frames(deep, [], 1 << 30) is not None
    assert check_frames(deep, []) is None  # deeper than the encoder goes: the reference's


# --- the frame cut ---------------------------------------------------------------------------


def reference_cut(data: bytes, max_bytes: int) -> Any:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(wire, "_core_cut", lambda src, n: None)
        dec = wire.FrameDecoder(max_bytes=max_bytes)
        frames = outcome(lambda: dec.feed(data))
    return frames if isinstance(frames, type) else (frames, len(data) - dec.pending)


@SETTINGS
@given(
    frames=st.lists(st.binary(max_size=40), max_size=6),
    tail=st.binary(max_size=20),
    max_bytes=st.integers(0, 50),
    as_view=st.booleans(),
)
@example(frames=[b"abc"], tail=b"", max_bytes=10, as_view=False)  # one frame: taken
@example(frames=[b""], tail=b"", max_bytes=0, as_view=False)
@example(frames=[b"abc"], tail=b"", max_bytes=2, as_view=False)  # over max_bytes: declined
@example(frames=[], tail=struct.pack("<Q", U64), max_bytes=10, as_view=False)
def test_frames_cut_alike(frames: list[bytes], tail: bytes, max_bytes: int, as_view: bool) -> None:
    """``chan_cut`` cuts what the decoder cuts; ``chan_frame`` (the gateway's usual answer)
    gives the payload exactly when the decoder cuts one frame with nothing left over, and
    declines anything else (any other buffer than bytes too)."""
    assert C is not None
    data = b"".join(struct.pack("<Q", len(f)) + f for f in frames) + tail
    ref = reference_cut(data, max_bytes)
    src: Any = memoryview(bytearray(data)) if as_view else data
    got = C.chan_cut(src, max_bytes)
    if ref is FrameTooLargeError:
        assert got is None
    else:
        assert got == ref
    one = C.chan_frame(src, max_bytes)
    if not as_view and type(ref) is tuple and len(ref[0]) == 1 and ref[1] == len(data):
        assert type(one) is bytes and one == ref[0][0]
    else:
        assert one is None


def test_the_decoder_still_raises_over_max_bytes() -> None:
    dec = wire.FrameDecoder(max_bytes=4)
    assert dec.feed(struct.pack("<Q", 3) + b"abc" + struct.pack("<Q", 2) + b"d") == [b"abc"]
    with pytest.raises(FrameTooLargeError):  # the pending frame whole, then 5 > 4
        dec.feed(b"e" + struct.pack("<Q", 5))
    with pytest.raises(Exception, match="out of step"):
        dec.feed(b"")
    assert C is not None and C.chan_cut(struct.pack("<Q", U64), 10) is None


# --- the worker's read of a whole call -------------------------------------------------------


def reference_take_call(data: bytes, max_bytes: int) -> Any:
    """What the worker's connection makes of ``data`` received at once: the frames cut
    (``FrameDecoder``), then a call of exactly two frames decoded (``decode_call``)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(wire, "_core_cut", lambda src, n: None)
        frames = outcome(lambda: wire.FrameDecoder(max_bytes=max_bytes).feed(data))
    if type(frames) is not list or len(frames) != 2:
        return None  # not one whole call: another frame count, or a framing error
    return reference_call(frames[0]) if frames[1] == b"" else None


def check_take_call(data: bytes, max_bytes: int = 1 << 30) -> Any:
    assert C is not None
    got = C.chan_take_call(data, max_bytes)
    ref = reference_take_call(data, max_bytes)
    if got is not None:
        assert type(ref) is tuple and ref[0] == F.ONE_MESSAGE_VERSION, (data, ref)
        assert same(got[0], ref[1]) and same(got[1], ref[2]), (data, got, ref)
    return got


@SETTINGS
@given(payload=plain, specs=feature_lists)
def test_a_whole_call_is_cut_and_decoded_alike(payload: Any, specs: list[FeatureSpec]) -> None:
    framed = C.chan_call4_frames(payload, specs, 1 << 30) if C is not None else None
    assert framed is not None
    got = check_take_call(framed)
    assert got is not None and same(got[1], specs)  # the usual call is taken


@SETTINGS
@given(payload=plain, specs=feature_lists, data=st.data(), max_bytes=st.integers(0, 600))
def test_odd_bytes_are_declined_or_taken_alike(
    payload: Any, specs: list[FeatureSpec], data: st.DataObject, max_bytes: int
) -> None:
    head = one_message(payload, specs)
    assert head is not None
    framed = wire.encode_frame(head) + wire.encode_frame(b"")
    odd = data.draw(
        st.sampled_from(
            [
                framed,  # under max_bytes or not
                framed[:-1],  # the empty frame cut short
                framed + b"\x00",  # a byte more
                framed + framed,  # two calls
                wire.encode_frame(head) + wire.encode_frame(b"x"),  # a second frame not empty
                wire.encode_frame(head),  # one frame
            ]
        )
    )
    if data.draw(st.booleans()):
        odd = mutated(odd, data.draw)
    check_take_call(odd, max_bytes)


# --- the answer ------------------------------------------------------------------------------


def reference_ok_frame(result: Any, max_bytes: int) -> bytes | None:
    """The worker's plain ok answer as its frame when plain msgpack carries it (``encode``
    takes the serde's form otherwise), or None."""
    try:
        answer = PLAIN.pack([F.TAG, F.ANSWER_VERSION, "ok", result])
    except (TypeError, ValueError, OverflowError):
        return None
    if len(answer) > max_bytes:
        return None
    assert answer == F.encode([F.TAG, F.ANSWER_VERSION, "ok", result], plain=True)
    return wire.encode_frame(answer)


def reference_ok_result(answer: bytes) -> Any:
    """The gateway's read of an answer: ``(result,)`` of an ok answer, None for an error
    answer, the error's type for a malformed one."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(F, "_core_unpack", lambda data: None)
        value = outcome(lambda: F.decode(answer, "response"))
    if isinstance(value, list) and value[2] == "ok" and len(value) == 4:
        return (value[3],)
    return value if isinstance(value, type) else None


@SETTINGS
@given(result=payloads, max_bytes=st.integers(0, 300) | st.just(1 << 30))
def test_answers_encode_to_the_same_frame_or_are_declined(result: Any, max_bytes: int) -> None:
    """(A ``bytearray`` the reference packs, or nesting past 64, is declined.)"""
    assert C is not None
    got = C.chan_ok_frame(result, max_bytes)
    if got is not None:
        assert got == reference_ok_frame(result, max_bytes)


@SETTINGS
@given(result=plain)
def test_plain_answers_are_taken(result: Any) -> None:
    assert C is not None
    got = C.chan_ok_frame(result, 1 << 30)
    assert got is not None and got == reference_ok_frame(result, 1 << 30)


@SETTINGS
@given(result=plain)
def test_valid_answers_read_alike(result: Any) -> None:
    assert C is not None
    answer = msgpack.packb([F.TAG, 1, "ok", result], use_bin_type=True)
    got = C.chan_ok_result(answer)
    assert got is not None and same(got[0], reference_ok_result(answer)[0])


@SETTINGS
@given(answer=hostile_envelopes())
@example(answer=F.error_frame("handler", ValueError("x"), plain=True))
@example(answer=msgpack.packb([F.TAG, 1, "ok", 1, 2]))
@example(answer=msgpack.packb([F.TAG, 2, "ok", 1]))
@example(answer=msgpack.packb([F.TAG, True, "ok", 1]))
@example(answer=F.encode([F.TAG, 1, "ok", (1, 2)]))  # the serde's form
def test_other_answers_are_declined_or_read_alike(answer: bytes) -> None:
    assert C is not None
    got = C.chan_ok_result(answer)
    ref = reference_ok_result(answer)
    if got is not None:
        assert type(ref) is tuple and same(got[0], ref[0]), (answer, got, ref)

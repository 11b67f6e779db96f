"""Differential tests: the compiled core and its pure-Python reference give the same answers
and the same errors (property tests over random inputs).

Skipped where the C core is not built (the reference is then the only core there is); CI runs
this file on the plain C build and on one built with ASan and UBSan.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioshmcache import _core_py, _types

from .test_core import c_core

C = c_core()
pytestmark = pytest.mark.skipif(C is None, reason="the C core is not built here")

U64 = st.integers(0, (1 << 64) - 1)
WORDISH = st.one_of(
    U64,
    st.integers(-(1 << 70), -1),
    st.integers(1 << 64, 1 << 70),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
    st.text(max_size=3),
)


def _outcome(fn: Any, *args: object) -> tuple[str, object]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:
        return ("error", type(exc))


@settings(max_examples=300, deadline=None)
@given(st.tuples(U64, U64, U64, U64, U64, U64), U64)
def test_tags_agree_on_64_bit_words(fields: tuple[int, ...], seq: int) -> None:
    assert C is not None
    base = C.tag_base(*fields)
    assert base == _core_py.tag_base(*fields) == _types.tag_base(*fields) & ((1 << 64) - 1)
    assert C.finish_tag(base, seq) == _core_py.finish_tag(base, seq)
    secret, epoch, address, cid, length, position = fields
    assert C.finish_tag(base, seq) == _types.reference_tag(
        secret, epoch, address, cid, length, position, seq
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(WORDISH, min_size=6, max_size=6))
def test_tags_refuse_the_same_inputs(fields: list[object]) -> None:
    assert C is not None
    assert _outcome(C.tag_base, *fields) == _outcome(_core_py.tag_base, *fields)
    assert _outcome(C.finish_tag, *fields[:2]) == _outcome(_core_py.finish_tag, *fields[:2])


def test_wrong_argument_counts_are_type_errors_in_both() -> None:
    assert C is not None
    for core in (C, _core_py):
        with pytest.raises(TypeError):
            core.tag_base(1, 2, 3)
        with pytest.raises(TypeError):
            core.finish_tag(1)

"""The sender's kept prompt updates (``aioshmcache._kept``): untracked by the garbage collector,
given back equal, with the same types, and the same objects where identity matters."""

from __future__ import annotations

import dataclasses
import enum
import gc
import subprocess
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgpack import ExtType

from aioshmcache import SenderCache, ShmRef
from aioshmcache._core_api import implementation
from aioshmcache._kept import (
    KEPT,
    MAX_DEPTH,
    keep,
    keep_compiled,
    keep_py,
    restore,
    restore_compiled,
    restore_py,
)
from aioshmcache.tools.bench.vllm_shapes import Details as VDetails
from aioshmcache.tools.bench.vllm_shapes import image_updates


class Mode(str, enum.Enum):  # noqa: UP042 (vLLM's UpdateMode is a (str, Enum))
    INSERT = "insert"
    REPLACE = "replace"


class Level(enum.IntEnum):
    LOW = 1


@dataclass
class Details:  # vLLM's PromptUpdateDetails
    full: list[int]
    is_embed: Callable[[list[int]], Any] | None = None


@dataclass(frozen=True)
class Update:  # vLLM's ResolvedPromptUpdate
    modality: str
    item_idx: int
    mode: Mode
    target: list[int]
    content: Details = field(repr=False)


@dataclass(frozen=True, slots=True)
class Slotted:
    a: int
    b: tuple[Any, ...]


@dataclass
class Extra:
    x: int

    def __post_init__(self) -> None:
        self.cached = self.x * 2  # not a field: kept too


def vllm_like(i: int, embed: Callable[[list[int]], Any] | None = None) -> tuple[Update, ...]:
    return (Update("image", i, Mode.REPLACE, [32000], Details([32000] * 576, embed)),)


def test_vllm_shaped_updates_are_packed_untracked_and_come_back_equal() -> None:
    given_ = vllm_like(3)
    kept = keep(given_)
    assert type(kept) is tuple and kept[0] is KEPT and kept[1] is None  # atoms only:
    # the C core untracks it at once (no young collection walks its ~600 items, a stall of
    # milliseconds every ~700 puts); on the pure core the first collection that sees it does
    assert gc.is_tracked(kept) is (implementation() == "python")
    gc.collect()  # on the pure core: the runs' tuple in it, and it if it came after that one
    gc.collect()  # ... else at the next collection
    assert not gc.is_tracked(kept)
    atoms = (str, int, float, bool, bytes, type(None))
    assert all(type(x) in atoms or all(type(y) in atoms for y in x) for x in kept)
    assert len(kept) < 40  # the 576 token ids, one object repeated, are one run
    got = restore(kept)
    assert got == given_ and type(got) is tuple and got is not given_
    assert got[0].mode is Mode.REPLACE  # enum members by identity
    assert type(got[0].content) is Details and type(got[0].content.full) is list
    got[0].content.full.append(1)  # a new list: the kept form is not shared with anyone
    assert restore(kept) == given_


def test_objects_msgpack_cannot_write_are_kept_by_reference() -> None:
    def is_embed(full: list[int]) -> Any:
        return full

    is_embed.tag = "mine"  # type: ignore[attr-defined]  # an attribute: not as its def made it
    arr = np.arange(3)
    given_ = (*vllm_like(1, is_embed), arr)
    kept = keep(given_)
    assert kept[0] is KEPT and type(kept[2]) is tuple
    assert kept[1][0] is is_embed and kept[1][1] is arr
    assert gc.is_tracked(kept[2]) is (implementation() == "python")
    gc.collect()
    gc.collect()
    assert gc.is_tracked(kept)  # it holds them: this small entry stays tracked, as before
    assert not gc.is_tracked(kept[2])  # the records, atoms only, do not
    got = restore(kept)
    assert got[0] == given_[0] and got[0].content.is_embed is is_embed and got[1] is arr


def _fn_state(f: Any) -> tuple[Any, ...]:
    """All a plain function is: what a function kept as its definition must come back with."""
    held = None if f.__closure__ is None else tuple(c.cell_contents for c in f.__closure__)
    return (
        f.__code__,
        f.__globals__,
        f.__name__,
        f.__qualname__,
        f.__module__,
        f.__doc__,
        f.__defaults__,
        f.__kwdefaults__,
        f.__annotations__,
        held,
    )


@pytest.mark.parametrize("maker", ["select_token_id", "select_token_ids"])
def test_closures_are_kept_as_their_definition_and_cells_untracked(maker: str) -> None:
    """Issue 29, first lap: vLLM's ``select_token_id`` makes a closure per item (the function,
    its cell, its annotations' tuple and ``list[int]``: four tracked objects per cached item,
    full collections of 132 ms). It is kept as its definition's number and what its cells
    hold: nothing tracked; it comes back a new function equal in all it is, that works."""
    make = getattr(VDetails, maker)
    token = [32000] if maker == "select_token_ids" else 32000
    updates = (Update("image", 0, Mode.REPLACE, [32000], make([32000] * 576, token)),)
    f = updates[0].content.is_embed
    kept = keep(updates)
    assert kept[0] is KEPT and kept[1] is None  # nothing by reference
    assert gc.is_tracked(kept) is (implementation() == "python")  # untracked at once in C
    gc.collect()
    gc.collect()  # on the pure core: the collections that walk it untrack it
    assert not gc.is_tracked(kept) and len(kept) < 60
    got = restore(kept)
    g = got[0].content.is_embed
    assert g is not None and f is not None and g is not f and type(g) is type(f)
    assert _fn_state(g) == _fn_state(f)
    assert g([32000, 1]).tolist() == f([32000, 1]).tolist() == [True, False]
    assert got[0].content.full == updates[0].content.full and got[0].mode is Mode.REPLACE
    # the next item's closure (a new function, cell and list[int]) is kept alike: the walk
    # compares its annotations with its definition's, equal but not the same objects
    later = (make([7] * 3, [7] if maker == "select_token_ids" else 7),)
    k2 = keep(later)
    assert k2[0] is KEPT and k2[1] is None  # not by reference: its definition's
    assert restore(k2)[0].is_embed([7, 8]).tolist() == [True, False]
    if implementation() != "python":
        assert keep_compiled(later) == keep_py(later) == k2
        c = restore_compiled(k2)
        assert c is not None
        assert _fn_state(c[0][0].is_embed) == _fn_state(restore_py(k2)[0].is_embed)


def _closure_over(v: Any) -> Any:
    def f(x: int = 3, *, k: Any = (1,)) -> Any:
        """A closure with defaults, keyword defaults and a doc."""
        return (v, x, k)

    return f


def _module_function(full: list[int]) -> Any:
    return full


class _Holder:
    def method(self) -> int:
        return 1

    @staticmethod
    def static() -> int:
        return 2


_module_lambda = lambda: 3  # noqa: E731  (its module names it "_module_lambda", not "<lambda>")


def test_a_function_its_module_names_comes_back_the_same_object() -> None:
    """A module's function or a class's method (``module.qualname`` is that very function) is
    numbered once and comes back itself, as vLLM would give it back; a lambda its module holds
    under another name is not named so, and comes back a new function."""
    given_ = (_module_function, _Holder.method, _Holder.static, Details([1], _module_function))
    kept = keep(given_)
    assert kept[0] is KEPT and kept[1] is None  # nothing by reference
    got = restore(kept)
    assert got[0] is _module_function and got[1] is _Holder.method and got[2] is _Holder.static
    assert got[3].is_embed is _module_function and got == given_
    lam = restore(keep((_module_lambda,)))[0]
    assert lam is not _module_lambda and lam() == 3
    if implementation() != "python":
        assert keep_compiled(given_) == keep_py(given_) == kept
        # (the C walk leaves a function with no "<locals>" to the Python walk: named or not)
        assert keep_compiled((_module_lambda,)) in (None, keep_py((_module_lambda,)))
        c = restore_compiled(kept)
        assert c is not None and c[0][0] is _module_function and c[0][2] is _Holder.static


def test_a_function_differing_from_its_definition_is_kept_by_reference() -> None:
    """Only a function as its ``def`` made it is kept as its definition: renamed, an attribute
    set, other annotations than the first met, other globals, an empty cell: each kept by
    reference, the caller's own; and a caller's object raising in the comparison: the updates
    kept as given."""
    plain = _closure_over(1)
    assert keep((plain,))[1] is None  # numbers the definition
    renamed = _closure_over(2)
    renamed.__name__ = "other"
    tagged = _closure_over(3)
    tagged.tag = 1
    annotated = _closure_over(4)
    annotated.__annotations__ = {"x": str}
    elsewhere = FunctionType(
        plain.__code__, {"__name__": "elsewhere"}, None, None, plain.__closure__
    )

    def unbound() -> Any:
        return later  # a cell still empty at the put

    for f in (renamed, tagged, annotated, elsewhere, unbound):
        kept = keep((f,))
        assert kept[1] == (f,), f
        assert restore(kept)[0] is f
        if implementation() != "python":
            assert keep_compiled((f,)) in (None, kept)
    later = 1

    class Raises:
        def __eq__(self, other: object) -> bool:
            raise RuntimeError("no")

        __hash__ = None  # type: ignore[assignment]

    odd = _closure_over(5)
    odd.__doc__ = Raises()
    given_ = (odd,)
    assert keep(given_) is given_
    assert unbound() == 1


class _Namespace:  # something a namespace of exec's holds
    pass


def test_functions_exec_makes_per_item_leave_the_registry_and_their_namespaces_alone() -> None:
    """A function made per item in a namespace of ``exec``'s (its code new each time) is kept
    by reference: its definition would have kept that namespace, and all it holds, for the life
    of the process once its item had left the cache."""
    alive = []
    for i in range(20):
        ns: dict[str, Any] = {"__name__": __name__, "held": _Namespace()}
        alive.append(weakref.ref(ns["held"]))
        exec(f"def make(t):\n    def f(x):\n        return x == t + {i}\n    return f\n", ns)
        f = ns["make"](i)
        kept = keep((f,))
        assert restore(kept)[0](2 * i) and kept[1] == (f,)
        del ns, f, kept
    gc.collect()
    assert [r for r in alive if r() is not None] == []


def _other_closure(v: Any) -> Any:
    def f(x: int = 3, *, k: Any = (1,)) -> Any:
        return ("other", v, x, k)

    return f


def test_a_function_its_comparison_changes_is_kept_as_it_is_left() -> None:
    """A caller's ``__eq__`` run by the comparison with the definition (of its module, its
    doc) that sets an attribute on the function, gives it another code or other annotations:
    both walks see the function as the comparison left it, and keep it by reference (the
    caller's own, with that attribute, code or annotations), never as a copy of its definition
    without them."""
    assert keep((_closure_over(0),))[1] is None  # numbers the definition
    doc = _closure_over(0).__doc__

    class Tags:  # equal to the definition's module, tagging the function on the way
        def __eq__(self, other: object) -> bool:
            f.tag = 1
            return other == __name__

        __hash__ = None  # type: ignore[assignment]

    class Swaps:  # equal to the definition's doc, giving the function another code
        def __eq__(self, other: object) -> bool:
            g.__code__ = _other_closure(0).__code__
            return bool(other == doc)

        __hash__ = None  # type: ignore[assignment]

    class Annotates:  # equal to the definition's module, giving the function other annotations
        def __eq__(self, other: object) -> bool:
            h.__annotations__ = {"x": str}
            return other == __name__

        __hash__ = None  # type: ignore[assignment]

    f, g, h = _closure_over(1), _closure_over(2), _closure_over(3)
    f.__module__ = Tags()
    g.__doc__ = Swaps()
    h.__module__ = Annotates()

    def as_given() -> None:  # before each walk: the functions as the caller passes them
        f.__dict__.clear()
        g.__code__ = _closure_over(0).__code__
        h.__annotations__ = _closure_over(0).__annotations__

    for fn in (f, g, h):
        as_given()
        compiled = keep_compiled((fn,))
        as_given()
        want = keep_py((fn,))
        assert want[1] == (fn,)  # by reference
        if implementation() != "python":
            assert compiled in (None, want)
        as_given()
        assert restore(keep((fn,)))[0] is fn


@dataclass
class _Rebinds:  # a default whose walk (its instance dict read) rebinds the function's kwdefaults
    a: int = 1

    def __getattribute__(self, name: str) -> Any:
        if name == "__dict__":
            for f in _rebound:
                f.__kwdefaults__ = {"k": 99}
        return object.__getattribute__(self, name)


_rebound: list[Any] = []


def test_a_function_is_kept_as_it_was_met_whatever_the_walk_of_its_defaults_runs() -> None:
    """Its defaults, keyword defaults and cells are read when the function is met, before any
    of them is walked: a default whose walk runs a caller's code rebinding the function's
    keyword defaults changes nothing kept, on both walks alike."""
    keep((_closure_over(0), _Rebinds()))  # numbers the definition and the class
    f = _closure_over(5)
    f.__defaults__ = (_Rebinds(),)
    _rebound.append(f)
    try:
        kept = {}
        for walk in (keep_py, keep_compiled, keep):
            f.__kwdefaults__ = {"k": 1}
            kept[walk] = walk((f,))
        assert kept[keep_py][1] is None  # nothing by reference
        assert kept[keep_compiled] in (None, kept[keep_py])
        assert restore(kept[keep])[0]() == (5, _Rebinds(), 1)
    finally:
        _rebound.clear()


def test_a_function_comes_back_with_its_defaults_and_cells_as_they_were_at_the_put() -> None:
    """Defaults and keyword defaults are kept as records, the cells' contents copied as any
    value (a list: a new list); a cell rebound after the put is not carried over."""
    box = [1, 2]
    f = _closure_over(box)
    f.__defaults__ = (9,)
    f.__kwdefaults__ = {"k": [Details([5])]}
    kept = keep((f,))
    box.append(3)
    g = restore(kept)[0]
    assert g() == ([1, 2], 9, [Details([5])]) and g(x=0, k=2) == ([1, 2], 0, 2)
    assert f() == ([1, 2, 3], 9, [Details([5])])
    for _ in range(3):  # every look-up: a new function, new cells, a new list
        h = restore(kept)[0]
        assert h is not g and h.__closure__[0] is not g.__closure__[0]
        assert h()[0] is not g()[0] and h() == g()

    def counter() -> Any:
        n = 0

        def step() -> int:
            nonlocal n
            n += 1
            return n

        return step

    step = counter()
    kept = keep((step,))
    assert step() == 1 and step() == 2
    again = restore(kept)[0]
    assert again() == 1 and again() == 2 and restore(kept)[0]() == 1


def test_a_closure_over_itself_comes_back_callable() -> None:
    """A function whose cell holds itself (a recursive inner ``def``): copied once, its cell
    holding the caller's own (a function met again in one walk is kept by reference)."""

    def outer() -> Any:
        def fact(n: int) -> int:
            return 1 if n <= 1 else n * fact(n - 1)

        return fact

    fact = outer()
    got = restore(keep((fact,)))[0]
    assert got(5) == 120 and got is not fact and got.__closure__[0].cell_contents is fact
    if implementation() != "python":
        assert keep_compiled((fact,)) == keep_py((fact,))


def test_closures_over_a_table_of_them_are_each_copied_once() -> None:
    """Closures over a table (a dict) of closures over that table: each copied once, not once
    per path to it (down to ``MAX_DEPTH``: 3 ** 10 copies of 3 closures, 0.05 s a put and
    0.7 s a look-up; 4 ** 10 of 4)."""

    def table(n: int) -> Any:
        handlers: dict[int, Any] = {}

        def make(i: int) -> Any:
            def handle(x: int) -> Any:
                return handlers[(i + 1) % n](x - 1) if x else i

            return handle

        handlers.update((i, make(i)) for i in range(n))
        return handlers[0]

    f = table(3)
    kept = keep((f,))
    handlers = next(c.cell_contents for c in f.__closure__ if type(c.cell_contents) is dict)
    assert all(any(x is h for h in handlers.values()) for x in kept[1])  # by reference
    assert len(kept[2]) < 150
    got = restore(kept)[0]
    assert got is not f and [got(x) for x in range(5)] == [f(x) for x in range(5)]
    if implementation() != "python":
        assert keep_compiled((f,)) == keep_py((f,))


_NUMBERS_AMID_A_NUMBERING = """
import dataclasses, gc
from aioshmcache._kept import keep, restore

for i in range(1, 40):  # a new definition and a new class for each threshold
    exec(
        f"def make{i}(v):\\n    def f(x: int) -> int:\\n        return x + v\\n    return f\\n"
        f"@dataclasses.dataclass\\nclass Fresh{i}:\\n    a: int\\n",
        globals(),
    )

class Finalized:  # a put amid the walk: updates of a class met for the first time
    def __init__(self, i):
        self.me, self.i = self, i  # a cycle: only a collection frees it

    def __del__(self):
        assert restore(keep((globals()[f"Fresh{self.i}"](self.i),)))[0].a == self.i

gc.freeze()
for i in range(1, 40):  # each threshold starts the collection at another allocation
    f = globals()[f"make{i}"](1)
    gc.collect()
    Finalized(i)
    gc.set_threshold(i)
    kept = keep((f,))  # numbers f's definition
    gc.set_threshold(700)
    gc.collect()
    assert restore(kept)[0](1) == 2
print("done")
"""


def test_a_finalizer_keeping_updates_amid_a_numbering_does_not_deadlock() -> None:
    """A collection started by an allocation of the walk may run a finalizer that keeps updates
    (a put amid a put, as ``test_core_reentry.py``'s) numbering a class or a definition too, on
    the same thread (on 3.12 and later, at any step after an allocation): that keep numbers
    what it meets too, and both come back, never waiting forever on the registry's lock its own
    thread holds. In a process of its own: a deadlock there leaves this one's registry alone."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _NUMBERS_AMID_A_NUMBERING],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a finalizer keeping updates amid a numbering waits forever on the lock")
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr


def test_every_shape_round_trips_with_its_types() -> None:
    odd = OrderedDict(a=1)
    given_ = (
        {(1, "k"): [Slotted(1, (2, "x"))], "d": {"n": None, 5: 2.5}},
        Slotted(3, ()),
        Extra(4),
        [(), [b"b", True, Level.LOW, Mode.INSERT]],
        ExtType(5, b"caller's own"),
        odd,
        -(2**63),
        2**64 - 1,
    )
    got = restore(keep(given_))
    assert got == given_
    assert type(got[0]) is dict and type(next(iter(got[0]))) is tuple
    assert type(got[1]) is Slotted and got[2].cached == 8 and type(got[3][0]) is tuple
    assert got[3][1][2] is Level.LOW and got[4] == ExtType(5, b"caller's own")
    assert got[5] is odd  # a dict subclass: kept by reference


@dataclass
class OwnNew:
    x: int

    def __new__(cls, x: int) -> OwnNew:  # a bare instance cannot be made again
        return super().__new__(cls)


@dataclass
class ExtraSlot:
    __slots__ = ("hidden", "x")  # a slot that is no field
    x: int


def test_dataclasses_that_cannot_be_made_again_field_by_field_are_kept_by_reference() -> None:
    own, extra = OwnNew(1), ExtraSlot(2)
    setattr(extra, "hidden", "h")  # noqa: B010 (a slot mypy does not know of)
    kept = keep((own, extra, Details([3])))
    assert type(kept) is tuple and kept[1] == (own, extra)
    got = restore(kept)
    assert got[0] is own and got[1] is extra and got[2] == Details([3])


@dataclass(slots=True)
class Later:
    a: int
    later: Any = field(init=False)  # set after it is made, or never


def test_a_slotted_instance_with_a_field_unset_is_kept_by_reference(make_config: Any) -> None:
    """A slotted dataclass instance with a field never set (``field(init=False)``) cannot be
    made again field by field: it is kept by reference, as what cannot be packed is, not an
    ``AttributeError`` out of the put after its item was cached (the put's reference never
    reached its caller, and the item's look-ups gave ``[]`` for its updates)."""
    obj = Later(1)
    kept = keep((obj, Details([1])))
    assert kept[0] is KEPT and kept[1] == (obj,)
    got = restore(kept)
    assert got[0] is obj and got[1] == Details([1])
    with SenderCache(make_config(1 << 20, 1 << 18, 1)) as tx:
        ref, updates = tx.get_and_update_item(({"x": np.arange(4, dtype=np.uint8)}, [obj]), "k")
        assert isinstance(ref, ShmRef) and updates[0] is obj
        tx.release(ref)
        ref, updates = tx.get_and_update_item(None, "k")
        assert type(updates) is list and len(updates) == 1 and updates[0] is obj
        tx.release(ref)


@dataclass
class Touchy:  # a caller's object whose instance dict cannot be read
    x: int

    def __getattribute__(self, name: str) -> Any:
        if name == "__dict__":
            raise ValueError("not today")
        return object.__getattribute__(self, name)


def test_updates_whose_walk_raises_are_kept_as_given(make_config: Any) -> None:
    """Updates holding an object that raises while it is walked (here its ``__dict__``) are
    kept as given, by reference: the put succeeds and its look-ups give them back, never an
    error out of the put after its item was cached."""
    obj = Touchy(1)
    given_ = (obj, Details([1]))
    assert keep(given_) is given_ and restore(given_) is given_
    with SenderCache(make_config(1 << 20, 1 << 18, 1)) as tx:
        ref, updates = tx.get_and_update_item(({"x": np.arange(4, dtype=np.uint8)}, [obj]), "k")
        assert isinstance(ref, ShmRef) and updates[0] is obj
        tx.release(ref)
        ref, updates = tx.get_and_update_item(None, "k")
        assert updates == [obj] and updates[0] is obj
        tx.release(ref)
        assert tx.snapshot().items == 1


def test_atoms_non_tuples_and_what_cannot_be_packed_are_kept_as_they_are() -> None:
    atoms = ("<image>", 3, 2.5, None, b"x", True)
    assert keep(atoms) is atoms and keep(()) == () and restore(atoms) is atoms
    custom = [Update("image", 0, Mode.INSERT, [1], Details([1]))]  # not a tuple: the caller's
    assert keep(custom) is custom and restore(custom) is custom
    fake = (bytes(bytearray(KEPT)), 1)  # equal to the mark, not the mark: a caller's tuple
    assert keep(fake) is fake and restore(fake) is fake and restore(keep(b"raw")) == b"raw"
    cyclic: list[Any] = [Details([1])]
    cyclic.append(cyclic)
    r = restore(keep((cyclic,)))[0]
    for _ in range(MAX_DEPTH + 2):  # copies down to MAX_DEPTH, then the caller's list itself
        if r is cyclic:
            break
        assert type(r) is list and r[0] == Details([1])
        r = r[1]
    assert r is cyclic
    mixed = [1, Details([2])]  # a list of atoms, at first sight
    got = restore(keep((mixed,)))
    assert got == (mixed,) and got[0][1] is not mixed[1]
    huge = (2**70, Details([1]), (KEPT, 1))
    assert restore(keep(huge)) == huge


_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.sampled_from([Mode.INSERT, Level.LOW]),
)
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 9)), inner, max_size=3),
        st.builds(Details, st.lists(st.integers(0, 2**31), max_size=4)),
        st.builds(Slotted, st.integers(), st.lists(inner, max_size=3).map(tuple)),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_values, max_size=4).map(tuple))
def test_any_nested_updates_come_back_equal_and_of_the_same_types(updates: tuple[Any, ...]) -> None:
    got = restore(keep(updates))
    assert got == updates

    def shape(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return (type(v), [shape(x) for x in v])
        if isinstance(v, dict):
            return (dict, {k: shape(x) for k, x in v.items()})
        return type(v)

    assert shape(got) == shape(updates)


_with_runs = st.one_of(
    _values,
    st.builds(
        lambda x, k: [x] * k, st.one_of(st.integers(0, 3), st.text(max_size=1)), st.integers(1, 7)
    ),
    st.builds(
        lambda a, b, k: [a, *[b] * k, a], st.integers(0, 2), st.integers(3, 4), st.integers(0, 5)
    ),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_with_runs, max_size=4).map(tuple))
def test_the_core_keeps_the_records_the_python_walk_makes(updates: tuple[Any, ...]) -> None:
    """The C core's walk (``keep_compiled``) makes exactly the records of ``keep_py``, its
    reference (codes, counts, atoms, runs, what is kept by reference), once the registry has
    met the classes; the pure core declines, and ``keep`` then walks in Python."""
    want = keep_py(updates)  # numbers every class and enum member it meets
    got = keep_compiled(updates)
    if implementation() == "python":
        assert got is None
    else:
        assert got == want and type(got) is type(want)
    assert keep(updates) == want and restore(want) == updates


def _shape(v: Any) -> Any:
    """A value's types all the way down, and the identity of what must stay the same object."""
    if isinstance(v, (list, tuple)):
        return (type(v), [_shape(x) for x in v])
    if isinstance(v, dict):
        return (dict, {k: _shape(x) for k, x in v.items()})
    if isinstance(v, enum.Enum) or callable(v):
        return (type(v), id(v))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v), _shape(dataclasses.asdict(v)))
    return type(v)


@settings(max_examples=150, deadline=None)
@given(st.lists(_with_runs, max_size=4).map(tuple))
def test_the_core_restores_what_the_python_steps_restore(updates: tuple[Any, ...]) -> None:
    """The C core's ``restore_kept`` (``restore_compiled``) makes the updates again as
    ``restore_py``, its reference: equal, of the same types all the way down, enum members and
    what was kept by reference the same objects; it declines nothing ``keep`` made (the pure
    core declines all)."""
    kept = keep(updates)
    want = restore_py(kept)
    got = restore_compiled(kept)
    if kept is updates or implementation() == "python":
        assert got is None
    else:
        assert got is not None and got[0] == want == updates
        assert _shape(got[0]) == _shape(want) == _shape(updates)
    assert restore(kept) == updates


def _norm(v: Any) -> Any:
    """A value with every plain function replaced by all it is (``_fn_state``), all the way
    down: what a function kept as its definition must come back equal to."""
    if type(v) is FunctionType:
        return ("fn", *map(_norm, _fn_state(v)[2:]), id(v.__code__), id(v.__globals__))
    if isinstance(v, (list, tuple)):
        return (type(v), [_norm(x) for x in v])
    if isinstance(v, dict):
        return (type(v), [(_norm(k), _norm(x)) for k, x in v.items()])
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v), [_norm(getattr(v, f.name)) for f in dataclasses.fields(v)])
    if isinstance(v, enum.Enum):
        return (type(v), id(v))
    return (type(v), v)


_with_functions = st.one_of(
    _with_runs,
    st.just(_module_function),
    st.builds(_closure_over, _values),
    st.builds(lambda v: Details([1, 1], _closure_over(v)), _values),
    st.builds(lambda v: _closure_over(_closure_over(v)), _values),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(_with_functions, max_size=4).map(tuple))
def test_both_cores_keep_and_restore_functions_alike(updates: tuple[Any, ...]) -> None:
    """Functions (closures over any value, inside dataclasses, over other closures): the C
    core's walk makes exactly ``keep_py``'s records, and both restores give back new functions
    equal in all they are to the given ones, as the rest of the updates."""
    want = keep_py(updates)
    got = keep_compiled(updates)
    if implementation() == "python":
        assert got is None
    else:
        assert got == want and type(got) is type(want)
    back = restore_py(want)
    assert _norm(back) == _norm(updates)
    if implementation() != "python" and want is not updates:
        c = restore_compiled(want)
        assert c is not None and _norm(c[0]) == _norm(updates)


def test_token_runs_are_kept_as_runs_and_come_back_as_the_same_objects() -> None:
    """A list of one token id repeated (vLLM's ``[image_token_id] * 576``, between a start and
    an end token) is kept as its runs, not as 578 pointers; distinct ids as their tuple."""
    tok, start, end = 151655, 151652, 151653
    seq = [start, *[tok] * 576, end]
    kept = keep((Details(seq),))
    assert len(kept) < 20 and (start, 1, tok, 576, end, 1) in kept
    got = restore(kept)[0].full
    assert got == seq and got[1] is seq[1] and got is not seq
    distinct = list(range(1000, 1100))
    kept = keep((Details(distinct),))
    assert tuple(distinct) in kept and restore(kept)[0].full == distinct


@pytest.mark.parametrize("into", ["empty", "more runs", "a non-atom"])
@pytest.mark.parametrize("runs", [True, False])
def test_a_token_list_a_finalizer_changes_amid_the_walk_is_kept_as_it_was_or_is(
    runs: bool, into: str
) -> None:
    """An allocation of the walk may start a collection (CPython 3.11 collects in the
    allocation itself) whose finalizer changes a token list the walk is keeping as its runs or
    its items: it is kept as it was before or as it is after, never read past its items (a
    segfault) nor its runs written past their tuple. Each threshold starts that collection at
    another allocation."""
    # 15 runs (a 30-tuple) or 45 items: tuples no free list holds
    before = [x for x in range(500, 515) for _ in range(3)] if runs else [*range(500, 545)]
    afters: dict[str, list[Any]] = {
        "empty": [],
        "more runs": [x for x in range(900, 940) for _ in range(3)],
        "a non-atom": [[1]] * 45,
    }
    after = afters[into]

    class Finalized:
        def __init__(self, seq: list[Any]) -> None:
            self.me, self.seq = self, seq  # a cycle: only a collection frees it

        def __del__(self) -> None:
            self.seq[:] = after

    was = gc.get_threshold()
    gc.freeze()  # the test process's own objects left out of every collection here: fast
    try:
        for threshold in range(1, 30):
            seq = list(before)
            updates = (Details(seq),)
            keep_py(updates)  # its classes met: the C core walks it
            gc.collect()
            Finalized(seq)
            gc.set_threshold(threshold)
            kept = keep(updates)
            gc.set_threshold(*was)
            gc.collect()  # the finalizer ran by now, in the walk or here
            assert restore(kept)[0].full in (before, after) and seq == after
    finally:
        gc.set_threshold(*was)
        gc.unfreeze()
        gc.collect()


@pytest.mark.parametrize("change", ["add", "delete"])
def test_a_dict_a_finalizer_changes_amid_the_walk_is_kept_whole(change: str) -> None:
    """An allocation of the walk may start a collection whose finalizer changes a dict the
    walk is at: its length is that of the snapshot its pairs are walked from, as it was or as
    it is, never one read before (the records then said more or fewer pairs than followed and
    read back as other values: the next update taken for a pair, or an ``IndexError``). The
    Python walk keeps a dict changed amid its snapshot by reference."""
    was = gc.get_threshold()
    gc.freeze()  # the test process's own objects left out of every collection here: fast
    try:
        for threshold in range(1, 30):
            d = {"a": 1, "c": 3}
            before, updates = dict(d), (d, "x", Details([1]))
            keep_py(updates)  # its classes met: the C core walks it

            class Finalized:
                def __init__(self, d: dict[str, int]) -> None:
                    self.me, self.d = self, d  # a cycle: only a collection frees it

                def __del__(self) -> None:
                    if change == "add":
                        self.d["b"] = 2
                    else:
                        del self.d["a"]

            # the free lists of pairs and lists emptied: their allocations start collections
            drained = [(i, i) for i in range(2100)], [[i] for i in range(100)]
            gc.collect()
            Finalized(d)
            gc.set_threshold(threshold)
            try:
                kept = keep(updates)
            finally:
                gc.set_threshold(*was)
                del drained
                gc.collect()  # the finalizer ran by now, in the walk or here
            assert restore(kept) in ((before, "x", Details([1])), updates)
    finally:
        gc.set_threshold(*was)
        gc.unfreeze()
        gc.collect()


def test_a_sender_keeps_vllm_shaped_updates_untracked(make_config: Any) -> None:
    """Issue 29: a cached item's vLLM-shaped updates, closures included, leave nothing for the
    collector (a function not as its ``def`` made it excepted: it, and only it, stays by
    reference); a look-up gives them back equal, a put gives the caller's own."""
    small = {"x": np.arange(4, dtype=np.uint8)}

    def is_embed(full: list[int]) -> Any:
        return full

    is_embed.tag = 1  # type: ignore[attr-defined]  # an attribute set: kept by reference
    with SenderCache(make_config(4 << 20, 1 << 16, 1)) as tx:
        mine: dict[str, list[Any]] = {}
        for i in range(30):  # but for k7, vLLM's select_token_id: a new closure per item
            u: list[Any] = list(vllm_like(i, is_embed)) if i == 7 else image_updates(i, True)
            mine[f"k{i}"] = u
            ref, got = tx.get_and_update_item((small, u), f"k{i}")
            assert isinstance(ref, ShmRef) and got is u
            tx.release(ref)
        gc.collect()
        gc.collect()  # the pure core's records: untracked by the collections that walk them
        tracked = [k for k in mine if gc.is_tracked(tx._prompt_updates[k])]
        assert tracked == ["k7"]  # the one holding a function kept by reference
        for k, u in mine.items():
            ref, got = tx.get_and_update_item(None, k)
            assert type(got) is list and got is not u and len(got) == 1
            if k != "k7":
                assert got[0].content.full == u[0].content.full and got[0].mode is u[0].mode
                fn, g = u[0].content.is_embed, got[0].content.is_embed
                assert _fn_state(g) == _fn_state(fn) and g([32000, 1]).tolist() == [True, False]
            tx.release(ref)
        ref, got = tx.get_and_update_item(None, "k7")
        assert got == mine["k7"] and got[0].content.is_embed is is_embed
        tx.release(ref)
        [f] = tx.get_and_update_features([tx_feature("k7")])
        assert f.prompt_updates == tuple(mine["k7"])
        tx.release(f.data)


def tx_feature(h: str) -> Any:
    from aioshmcache import FeatureSpec

    return FeatureSpec(h, None)


@pytest.mark.parametrize("size", [1 << 10, 1 << 21])  # a put under the lock, a copy job
def test_both_put_paths_keep_the_packed_form(make_config: Any, size: int) -> None:
    with SenderCache(make_config(16 << 20, 4 << 20, 1)) as tx:
        u = vllm_like(2)
        ref, _ = tx.get_and_update_item(({"x": np.zeros(size, np.uint8)}, list(u)), "h")
        tx.release(ref)
        kept = tx._prompt_updates["h"]
        assert type(kept) is tuple and kept[0] is KEPT and kept[1] is None
        ref, got = tx.get_and_update_item(None, "h")
        assert got == list(u)
        tx.release(ref)

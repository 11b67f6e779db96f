"""The sender's kept prompt updates (``aioshmcache._kept``) and the classes of their objects: a
class whose hash raises, classes made per item (never remembered), alike on both walks."""

from __future__ import annotations

import dataclasses
import enum
import gc
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from aioshmcache import SenderCache, ShmRef
from aioshmcache._core_api import implementation
from aioshmcache._kept import _how, _objects, keep, keep_compiled, keep_py, restore


@dataclass
class Box:
    a: Any


class _Unhashable(type):  # a metaclass whose classes raise when hashed
    def __hash__(cls) -> int:
        raise RuntimeError("no hash")


class Odd(metaclass=_Unhashable):
    pass


def test_a_class_whose_hash_raises_is_kept_as_given_by_both_walks(make_config: Any) -> None:
    """An object of a class whose metaclass's ``__hash__`` raises (the walk looks its class up):
    the Python walk raises and ``keep`` keeps the updates as given; the C walk declines (it
    raised the error out of ``keep``, out of the put after its item was cached, and the item's
    look-ups gave ``[]`` for its updates)."""
    keep_py((Box(1),))  # the registry has met Box: the C walk reaches Odd's look-up
    given_ = (Box(Odd()), [1, 2])
    assert keep_compiled(given_) is None
    assert keep(given_) is given_
    with SenderCache(make_config(1 << 20, 1 << 18, 1)) as tx:
        small = {"x": np.arange(4, dtype=np.uint8)}
        ref, got = tx.get_and_update_item((small, list(given_)), "k")
        assert isinstance(ref, ShmRef) and got == list(given_)
        tx.release(ref)
        ref, got = tx.get_and_update_item(None, "k")
        assert got == list(given_) and got[0] is given_[0]
        tx.release(ref)


def _plain(i: int) -> Any:
    class Local:
        pass

    return Local()


def _dataclass(i: int) -> Any:
    @dataclass
    class LocalBox:
        a: int

    return LocalBox(i)


def _member(i: int) -> Any:
    class LocalEnum(enum.Enum):
        A = 1

    return LocalEnum.A


def _made(i: int) -> Any:
    return dataclasses.make_dataclass(f"Made{i}", [("a", int)])(i)


def test_classes_made_per_item_leave_the_registry_alone() -> None:
    """A class made per item (a local class, dataclass or enum, ``make_dataclass``'s): its
    objects are kept by reference, and the registry neither numbers nor remembers it. It kept
    every such class (and all its methods reach) for the life of the process, long after its
    item had left the cache: a registry growing with each item."""
    for make in (_plain, _dataclass, _member, _made):
        alive = []
        n_objects, n_how = len(_objects), len(_how)
        for i in range(20):
            obj = make(i)
            alive.append(weakref.ref(type(obj)))
            given_ = (obj, [i, Box(i)])
            kept = keep(given_)
            assert kept[1] == (obj,)  # by reference: the caller's own
            got = restore(kept)
            assert got[0] is obj and got == given_
            if implementation() != "python":
                assert keep_compiled(given_) in (None, keep_py(given_))
            del obj, given_, kept, got
        gc.collect()
        assert [r for r in alive if r() is not None] == [], make
        assert (len(_objects), len(_how)) == (n_objects, n_how), make


def _closure(i: int) -> Any:
    def f() -> int:
        return i

    return f


def test_the_registry_stops_growing_at_its_bound(monkeypatch: Any) -> None:
    """A module's name bound to a new class per item (each named by its module when met) would
    number every one for the life of the process: past ``REGISTRY_MAX`` entries, what is not
    numbered yet is kept by reference instead, and neither the registry nor its classes grow
    any more. Both walks agree, and every item's updates come back equal."""
    import sys
    import types

    from aioshmcache import _kept

    module = types.ModuleType("aioshm_kept_rebound")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    bound = max(len(_objects), len(_how)) + 3
    monkeypatch.setattr(_kept, "REGISTRY_MAX", bound)
    room = (bound - len(_objects)) + (bound - len(_how))  # the most classes they may still take
    classes, kept = [], []
    for i in range(room + 20):
        point = dataclasses.make_dataclass("Point", [("x", int)])
        point.__module__ = module.__name__
        module.Point = point  # type: ignore[attr-defined]  # rebound per item: named when met
        updates = (point(i), [i])
        compiled = keep_compiled(updates)
        made = keep_py(updates)
        assert compiled is None or compiled == made
        kept.append((updates, keep(updates)))
        classes.append(weakref.ref(point))
    assert len(_objects) == bound and len(_how) == bound
    assert [restore(k) for _u, k in kept] == [u for u, _k in kept]
    for i in range(5):  # a function given a new code per item: its definition not numbered
        f = _closure(i)
        f.__code__ = f.__code__.replace(co_consts=(*f.__code__.co_consts, i))
        assert restore(keep(([f],)))[0][0] is f
    assert len(_objects) == bound
    del kept, point, updates, compiled, made
    module.Point = None  # type: ignore[attr-defined]
    gc.collect()
    assert sum(c() is not None for c in classes) <= room  # the others were never remembered

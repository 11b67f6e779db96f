"""What the sender keeps of a cached item's prompt updates: a form the garbage collector skips.

The sender keeps each cached item's prompt updates until the item leaves its cache, to hand them
back to a look-up. Every object the collector tracks is visited by each full collection, and a
cache holds hundreds of thousands of items: vLLM's ``ResolvedPromptUpdate`` (a frozen dataclass
of a str, an int, an enum member, a list of token ids and a ``PromptUpdateDetails``, itself a
dataclass holding a list of hundreds of token ids) is five tracked objects per item. Kept as they
were, 233,000 cached items made full collections take 0.1-0.65 s, stalls of whichever put ran
into one (``bench/bench_lean.py lap --updates objects``).

:func:`keep` turns a request's prompt updates (a tuple: the caches pass lists as tuples) into
what the sender stores:

- ``()`` and a tuple of atoms (``str``, ``int``, ``float``, ``bool``, ``None``, ``bytes``) as
  they are: CPython untracks such a tuple at the first collection that sees it;
- any other tuple as one flat tuple, ``(KEPT, None, records...)``, of atoms and of tuples of
  atoms, which the C core untracks at once (``atom_tuple``; on the pure core the first
  collection that sees it does, after walking its items): its records in prefix order — a code,
  then what the value holds. A list of atoms (a list of token ids) is its items as one tuple,
  or, when shorter, its runs of one object, ``(item, count, ...)`` (``atom_runs``: vLLM's
  placeholder tokens, ``[image_token_id] * 576``, are one run); any other list, a tuple and a
  dict are their length and their items' records; a dataclass instance (of a class whose
  instances ``object.__new__`` makes) is its class's number and the records of its instance
  dict (or, when its slots are its fields, of its fields: one with a field unset is kept by
  reference); an enum member is its number.
  Classes, enum members and function definitions are numbered in a registry of this module (a
  few, for the life of the process): only classes as long-lived as it (a static type, or one
  its module names: ``module.qualname`` is it); an object of a class made per item (a local
  class, dataclass or enum, ``make_dataclass``'s) is kept by reference, its class not
  remembered. The registry stops at ``REGISTRY_MAX`` entries (a module's name bound to a new
  class per item would grow it): what is not numbered by then is kept by reference;
- a function its module names (``module.qualname`` is that very function, as ``pickle`` finds
  one: a module's function, a class's method) is numbered, and comes back the same object;
- any other function as what its ``def`` made it of (vLLM's ``select_token_id`` makes a closure,
  ``is_embed``, per item: the function, its cell and its annotations were three or four tracked
  objects per cached item, 132 ms full collections in the first lap): its definition's number,
  then the records of its defaults, its keyword defaults and what its cells hold. A definition
  is its code object, numbered in the registry with its globals, its name, qualified name,
  module and doc as a new function of that code gets them, and the annotations of the first
  function met: only a function of an imported module's globals (one made in a namespace of
  ``exec``'s or ``eval``'s is kept by reference: its definition would keep that namespace for
  the life of the process, one per item where each item's code is new); a function differing
  from its definition in any of those (renamed, its annotations other, an attribute set on it,
  an empty cell) is kept by reference. A function
  comes back as a new function of that code and globals, new cells holding what they held at
  the put: as a dataclass instance does, it is a copy, and one that rebinds its cells after the
  put does not carry that over. A function met again in one walk (a closure over itself, or
  over a table of closures that holds it) is kept by reference there: each is copied once, not
  once per path to it;
- anything else inside (a numpy array, an object of another class, a function kept by
  reference, what lies deeper than ``MAX_DEPTH``) is kept by reference beside the records,
  ``(KEPT, refs, records)``: that small entry stays tracked, as it was before, and only it (the
  records are a tuple of their own, untracked);
- anything else (not a tuple: a caller's own sequence type, ``bytes``) as it is.

The C core's ``keep_updates`` makes the same records in one call for classes the registry has
met (:func:`keep_py`, the reference, makes them otherwise). Why not bytes (``marshal``, as this
module first did): writing and reading back the records of a vLLM-shaped update (576 token ids)
cost ~160k instructions a put and a look-up, most of a 1 KiB put's time; the records are the
caller's own atoms (a placeholder's token id is one object), as vLLM keeps them.

:func:`restore` gives the updates back: a new tuple of new lists, dicts and dataclass instances
equal to those kept; enum members, classes and what was kept by reference are the same objects.
``KEPT`` is a private ``bytes`` object compared by identity, so no tuple a caller passes is ever
mistaken for a kept one. Nothing here is read from shared memory or from outside this process.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import threading
from types import CellType, FunctionType
from typing import Any, Final

from ._core_api import core

__all__ = [
    "KEPT",
    "MAX_DEPTH",
    "keep",
    "keep_compiled",
    "keep_py",
    "restore",
    "restore_compiled",
    "restore_py",
]

#: the first item of a kept tree (compared by identity: no caller can hold this object)
KEPT: Final = os.urandom(16)
#: nodes deeper than this are kept by reference (a cycle ends here too)
MAX_DEPTH: Final = 32

_ATOMS: Final = frozenset({str, int, float, bool, bytes, type(None)})
_atom_tuple = core.atom_tuple
_atom_runs = core.atom_runs
_keep_updates = core.keep_updates
_restore_kept = core.restore_kept
# record codes: the first item of every record in a kept tuple
(
    _ATOM,
    _ATOM_LIST,
    _LIST,
    _TUPLE,
    _DICT,
    _DICT_OBJ,
    _SLOT_OBJ,
    _MEMBER,
    _REF,
    _ATOM_RUNS,
    _FUNC,
) = range(11)


# --- the registry: classes and enum members, numbered once ----------------------------------

#: reentrant: a collection started amid a numbering (by an allocation; on 3.12 and later at
#: any step after one) may run a finalizer keeping updates (a put amid a put), numbering too,
#: on the thread that holds it
_lock = threading.RLock()
#: number -> class, enum member, or a function definition: ``(code, globals, name, qualname,
#: module, doc, annotations)`` (kept alive: their ids, and their codes', stay theirs)
_objects: list[Any] = []
_numbers: dict[int, int] = {}  # id(class, enum member or definition's code) -> number
#: per class met in updates: its node code and, for slotted dataclasses, its field names; or
#: None: its instances are kept by reference
_how: dict[type, tuple[int, tuple[str, ...]] | None] = {}
#: the most entries ``_objects`` and ``_how`` each take. A program's classes and functions are
#: a few hundred; one that binds a module's name to a new class per item, or gives a function
#: a new code per item, would grow them for the life of the process: past the bound, what is
#: not numbered yet is kept by reference (its items' updates cost collections again)
REGISTRY_MAX = 1 << 16


def _number(obj: Any) -> int | None:
    n = _numbers.get(id(obj))
    return _register(id(obj), obj) if n is None else n


def _register(key: int, entry: Any) -> int | None:
    """The number of ``key`` (an object's id), ``entry``'s index in ``_objects`` if it was not
    numbered yet; None if it was not and the registry is full (``REGISTRY_MAX``). A finalizer
    run amid these steps (see ``_lock``) may number objects too: they come after ``entry``,
    which is found by identity, and one numbering ``key`` itself first has its number kept."""
    with _lock:
        n = _numbers.get(key)
        if n is None:
            if len(_objects) >= REGISTRY_MAX:
                return None
            _objects.append(entry)
            n = len(_objects) - 1
            while _objects[n] is not entry:  # others appended after it meanwhile
                n -= 1
            was = _numbers.get(key)  # numbered meanwhile: that number stays
            n = _numbers[key] = n if was is None else was
    return n


def _same(a: Any, b: Any) -> bool:
    return a is b or bool(a == b)


def _named(f: Any) -> bool:
    """Whether ``f``'s module names it: ``module.qualname`` is ``f`` itself (a function of a
    module or a method of its class: an object as long-lived as its module, numbered once)."""
    try:
        obj = sys.modules.get(f.__module__)
        for part in f.__qualname__.split("."):
            obj = getattr(obj, part)
    except Exception:  # anything a module's or a class's __getattr__ raises: not named
        return False
    return obj is f


def _definition(f: Any) -> int | None:
    """The number of ``f``'s definition (numbered on the first function of its code met), or
    None: ``f`` differs from it, and is kept by reference."""
    code = f.__code__
    n = _numbers.get(id(code))
    if n is None:
        if sys.version_info >= (3, 14):  # annotations made lazily (PEP 649): not handled
            return None
        # only a function of an imported module's code and globals, which live as long as the
        # process anyway: a definition numbered is kept for its life, and a namespace exec or
        # eval made per item (its code new each time) would be kept with it, every one
        g: dict[str, Any] = f.__globals__
        name = g.get("__name__")
        module = sys.modules.get(name) if type(name) is str else None
        if getattr(module, "__dict__", None) is not g:
            return None
        try:  # a new function of that code: its name, qualname, module and doc as made
            new = FunctionType(code, f.__globals__, None, None, f.__closure__)
        except (TypeError, ValueError):
            return None
        d = (code, f.__globals__, new.__name__, new.__qualname__, new.__module__, new.__doc__)
        n = _register(id(code), (*d, dict(f.__annotations__)))
        if n is None:  # the registry is full
            return None
    d = _objects[n]
    # the comparisons first: what they run (a caller's ``__eq__``) may set an attribute on
    # ``f`` or give it another code, which the checks after them see
    if (
        f.__globals__ is not d[1]
        or not _same(f.__name__, d[2])
        or not _same(f.__qualname__, d[3])
        or not _same(f.__module__, d[4])
        or not _same(f.__doc__, d[5])
        or not _same(f.__annotations__, d[6])
        or f.__code__ is not code
        or f.__dict__
        or getattr(f, "__type_params__", ())
    ):
        return None
    return n


#: ``Py_TPFLAGS_HEAPTYPE``: a class made at run time (a ``class`` statement), not a static type
_HEAPTYPE: Final = 1 << 9


def _classify(obj: Any) -> tuple[int, tuple[str, ...]] | None:
    """How instances of ``type(obj)`` are kept, decided on the first one met and remembered
    only for a class as long-lived as the process (a static type, or one its module names, as
    :func:`_named` finds a function): a class made per item (a local class, dataclass or enum,
    ``make_dataclass``'s) would be kept, with all its methods reach, for the life of the
    process, one per item; its objects are kept by reference, and it is classified again the
    next time (the C walk declines it: the Python walk does)."""
    cls = type(obj)
    how: tuple[int, tuple[str, ...]] | None = None
    if cls.__flags__ & _HEAPTYPE and not _named(cls):
        return None
    if issubclass(cls, enum.Enum):
        how = (_MEMBER, ())
    elif dataclasses.is_dataclass(cls) and cls.__new__ is object.__new__:  # made bare again
        names = tuple(f.name for f in dataclasses.fields(cls))
        slots: set[str] = set()
        for c in cls.__mro__:
            declared = c.__dict__.get("__slots__", ())
            slots.update((declared,) if isinstance(declared, str) else declared)
        state = getattr(obj, "__dict__", None)
        if slots - {"__dict__", "__weakref__"}:  # a slot's value would not be in its dict
            if state is None and slots <= {*names, "__weakref__"}:
                how = (_SLOT_OBJ, names)  # slots only, each a field: its fields are its state
        elif type(state) is dict and all(n in state for n in names):
            how = (_DICT_OBJ, ())  # its instance dict: its fields and any other attribute
    if len(_how) < REGISTRY_MAX:
        _how[cls] = how
    return how


# --- keeping --------------------------------------------------------------------------------


def _put(v: Any, out: list[Any], refs: list[Any], depth: int, met: set[Any]) -> None:
    """Append ``v``'s record to ``out``: its code, then what it holds, in prefix order; what is
    kept by reference goes to ``refs`` (its record holds its index there); ``met``: the
    functions this walk keeps as their definitions."""
    t = type(v)
    if t in _ATOMS:
        out += (_ATOM, v)
        return
    if depth > MAX_DEPTH:
        out += (_REF, len(refs))
        refs.append(v)
        return
    depth += 1
    # a list's and a dict's items are walked from a snapshot, its length taken from that: a
    # finalizer (run by a collection an allocation here starts) changing them makes no records
    # that say more or fewer items than follow
    if t is list:
        if not v or type(v[0]) in _ATOMS:  # a list of atoms, at first sight
            try:
                runs = _atom_runs(v)  # (checks every item: one pass)
            except TypeError:  # a list of atoms and more
                pass
            else:
                out += (_ATOM_LIST, _atom_tuple(v)) if runs is None else (_ATOM_RUNS, runs)
                return
        items = (*v,)
        out += (_LIST, len(items))
        for x in items:
            _put(x, out, refs, depth, met)
        return
    if t is tuple:
        out += (_TUPLE, len(v))
        for x in v:
            _put(x, out, refs, depth, met)
        return
    if t is dict:
        _put_pairs(v, v, _DICT, out, refs, depth, met)
        return
    if t is FunctionType:
        n = _numbers.get(id(v))
        if n is None and "<locals>" not in v.__qualname__ and _named(v):
            n = _number(v)
        if n is not None:
            out += (_MEMBER, n)
            return
        # met before in this walk (a closure over itself, or over a table of closures that
        # holds it): by reference there, each function copied once, not once per path to it
        n = None if v in met else _definition(v)
        cells = v.__closure__
        try:
            held = None if cells is None else tuple(c.cell_contents for c in cells)
        except ValueError:  # an empty cell
            n = None
        if n is None:
            out += (_REF, len(refs))
            refs.append(v)
            return
        met.add(v)
        out += (_FUNC, n)
        # read before any is walked (a walk may run a caller's code rebinding them), as the C
        # walk reads them
        for x in (v.__defaults__, v.__kwdefaults__, held):
            _put(x, out, refs, depth, met)
        return
    how = _how[t] if t in _how else _classify(v)
    if how is None:
        out += (_REF, len(refs))
        refs.append(v)
        return
    code, names = how
    n = _number(v if code == _MEMBER else t)
    if n is None:  # the registry is full: by reference
        out += (_REF, len(refs))
        refs.append(v)
    elif code == _MEMBER:
        out += (_MEMBER, n)
    elif code == _DICT_OBJ:
        _put_pairs(v, v.__dict__, _DICT_OBJ, out, refs, depth, met, n)
    else:
        try:
            values = [getattr(v, name) for name in names]
        except AttributeError:  # an unset slot (a field never set): kept by reference
            out += (_REF, len(refs))
            refs.append(v)
            return
        out += (_SLOT_OBJ, n)
        for x in values:
            _put(x, out, refs, depth, met)


def _put_pairs(
    v: Any,
    d: Any,
    code: int,
    out: list[Any],
    refs: list[Any],
    depth: int,
    met: set[Any],
    *head: int,
) -> None:
    """Append the record of ``v``, the dict ``d`` or the instance it is the dict of (``code``,
    ``head``, its length, its pairs' records), its length that of one snapshot of its pairs;
    ``v`` is kept by reference if a finalizer changes ``d`` while that is taken (iterating it
    raised ``RuntimeError``; on CPython 3.11 ``dict.copy`` may give a copy whose length is not
    its items' count)."""
    try:
        pairs = [*d.items()]
    except RuntimeError:
        out += (_REF, len(refs))
        refs.append(v)
        return
    out += (code, *head, len(pairs))
    for k, x in pairs:
        _put(k, out, refs, depth, met)
        _put(x, out, refs, depth, met)


def keep(updates: Any) -> Any:
    """``updates`` as the sender keeps them (see the module docstring): the C core's walk
    (``keep_updates``) makes them when it can, the same records as :func:`keep_py`, which it
    leaves the rest to (a class or enum member not numbered yet, anything unusual). Updates
    whose walk raises (a caller's object whose attributes or instance dict raise) are kept as
    given, by reference: never an error out of the put that keeps them, after its item was
    cached."""
    kept = _keep_updates(updates, _how, _numbers, _objects, MAX_DEPTH, KEPT)
    if kept is not None:
        return kept
    try:
        return keep_py(updates)
    except Exception:  # anything a caller's object raises: kept as given
        return updates


def keep_compiled(updates: Any) -> Any:
    """The C core's walk alone: :func:`keep`'s form of ``updates``, or None where it declines
    (always on the pure core). For the tests that hold it to :func:`keep_py`."""
    return _keep_updates(updates, _how, _numbers, _objects, MAX_DEPTH, KEPT)


def keep_py(updates: Any) -> Any:
    """:func:`keep`'s reference: its walk in Python, numbering what it meets."""
    if type(updates) is not tuple:
        return updates
    for u in updates:
        if type(u) not in _ATOMS:
            break
    else:
        return updates  # atoms (or empty): an untracked tuple already
    out: list[Any] = [KEPT, None]
    refs: list[Any] = []
    _put(updates, out, refs, 0, set())
    if refs:
        return (KEPT, tuple(refs), _atom_tuple(out))
    return _atom_tuple(out)


# --- restoring ------------------------------------------------------------------------------

_set = object.__setattr__


def _get(flat: tuple[Any, ...], i: int, refs: tuple[Any, ...]) -> tuple[Any, int]:
    """The value whose record starts at ``flat[i]``, and the index after that record."""
    code = flat[i]
    if code == _ATOM:
        return flat[i + 1], i + 2
    if code in (_MEMBER, _REF):
        v = flat[i + 1]
        return (_objects[v] if code == _MEMBER else refs[v]), i + 2
    if code == _ATOM_LIST:
        return list(flat[i + 1]), i + 2
    if code == _ATOM_RUNS:
        runs, items = flat[i + 1], []
        for j in range(0, len(runs), 2):
            items += [runs[j]] * runs[j + 1]
        return items, i + 2
    if code in (_LIST, _TUPLE):
        items = []
        i += 2
        for _ in range(flat[i - 1]):
            v, i = _get(flat, i, refs)
            items.append(v)
        return (items if code == _LIST else tuple(items)), i
    if code == _DICT:
        d = {}
        i += 2
        for _ in range(flat[i - 1]):
            k, i = _get(flat, i, refs)
            d[k], i = _get(flat, i, refs)
        return d, i
    if code == _FUNC:
        d = _objects[flat[i + 1]]
        defaults, i = _get(flat, i + 2, refs)
        kwdefaults, i = _get(flat, i, refs)
        held, i = _get(flat, i, refs)
        cells = None if held is None else tuple(CellType(x) for x in held)
        fn = FunctionType(d[0], d[1], None, defaults, cells)
        if kwdefaults is not None:
            fn.__kwdefaults__ = kwdefaults
        if d[6]:
            fn.__annotations__ = dict(d[6])
        return fn, i
    cls = _objects[flat[i + 1]]
    obj = cls.__new__(cls)
    if code == _DICT_OBJ:
        state = obj.__dict__
        i += 3
        for _ in range(flat[i - 1]):
            k, i = _get(flat, i, refs)
            state[k], i = _get(flat, i, refs)
        return obj, i
    how = _how[cls]
    i += 2
    for name in how[1] if how else ():
        v, i = _get(flat, i, refs)
        _set(obj, name, v)
    return obj, i


def restore(kept: Any) -> Any:
    """The prompt updates :func:`keep` made ``kept`` of (``kept`` itself if it made nothing):
    the C core's ``restore_kept`` makes them again when it can, :func:`restore_py` otherwise."""
    if type(kept) is tuple and len(kept) > 2 and kept[0] is KEPT:
        got = _restore_kept(kept, _objects, _how)
        return restore_py(kept) if got is None else got[0]
    return kept


def restore_compiled(kept: Any) -> tuple[Any] | None:
    """The C core's ``restore_kept`` alone: ``(updates,)``, or None where it declines (always
    on the pure core, and for what :func:`keep` did not make). For the tests that hold it to
    :func:`restore_py`."""
    if type(kept) is tuple and len(kept) > 2 and kept[0] is KEPT:
        return _restore_kept(kept, _objects, _how)  # type: ignore[no-any-return]
    return None


def restore_py(kept: Any) -> Any:
    """:func:`restore`'s reference, in Python."""
    if type(kept) is tuple and len(kept) > 2 and kept[0] is KEPT:
        refs = kept[1]
        if refs is None:
            return _get(kept, 2, ())[0]
        return _get(kept[2], 2, refs)[0]
    return kept

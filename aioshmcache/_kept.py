"""What the sender keeps of a cached item's prompt updates: a form the garbage collector skips.

The sender keeps each cached item's prompt updates until the item leaves its cache, to hand them
back to a look-up. Every object the collector tracks is visited by each full collection, and a
cache holds hundreds of thousands of items: vLLM's ``ResolvedPromptUpdate`` (a frozen dataclass
of a str, an int, an enum member, a list of token ids and a ``PromptUpdateDetails``, itself a
dataclass holding a list of hundreds of token ids) is four tracked objects per item, and its token
lists are walked item by item. Kept as they are, 300,000 cached items made full collections
take 0.3-3 s, stalls of whichever put ran into one.

:func:`keep` turns a request's prompt updates (a tuple: the caches pass lists as tuples) into
what the sender stores:

- ``()`` and a tuple of atoms (``str``, ``int``, ``float``, ``bool``, ``None``, ``bytes``) as
  they are: CPython untracks such a tuple at the first collection that sees it;
- any other tuple packed into one ``bytes`` object, which is no container:
  msgpack writes lists, dicts and atoms natively; a tuple, a dataclass instance (its class and
  its instance dict, or its fields when it has slots) and an enum member (by identity) are
  written as arrays marked by a private extension type. Classes and enum members are numbered
  in a registry of this module (a few, for the life of the process);
- a leaf that is none of these (a function such as vLLM's ``is_embed`` closures, a numpy array,
  any other object) is kept by reference beside the bytes (:class:`PackedWith`): that entry and
  those leaves stay tracked, and only they;
- anything else (not a tuple: a caller's own sequence type) as it is, but ``bytes``, which is
  packed too (so that every ``bytes`` kept is a packed form).

:func:`restore` gives the updates back: a new tuple of new objects equal to those kept (enum
members, classes and leaves kept by reference are the same objects). Nothing here is ever read
from shared memory or from outside this process: the bytes are this module's own encoding of
objects the caller handed to this process.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
from collections.abc import Callable
from typing import Any, Final

import msgpack
from msgpack import ExtType

__all__ = ["PackedWith", "keep", "restore"]

_ATOMS: Final = frozenset({str, int, float, bool, bytes, type(None)})

#: the marks of the arrays that stand for something msgpack does not write natively: a marked
#: array is ``[mark, ...]``; an extension type whose data is this process's random token (a
#: caller's own ``ExtType`` objects keep other data, so a mark cannot be mistaken for one)
_TOKEN: Final = os.urandom(8)
_TUPLE, _DICT_OBJ, _SLOT_OBJ, _REGISTERED, _SIDE = 1, 2, 3, 4, 5


class _Mark:
    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code


_MARKS: Final = {c: _Mark(c) for c in (_TUPLE, _DICT_OBJ, _SLOT_OBJ, _REGISTERED, _SIDE)}
_EXT: Final = {c: ExtType(c, _TOKEN) for c in _MARKS}


class PackedWith:
    """Prompt updates packed by :func:`keep`, with the leaves it kept by reference."""

    __slots__ = ("data", "side")

    def __init__(self, data: bytes, side: tuple[Any, ...]) -> None:
        self.data = data
        self.side = side


# --- the registry: classes and enum members, numbered once ----------------------------------

_lock = threading.Lock()
_objects: list[Any] = []  # number -> class or enum member
_numbers: dict[int, int] = {}  # id(object) -> number (the objects are kept alive in _objects)
#: per class seen in updates: how its instances are written (a mark and, for slotted
#: dataclasses, the field names), or None: kept by reference
_how: dict[type, tuple[int, tuple[str, ...]] | None] = {}


def _number(obj: Any) -> int:
    n = _numbers.get(id(obj))
    if n is None:
        with _lock:
            n = _numbers.get(id(obj))
            if n is None:
                _objects.append(obj)
                n = _numbers[id(obj)] = len(_objects) - 1
    return n


def _classify(obj: Any) -> tuple[int, tuple[str, ...]] | None:
    """How instances of ``type(obj)`` are written, decided on its first instance seen."""
    cls = type(obj)
    how: tuple[int, tuple[str, ...]] | None = None
    if issubclass(cls, enum.Enum):
        how = (_REGISTERED, ())
    elif dataclasses.is_dataclass(cls) and not issubclass(cls, (tuple, list, dict)):
        names = tuple(f.name for f in dataclasses.fields(cls))
        state = getattr(obj, "__dict__", None)
        if type(state) is dict and all(n in state for n in names):
            how = (_DICT_OBJ, ())  # its instance dict: fields and any other attribute
        elif not hasattr(obj, "__dict__"):
            how = (_SLOT_OBJ, names)  # slots only: its fields are its state
    _how[cls] = how
    return how


# --- packing ------------------------------------------------------------------------------


class _Writer(threading.local):
    """A packer per thread (a packer is not re-entrant) and the leaves of the current pack."""

    def __init__(self) -> None:
        self.side: list[Any] = []
        self.packer = msgpack.Packer(
            default=self.default, strict_types=True, use_bin_type=True, autoreset=True
        )

    def default(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is tuple:
            return [_EXT[_TUPLE], *obj]
        how = _how[cls] if cls in _how else _classify(obj)
        if how is not None:
            mark, names = how
            if mark == _REGISTERED:
                return [_EXT[_REGISTERED], _number(obj)]
            if mark == _DICT_OBJ:
                return [_EXT[_DICT_OBJ], _number(cls), obj.__dict__]
            return [_EXT[_SLOT_OBJ], _number(cls), *[getattr(obj, n) for n in names]]
        self.side.append(obj)
        return [_EXT[_SIDE], len(self.side) - 1]


_writer = _Writer()


def keep(updates: Any) -> Any:
    """``updates`` as the sender keeps them (see the module docstring)."""
    t = type(updates)
    if t is not tuple:
        if t is not bytes:
            return updates
    else:
        for u in updates:
            if type(u) not in _ATOMS:
                break
        else:
            return updates  # atoms (or empty): an untracked tuple already
    w = _writer
    side: list[Any] = []
    w.side = side
    try:
        data = w.packer.pack(updates)
    except Exception:  # a cycle, an int beyond 64 bits as a key, a str msgpack refuses, ...
        w.packer.reset()
        return updates  # kept as it is (tracked, as before)
    finally:
        w.side = []
    return PackedWith(data, tuple(side)) if side else data


# --- restoring ----------------------------------------------------------------------------


class _Reader(threading.local):
    side: tuple[Any, ...] = ()


_reader = _Reader()
_new: Callable[[type], Any] = object.__new__
_set = object.__setattr__


def _ext(code: int, data: bytes) -> Any:
    return _MARKS[code] if data == _TOKEN and code in _MARKS else ExtType(code, data)


def _array(items: list[Any]) -> Any:
    if not items or type(items[0]) is not _Mark:
        return items
    code = items[0].code
    if code == _TUPLE:
        return tuple(items[1:])
    if code == _REGISTERED:
        return _objects[items[1]]
    if code == _SIDE:
        return _reader.side[items[1]]
    cls = _objects[items[1]]
    obj = cls.__new__(cls)
    if code == _DICT_OBJ:
        obj.__dict__.update(items[2])
    else:
        how = _how[cls]
        for name, value in zip(how[1] if how else (), items[2:], strict=True):
            _set(obj, name, value)
    return obj


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(
        data, raw=False, strict_map_key=False, use_list=True, list_hook=_array, ext_hook=_ext
    )


def restore(kept: Any) -> Any:
    """The prompt updates :func:`keep` made ``kept`` of (``kept`` itself if it packed nothing)."""
    if type(kept) is bytes:
        return _unpack(kept)
    if type(kept) is PackedWith:
        _reader.side = kept.side
        try:
            return _unpack(kept.data)
        finally:
            _reader.side = ()
    return kept

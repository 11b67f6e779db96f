"""The sender's kept prompt updates (``aioshmcache._kept``) on odd inputs: classes whose hash
raises and classes made per item, on both walks alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from aioshmcache import SenderCache, ShmRef
from aioshmcache._kept import keep, keep_compiled, keep_py


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

"""The channel between the parent and its children: framed msgpack over an abstract Unix socket.

Every arrow is a :mod:`aioshmcache.tools.framing` frame. A request's features (its references,
``None`` where the item was served inline) travel as the bytes of
:func:`aioshmcache.wire.pack_features` in ``f``, with ``c``: per feature, the digest and size the
reader checks the item against; forged references in probes stay dicts (``ShmRef.to_dict()``
form, possibly malformed on purpose). ``t`` is the message type::

    parent -> writer   credit, stop, check, exit
    writer -> parent   hello, handle, req (references), probe, hb, stopped, final, violation
    parent -> reader   handle, req, probe (forwarded frames), sync, exit
    reader -> parent   hello, attached, done, probe_done, synced, err, hb, violation
"""

from __future__ import annotations

from typing import Any, Final

from aioshmcache import ShmRef
from aioshmcache.wire import unpack_features

from ..framing import ProtocolError

__all__ = [
    "FORK_SLOT_BOUND",
    "HB_INTERVAL",
    "MAX_FRAME",
    "SABOTAGE_EVERY",
    "SABOTAGE_GRACE",
    "SABOTAGE_MIN_SEEN",
    "Feature",
    "request_features",
    "sock_path",
]

#: with ``--sabotage`` (the harness's self-test), every this-many-th reference lies about its
#: digest, and every this-many-th request holding a reference is dropped by its reader
SABOTAGE_EVERY: Final = 10
#: the self-test runs past ``--duration`` until it has seen this many of each sabotage...
SABOTAGE_MIN_SEEN: Final = 3
#: ...but not for longer than this many seconds past ``--duration`` (the run then fails)
SABOTAGE_GRACE: Final = 300.0

#: the fork fault: a SIGKILLed reader's slot must look dead within this many seconds (while
#: the child it forked lives on, for ``--fork-linger`` seconds, longer than this)
FORK_SLOT_BOUND: Final = 3.0

#: one feature of a request: mm_hash, its reference (None: served inline), digest, size
Feature = tuple[str, ShmRef | None, int, int]

#: a child sends a heartbeat this often; one silent for ``--hang-timeout`` hangs
HB_INTERVAL: Final = 0.5
#: no message of the harness comes near this (requests hold a few references)
MAX_FRAME: Final = 1 << 24


def sock_path(name: str) -> str:
    """``@name`` is the abstract socket ``\\0name`` (argv cannot carry a NUL byte)."""
    return "\0" + name[1:] if name.startswith("@") else name


def request_features(msg: dict[str, Any]) -> list[Feature]:
    """The features of a ``req`` message, references decoded by ``unpack_features``."""
    specs = unpack_features(msg["f"])
    checks = msg["c"]
    if not isinstance(checks, list) or len(checks) != len(specs):
        raise ProtocolError("a request needs one [digest, size] per feature")
    return [
        (f.mm_hash, f.data if isinstance(f.data, ShmRef) else None, int(d), int(n))
        for f, (d, n) in zip(specs, checks)
    ]

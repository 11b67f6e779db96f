"""The channel between the parent and its children: framed msgpack over an abstract Unix socket.

Every arrow is a :mod:`aioshmcache.tools.framing` frame; references travel as
``ShmRef.to_dict()``. ``t`` is the message type::

    parent -> writer   credit, stop, check, exit
    writer -> parent   hello, handle, req (references), probe, hb, stopped, final, violation
    parent -> reader   handle, req, probe (forwarded frames), sync, exit
    reader -> parent   hello, attached, done, probe_done, synced, err, hb, violation
"""

from __future__ import annotations

from typing import Final

__all__ = ["HB_INTERVAL", "MAX_FRAME", "sock_path"]

#: a child sends a heartbeat this often; one silent for ``--hang-timeout`` hangs
HB_INTERVAL: Final = 0.5
#: no message of the harness comes near this (requests hold a few references)
MAX_FRAME: Final = 1 << 24


def sock_path(name: str) -> str:
    """``@name`` is the abstract socket ``\\0name`` (argv cannot carry a NUL byte)."""
    return "\0" + name[1:] if name.startswith("@") else name

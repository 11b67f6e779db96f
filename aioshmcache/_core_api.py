"""Which core runs: the compiled ``aioshmcache._core`` or the pure-Python ``_core_py``.

As msgpack-python does: the package picks one at import, the C extension if it was built and
imports, else the Python reference; ``AIOSHM_PURE=1`` (any value but empty or ``0``) forces
the Python one. Both expose the same names with the same behaviour (the differential tests
prove it); :func:`implementation` says which one this process uses.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

__all__ = ["core", "implementation", "pure_forced"]


def pure_forced() -> bool:
    """Whether ``AIOSHM_PURE`` asks for the pure-Python core."""
    return os.environ.get("AIOSHM_PURE", "") not in ("", "0")


_impl: Literal["c", "python"]
# the type checker sees the reference (``_core.pyi`` types the C module)
if TYPE_CHECKING or pure_forced():
    from . import _core_py as core

    _impl = "python"
else:
    try:
        from . import _core as core
    except ImportError:  # not built (no compiler at install time): the reference
        from . import _core_py as core

        _impl = "python"
    else:
        _impl = "c"


def implementation() -> Literal["c", "python"]:
    """``"c"`` if the compiled core is in use, ``"python"`` if the pure-Python one is (not
    built, or forced by ``AIOSHM_PURE=1``)."""
    return _impl

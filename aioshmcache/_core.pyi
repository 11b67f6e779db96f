# Types of the compiled core (aioshmcache/_core*.c); its reference is aioshmcache/_core_py.py.
from typing import Any, Final

from ._core_read_py import ReadCtx as ReadCtx

LAYOUT: Final[dict[str, int]]

def tag_base(
    secret: int, epoch: int, address: int, cid: int, length: int, position: int
) -> int: ...
def finish_tag(base: int, seq: int) -> int: ...

# the read section (aioshmcache/_core_read.c; reference: aioshmcache/_core_read_py.py)

def read_item(ctx: ReadCtx, ref: object, copy: bool = True) -> Any: ...
def read_layout() -> dict[str, int]: ...

# Types of the compiled core (aioshmcache/_core*.c); its reference is aioshmcache/_core_py.py.
from typing import Final

LAYOUT: Final[dict[str, int]]

def tag_base(
    secret: int, epoch: int, address: int, cid: int, length: int, position: int
) -> int: ...
def finish_tag(base: int, seq: int) -> int: ...

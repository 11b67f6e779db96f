"""The workload: items are functions of their hash (heavy-tailed sizes, content sliced from a
seeded random buffer), the same bytes in every process, each carrying its crc32 (over dtype,
shape and bytes of each array) in a field that readers recompute.
"""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Iterable
from typing import Any, Final

import numpy as np

from .options import StressOptions

ARRAY_FIELDS: Final = ("pixel_values", "grid", "mask", "half")


def _unit(seed: int, k: int, salt: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, k, salt)."""
    h = zlib.crc32(struct.pack("<QQQ", seed & 0xFFFFFFFFFFFFFFFF, k, salt))
    h = (h * 0x9E3779B1 + k * 0x85EBCA77 + salt) & 0xFFFFFFFF
    return ((h ^ (h >> 15)) * 0x2C1B3C6D & 0xFFFFFFFF) / 2.0**32


def item_size(seed: int, k: int, min_item: int, max_item: int) -> int:
    """Heavy-tailed size: log-uniform in u**3 (median ~4 KiB, mean ~1.1 MiB for 1 KiB..32 MiB)."""
    u = _unit(seed, k, 1)
    ratio = max_item / min_item
    return int(min_item * ratio ** (u**3))


def array_digest(arrays: Iterable[np.ndarray[Any, Any]]) -> int:
    """crc32 over dtype, shape and bytes of each array, in order."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(f"{a.dtype.str}{a.shape}".encode(), crc)
        if a.size:
            crc = zlib.crc32(np.ascontiguousarray(a).data.cast("B"), crc)
    return crc


class Workload:
    """Hash universe, Zipf sampler and item factory (same items in every process)."""

    def __init__(self, opts: StressOptions) -> None:
        self.opts, self.seed = opts, opts.seed
        w = np.arange(1, opts.universe + 1, dtype=np.float64) ** (-opts.zipf)
        self._cdf = np.cumsum(w / w.sum())
        # popularity rank -> hash index: popular hashes get random sizes
        self._perm = np.random.default_rng(opts.seed).permutation(opts.universe)
        big = max(opts.max_item, opts.max_object + (256 << 10)) + (1 << 20)
        self._base = np.random.default_rng(opts.seed ^ 0x5EED).integers(0, 256, big, np.uint8)
        self._digests: dict[int, int] = {}

    def sample(self, rng: random.Random) -> int:
        i = int(np.searchsorted(self._cdf, rng.random(), side="right"))
        return int(self._perm[min(i, len(self._perm) - 1)])

    @staticmethod
    def name(k: int) -> str:
        return f"h{k:06d}"

    def nbytes(self, k: int) -> int:
        o = self.opts
        if _unit(self.seed, k, 3) < o.oversize_fraction:  # too large to cache: served inline
            return o.max_object + (128 << 10)
        return item_size(self.seed, k, o.min_item, o.max_item)

    def item(self, k: int) -> tuple[dict[str, Any], int, int]:
        """(item, digest, nbytes): arrays are read-only views into the seeded base buffer."""
        n = self.nbytes(k)
        rows = max(1, (n - 512) // 64)
        end = rows * 64
        off = int(_unit(self.seed, k, 2) * ((len(self._base) - end - 256) // 64)) * 64
        base = self._base[off:]
        arrays = (
            base[:end].view(np.float32).reshape(rows, 16),  # pixel_values
            np.array([k, rows, 16], dtype=">i8"),  # grid
            (base[end : end + 64] & 1).astype(np.bool_),  # mask
            base[end + 64 : end + 128].view(np.float16),  # half
        )
        if (digest := self._digests.get(k)) is None:
            digest = self._digests[k] = array_digest(arrays)
        meta = {"mm_hash": self.name(k), "digest": digest, "nbytes": n, "tags": ["x", 1, 2.5]}
        return {**dict(zip(ARRAY_FIELDS, arrays)), "meta": meta}, digest, n


def verify_item(data: object, mm_hash: str, digest: int, nbytes: int) -> str | None:
    """None if ``data`` is exactly the item written for ``mm_hash``; else what is wrong."""
    if not isinstance(data, dict):
        return f"{mm_hash}: got {type(data).__name__}, not an item"
    if set(data) != {*ARRAY_FIELDS, "meta"}:
        return f"{mm_hash}: fields {sorted(data)}"
    meta = data["meta"]
    if not isinstance(meta, dict) or meta.get("mm_hash") != mm_hash:
        got = meta.get("mm_hash") if isinstance(meta, dict) else meta
        return f"{mm_hash}: item of another hash ({got!r})"
    if meta.get("digest") != digest or meta.get("nbytes") != nbytes:
        got = f"{meta.get('digest')}/{meta.get('nbytes')}"
        return f"{mm_hash}: digest/size field {got} != {digest}/{nbytes}"
    if bad := [f for f in ARRAY_FIELDS if not isinstance(data[f], np.ndarray)]:
        return f"{mm_hash}: field {bad[0]} is {type(data[bad[0]]).__name__}"
    if (got := array_digest(data[f] for f in ARRAY_FIELDS)) != digest:
        return f"{mm_hash}: checksum {got:#010x} != expected {digest:#010x} (wrong or torn data)"
    return None

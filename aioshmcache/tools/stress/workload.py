"""The workload: deterministic items with digests, the same bytes in every process.

Items are deterministic functions of their hash (heavy-tailed sizes, content sliced from a seeded
random buffer), so every writer generation produces the same bytes for the same hash. An item
carries its crc32 (over dtype, shape and bytes of each array) in a field: readers recompute it.
"""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Iterable
from typing import Any, Final

import numpy as np

from .options import StressOptions

__all__ = ["ARRAY_FIELDS", "Workload", "array_digest", "item_size", "verify_item"]

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
        self.opts = opts
        self.seed = opts.seed
        n = opts.universe
        ranks = np.arange(1, n + 1, dtype=np.float64)
        w = ranks ** (-opts.zipf)
        self._cdf = np.cumsum(w / w.sum())
        # popularity rank -> hash index: popular hashes get random sizes
        self._perm = np.random.default_rng(opts.seed).permutation(n)
        big = max(opts.max_item, opts.max_object + (256 << 10))
        self._base = np.random.default_rng(opts.seed ^ 0x5EED).integers(
            0, 256, size=big + (1 << 20), dtype=np.uint8
        )
        self._digests: dict[int, tuple[int, int]] = {}

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
        pix_bytes = rows * 64
        span = len(self._base) - pix_bytes - 256
        off = int(_unit(self.seed, k, 2) * (span // 64)) * 64
        base = self._base
        pixel = base[off : off + pix_bytes].view(np.float32).reshape(rows, 16)
        grid = np.array([k, rows, 16], dtype=">i8")
        mask = (base[off + pix_bytes : off + pix_bytes + 64] & 1).astype(np.bool_)
        half = base[off + pix_bytes + 64 : off + pix_bytes + 128].view(np.float16)
        arrays = (pixel, grid, mask, half)
        cached = self._digests.get(k)
        if cached is None:
            cached = (array_digest(arrays), n)
            self._digests[k] = cached
        digest = cached[0]
        item = {
            "pixel_values": pixel,
            "grid": grid,
            "mask": mask,
            "half": half,
            "meta": {"mm_hash": self.name(k), "digest": digest, "nbytes": n, "tags": ["x", 1, 2.5]},
        }
        return item, digest, n


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
        got_meta = f"{meta.get('digest')}/{meta.get('nbytes')}"
        return f"{mm_hash}: digest/size field {got_meta} != {digest}/{nbytes}"
    arrays = []
    for f in ARRAY_FIELDS:
        a = data[f]
        if not isinstance(a, np.ndarray):
            return f"{mm_hash}: field {f} is {type(a).__name__}"
        arrays.append(a)
    got = array_digest(arrays)
    if got != digest:
        return f"{mm_hash}: checksum {got:#010x} != expected {digest:#010x} (wrong or torn data)"
    return None

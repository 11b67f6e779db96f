"""Sizes and durations: parsing command-line values and formatting them for people."""

from __future__ import annotations

import math
import re
from typing import Final

__all__ = ["GiB", "KiB", "MiB", "fmt_bytes", "fmt_seconds", "parse_duration", "parse_size"]

KiB: Final = 1 << 10
MiB: Final = 1 << 20
GiB: Final = 1 << 30

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d)?", re.IGNORECASE)
_DURATION_RE = re.compile(f"(?:{_DURATION_PART.pattern})+", re.IGNORECASE)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds from ``"60s"``, ``"2h"``, ``"1m30s"``, ``"500ms"`` or a bare number of seconds."""
    s = text.replace(" ", "")
    if not _DURATION_RE.fullmatch(s):
        raise ValueError(f"bad duration {text!r} (use e.g. 60s, 2h, 1m30s, 500ms)")
    parts = _DURATION_PART.findall(s)
    total = sum(float(n) * _UNITS[(unit or "s").lower()] for n, unit in parts)
    if not math.isfinite(total) or total <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return total


def parse_size(text: str) -> int:
    """Bytes from ``"96MiB"``, ``"32M"``, ``"1KiB"``, ``"4096"`` (binary multiples)."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"bad size {text!r} (use e.g. 1KiB, 32MiB, 1GiB)")
    mult = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def fmt_bytes(n: float, *, digits: int = 1) -> str:
    """1 KiB, 64 KiB, 1.5 MiB, 8 GiB: exact multiples stay integral, others get ``digits``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.{digits}f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    """A duration with a unit that keeps three significant digits."""
    if not math.isfinite(s):
        return "n/a"
    a = abs(s)
    if a >= 1.0:
        return f"{s:.2f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"

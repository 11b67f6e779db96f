"""What a run counts, and the report made from it: the progress line, the table and the JSON."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from ..units import fmt_bytes
from .options import StressOptions


class Violations:
    """Every violation counted by kind; a few of each kept in full (a flood of one, say wrong
    data, must not hide another)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.counts: Counter[str] = Counter()

    def add(self, who: str, text: str) -> None:
        key = text.split(":")[0][:80]
        self.counts[key] += 1
        if self.counts[key] <= 20 and len(self.items) < 200:
            self.items.append(f"[{who}] {text}")

    def __len__(self) -> int:
        return self.counts.total()


@dataclasses.dataclass
class Tally:
    """Every counter of a run (the parent's own, and the writers' last reported statistics)."""

    stats: Counter[str] = dataclasses.field(default_factory=Counter)
    errors: Counter[str] = dataclasses.field(default_factory=Counter)
    err_texts: dict[str, str] = dataclasses.field(default_factory=dict)
    writer_stats: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    finals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    violations: Violations = dataclasses.field(default_factory=Violations)
    dead_gens: dict[int, str] = dataclasses.field(default_factory=dict)  # "killed" | "closed"
    wgone_gens: set[int] = dataclasses.field(default_factory=set)

    def writer_totals(self) -> Counter[str]:
        """The integer statistics of every writer generation, summed."""
        tot: Counter[str] = Counter()
        for s in self.writer_stats.values():
            tot.update({k: v for k, v in s.items() if type(v) is int})
        return tot

    def writer_max(self, key: str) -> float:
        """The largest value of a float statistic over every writer generation."""
        return max((float(s.get(key, 0.0)) for s in self.writer_stats.values()), default=0.0)


def as_json(o: StressOptions, t: Tally, elapsed: float) -> dict[str, Any]:
    """The ``--json`` report."""
    return {
        "options": o.child_dict(),
        "elapsed": elapsed,
        "stats": dict(t.stats),
        "errors": dict(t.errors),
        "error_texts": t.err_texts,
        "writer": dict(t.writer_totals()),
        "writer_lag_max": t.writer_max("lag_max"),
        "finals": t.finals,
        "violations": t.violations.items,
        "violation_count": len(t.violations),
        "dead_gens": t.dead_gens,
    }


def _by(counts: Counter[str], prefix: str) -> str:
    """``a 1, b 2`` from the counters named ``<prefix>a``, ``<prefix>b``."""
    got = [f"{k[len(prefix) :]} {n:,}" for k, n in sorted(counts.items()) if k.startswith(prefix)]
    return ", ".join(got) or "-"


def progress_line(o: StressOptions, t: Tally, elapsed: float, gen: int, live: int) -> str:
    """One line of progress (every second on stderr)."""
    st, w, e = t.stats, t.writer_totals(), t.errors
    lim = f"of {o.duration:.0f}s" if o.duration else f"ops {st['requests']}/{o.ops}"
    wgone = sum(n for k, n in e.items() if k.startswith("WriterGoneError"))
    return (
        f"{lim}: g{gen} readers {live}/{o.readers} | req {st['requests']} "
        f"({st['requests'] / max(elapsed, 1e-9):.0f}/s) verified {st['items_verified']} "
        f"{fmt_bytes(st['bytes_verified'])} evict {w['evictions']} inline {w['inline']} | "
        f"kills r{st['reader_kills']} w{st['writer_kills']} stops {st['reader_stops']} "
        f"wgone {wgone} revoked {e['ReaderEvictedError']} | "
        f"violations {len(t.violations)}"
    )


def summary(o: StressOptions, t: Tally, elapsed: float, writer_gens: int, interrupted: bool) -> str:
    """The final table (rows of a fault that is off left out), the violations, the verdict."""
    st, w, el = t.stats, t.writer_totals(), max(elapsed, 1e-9)
    on = {"group": bool(o.group), **{f: True for f in o.faults}}
    reloc = f"{w['relocations']:,} items, {fmt_bytes(w['bytes_relocated'])}"
    mib_s = st["bytes_verified"] / el / 2**20
    drains = [f"{f['why']}: {f['items']} items, {f['n_not_freeable']} stuck" for f in t.finals]
    closed = [st["read_closed_during_read"], st["read_closed_beside_read"], st["closed_read_ok"]]
    writers = [st["writer_kills"], st["writer_rotations"]]
    lag, op = t.writer_max("lag_max") * 1e3, t.writer_max("op_max")
    sib = f"{w['sibling_hits']:,} ({w['sibling_inline']:,}: no room here)"
    rows: list[tuple[str, str, str]] = [  # (shown with, label, value)
        ("", "writer requests", f"{st['requests']:,} ({st['requests'] / el:,.1f}/s)"),
        ("", "  features", f"{st['features']:,}"),
        ("", "  hits / misses", f"{w['hits']:,} / {w['misses']:,}"),
        ("group", "  sibling hits (of them served inline)", sib),
        ("", "  handed out (refs)", f"{w['refs']:,}"),
        ("", "  inline", _by(w, "inline_")),
        ("", "  sender CacheMissError resends", f"{w['sender_cache_miss']:,}"),
        ("", "  evictions", f"{w['evictions']:,}"),
        ("", "  relocations (second chance)", reloc if o.second_chance else "off"),
        ("", "  cancelled / completed first", f"{_by(w, 'cancelled_')} / {w['cancel_too_late']}"),
        ("", "reader requests", f"{st['reads']:,}"),
        ("", "  items verified (crc32)", f"{st['items_verified']:,}"),
        ("", "  bytes verified", f"{fmt_bytes(st['bytes_verified'])} ({mib_s:,.0f} MiB/s)"),
        ("", "  outcomes", _by(st, "read_")),
        ("close-read", "  closed under / beside a read (read ok)", "{} / {} ({})".format(*closed)),
        ("", "faults: reader SIGKILL / SIGSTOP", f"{st['reader_kills']} / {st['reader_stops']}"),
        ("", "faults: writer SIGKILL / rotations", "{} / {}".format(*writers)),
        ("group", "group: dead shards reclaimed", f"{st['shards_reclaimed']}"),
        ("", "writer generations", f"{writer_gens} ({_by(st, 'writer_gens_')})"),
        *(("", f"error {k}", f"{n:,}") for k, n in sorted(t.errors.items())),
        ("", "  stale genuine refs explained", _by(st, "stale_explained_")),
        ("", "writer loop lag max / slowest op", f"{lag:.0f} ms / {op:.2f} s"),
        ("", "drain checks", ", ".join(drains) or "-"),
        ("", "violations", f"{len(t.violations):,}"),
    ]
    shown = [(label, value) for cond, label, value in rows if not cond or on.get(cond)]
    width = max(len(label) for label, _ in shown)
    group = f"group of {o.group} writer processes x " if o.group else ""
    lines = [
        f"aioshmcache stress: {elapsed:.1f} s{f' (ops limit {o.ops})' if o.ops else ''}, "
        f"delivery {o.delivery}, {o.readers} readers x {o.reader_concurrency}, {group}"
        f"{o.writers} writer tasks, ring {fmt_bytes(o.capacity)},\n  items "
        f"{fmt_bytes(o.min_item)}..{fmt_bytes(o.max_item)}, faults "
        f"{','.join(sorted(o.faults)) or 'none'}, seed {o.seed}",
        "-" * (width + 30),
        *(f"{label:<{width}}  {value}" for label, value in shown),
    ]
    if t.violations.items:
        lines += ["", f"VIOLATIONS ({len(t.violations)}):"]
        lines += [f"  {n:5d} x {k}" for k, n in t.violations.counts.most_common()]
        lines += ["first ones in full:", *(f"  - {x}" for x in t.violations.items[:30])]
    verdict = "FAIL" if t.violations.items else "OK"
    lines.append("RESULT: " + (f"INTERRUPTED ({verdict} so far)" if interrupted else verdict))
    return "\n".join(lines)

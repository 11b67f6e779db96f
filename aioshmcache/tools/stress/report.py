"""What a run counts, and the report made from it: the progress line, the table and the JSON."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from ..units import fmt_bytes
from .options import StressOptions

__all__ = ["Tally", "Violations", "as_json", "progress_line", "summary"]


class Violations:
    def __init__(self) -> None:
        self.items: list[str] = []
        self.counts: Counter[str] = Counter()

    def add(self, who: str, text: str) -> None:
        key = text.split(":")[0][:80]
        self.counts[key] += 1
        # a few of each kind: a flood of one (say, wrong data) must not hide another
        if self.counts[key] <= 20 and len(self.items) < 200:
            self.items.append(f"[{who}] {text}")

    def __len__(self) -> int:
        return sum(self.counts.values())


@dataclasses.dataclass
class Tally:
    """Every counter of a run (the parent's own, and the writers' last reported statistics)."""

    stats: Counter[str] = dataclasses.field(default_factory=Counter)
    errors: Counter[str] = dataclasses.field(default_factory=Counter)
    probes: Counter[str] = dataclasses.field(default_factory=Counter)
    err_texts: dict[str, str] = dataclasses.field(default_factory=dict)
    writer_stats: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    finals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    violations: Violations = dataclasses.field(default_factory=lambda: Violations())
    dead_gens: dict[int, str] = dataclasses.field(default_factory=dict)  # "killed" | "closed"
    wgone_gens: set[int] = dataclasses.field(default_factory=set)

    def writer_totals(self) -> Counter[str]:
        """The integer statistics of every writer generation, summed."""
        tot: Counter[str] = Counter()
        for s in self.writer_stats.values():
            for k, v in s.items():
                if isinstance(v, int) and not isinstance(v, bool) and not k.startswith("lag"):
                    tot[k] += v
        return tot

    def writer_max(self, key: str) -> float:
        """The largest value of a float statistic over every writer generation."""
        return max((s.get(key, 0.0) for s in self.writer_stats.values()), default=0.0)


def progress_line(
    opts: StressOptions, t: Tally, *, elapsed: float, gen: int, delivery: str, readers: int
) -> str:
    """One line of progress (every second on stderr)."""
    st, er = t.stats, t.errors
    wt = t.writer_totals()
    el = elapsed
    total = opts.duration
    hits, misses = wt.get("hits", 0), wt.get("misses", 0)
    hr = hits / (hits + misses) if hits + misses else 0.0
    lim = f"of {total:.0f}s" if total else f"ops {st['requests']}/{opts.ops}"
    wgone = sum(v for k, v in er.items() if k.startswith("WriterGoneError"))
    return (
        f"{lim}: g{gen} {delivery} "
        f"readers {readers}/{opts.readers} | req {st['requests']} "
        f"({st['requests'] / max(el, 1e-9):.0f}/s) verified {st['items_verified']} "
        f"{fmt_bytes(st['bytes_verified'], digits=2)} hit {hr:.0%} "
        f"evict {wt.get('evictions', 0)} "
        f"reloc {wt.get('relocations', 0)} "
        f"inline {wt.get('inline', 0)} "
        + (f"sibling {wt.get('sibling_hits', 0)} " if opts.group else "")
        + f"| kills r{st['reader_kills']} w{st['writer_kills']} "
        f"stops {st['reader_stops']} wgone {wgone} revoked {er['ReaderEvictedError']} "
        f"miss {er['CacheMissError (stale genuine refs)']} probes {t.probes['answered']} "
        f"| violations {len(t.violations)}"
    )


def as_json(opts: StressOptions, t: Tally, *, elapsed: float) -> dict[str, Any]:
    """The ``--json`` report."""
    return {
        "options": opts.child_dict(),
        "elapsed": elapsed,
        "stats": dict(t.stats),
        "errors": dict(t.errors),
        "error_texts": t.err_texts,
        "probes": dict(t.probes),
        "writer": dict(t.writer_totals()),
        "writer_lag_max": t.writer_max("lag_max"),
        "finals": t.finals,
        "violations": t.violations.items,
        "violation_count": len(t.violations),
        "dead_gens": t.dead_gens,
    }


def summary(
    opts: StressOptions, t: Tally, *, elapsed: float, writer_gens: int, interrupted: bool
) -> str:
    """The final table, the violations, and the verdict."""
    o, st, er, wt = opts, t.stats, t.errors, t.writer_totals()
    el = max(elapsed, 1e-9)
    lag = t.writer_max("lag_max")
    op_max = t.writer_max("op_max")
    hits, misses = wt.get("hits", 0), wt.get("misses", 0)
    rows: list[tuple[str, str, str]] = []

    def row(name: str, value: float | str, rate: bool = False) -> None:
        if isinstance(value, str):
            rows.append((name, value, ""))
        else:
            rows.append((name, f"{value:,.0f}", f"{value / el:,.1f}/s" if rate else ""))

    row("writer requests", st["requests"], True)
    row("  features", st["features"], True)
    row("  hits / misses", f"{hits:,} / {misses:,} ({hits / max(hits + misses, 1):.1%} hit)")
    if o.group:
        row("  sibling hits (copied from another shard)", wt.get("sibling_hits", 0), True)
    row("  handed out (refs)", wt.get("refs", 0), True)
    row(
        "  inline: full / too large / busy",
        f"{wt.get('inline_full', 0):,} / "
        f"{wt.get('inline_too_large', 0):,} / {wt.get('inline_busy', 0):,}",
    )
    row("  sender CacheMissError resends", wt.get("sender_cache_miss", 0))
    row("  evictions", wt.get("evictions", 0), True)
    row(
        "  relocations (second chance)",
        f"{wt.get('relocations', 0):,} items, {fmt_bytes(wt.get('bytes_relocated', 0))}"
        if o.second_chance
        else "off (--no-second-chance)",
    )
    row(
        "  cancelled (Task.cancel / move_on_after)",
        f"{wt.get('cancelled_task', 0):,} / {wt.get('cancelled_scope', 0):,}"
        f" (+{wt.get('cancel_too_late', 0):,} completed first)",
    )
    row("reader requests", st["reads"], True)
    row("  items verified (crc32)", st["items_verified"], True)
    row(
        "  bytes verified",
        f"{fmt_bytes(st['bytes_verified'], digits=2)} "
        f"({st['bytes_verified'] / el / 2**20:,.0f} MiB/s)",
    )
    row(
        "  cancelled (Task.cancel / move_on_after)",
        f"{st['read_cancelled_task']:,} / {st['read_cancelled_scope']:,}",
    )
    row("  skipped (writer gone)", st["read_skip"])
    if "close-read" in o.faults:
        row(
            "  closed under / beside a read (close-read)",
            f"{st['read_closed_during_read'] + st['closed_read_ok']:,} "
            f"({st['closed_read_ok']:,} read anyway) / {st['read_closed_beside_read']:,}",
        )
    row("faults: reader SIGKILL / SIGSTOP", f"{st['reader_kills']:,} / {st['reader_stops']:,}")
    row(
        "faults: writer SIGKILL / rotations",
        f"{st['writer_kills']:,} / {st['writer_rotations']:,}",
    )
    if "fork" in o.faults:
        row(
            "faults: forked, then SIGKILL: writer / reader",
            f"{st['fork_kills_writer']:,} / {st['fork_kills_reader']:,} "
            f"(dead slots dropped {st['fork_slots_dropped']:,})",
        )
    if "sweep-restart" in o.faults:
        row("faults: writers restarted while swept (kept)", st["sweep_restarts"])
    if o.group:
        row("group: dead shards reclaimed by the replacement", st["shards_reclaimed"])
    gens = ", ".join(f"{k[12:]} {v}" for k, v in sorted(st.items()) if k.startswith("writer_gens_"))
    row("writer generations", f"{writer_gens} ({gens})")
    for k, v in sorted(er.items()):
        row(f"error {k}", v)
    causes = ", ".join(
        f"{k[16:]} {v:,}" for k, v in sorted(st.items()) if k.startswith("stale_explained_")
    )
    row("  stale genuine refs explained", f"{st['stale_explained']:,} ({causes or '-'})")
    probe_ok = sum(
        v for k, v in t.probes.items() if ":" in k and not k.endswith((":skip", ":DATA"))
    )
    row(
        "forged/stale probes sent / answered",
        f"{t.probes['sent']:,} / {t.probes['answered']:,}",
    )
    row("  rejected with a typed error / skipped", f"{probe_ok:,} / {t.probes['skipped']:,}")
    by_exc: Counter[str] = Counter()
    for k, v in t.probes.items():
        if ":" in k:
            by_exc[k.split(":", 1)[1]] += v
    row("  by outcome", ", ".join(f"{k} {v}" for k, v in sorted(by_exc.items())) or "-")
    row("writer loop lag max / slowest op", f"{lag * 1000:.0f} ms / {op_max:.2f} s")
    drains = ", ".join(
        f"{f['why']}: {f.get('items', '?')} items, {f.get('n_not_freeable', '?')} stuck"
        for f in t.finals
    )
    row("drain checks", drains or "-")
    row("violations", len(t.violations))
    w1 = max(len(r[0]) for r in rows)
    w2 = max([len(r[1]) for r in rows if r[2] or r[1][:1].isdigit()] + [8])
    faults = ",".join(sorted(o.faults)) or "none"
    lim = f"{elapsed:.1f} s" + (f" (ops limit {o.ops})" if o.ops else "")
    head = (
        f"aioshmcache stress: {lim}, delivery {o.delivery}, {o.readers} readers x "
        f"{o.reader_concurrency}, "
        + (f"group of {o.group} writer processes x " if o.group else "")
        + f"{o.writers} writer tasks, ring {fmt_bytes(o.capacity)},\n"
        f"  items {fmt_bytes(o.min_item)}..{fmt_bytes(o.max_item)}, faults {faults}, "
        f"seed {o.seed}"
    )
    lines = [head, "-" * (w1 + w2 + 14)]
    for a, b, c in rows:
        numeric = bool(c) or b.replace(",", "").isdigit()
        lines.append((f"{a:<{w1}}  {b:>{w2}}  {c}" if numeric else f"{a:<{w1}}  {b}").rstrip())
    if t.violations.items:
        lines.append("")
        lines.append(f"VIOLATIONS ({len(t.violations)}):")
        for k, v in t.violations.counts.most_common():
            lines.append(f"  {v:5d} x {k}")
        lines.append("first ones in full:")
        lines += [f"  - {t}" for t in t.violations.items[:30]]
    verdict = "FAIL" if t.violations.items else "OK"
    lines.append("RESULT: " + (f"INTERRUPTED ({verdict} so far)" if interrupted else verdict))
    return "\n".join(lines)

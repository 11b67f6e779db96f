"""What a run counts, and the report made from it: the progress line, the table and the JSON."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Final

from ..units import fmt_bytes
from .options import FAULTS, StressOptions


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
    probes: Counter[str] = dataclasses.field(default_factory=Counter)
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
            tot.update({k: v for k, v in s.items() if type(v) is int and not k.startswith("lag")})
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
        "probes": dict(t.probes),
        "writer": dict(t.writer_totals()),
        "writer_lag_max": t.writer_max("lag_max"),
        "finals": t.finals,
        "violations": t.violations.items,
        "violation_count": len(t.violations),
        "dead_gens": t.dead_gens,
    }


#: the final table, one row a line: ``label | value [| rate key]``; ``[cond]`` first: shown only
#: with ``--group`` or that fault. Values format the run's counters (``s_``: the parent's, ``w_``:
#: the writers' totals, ``p_``: the probes') and the derived values of :func:`summary`.
TABLE: Final = """
writer requests | {s_requests:,} | s_requests
  features | {s_features:,} | s_features
  hits / misses | {w_hits:,} / {w_misses:,} ({hit:.1%} hit)
[group]  sibling hits (copied from another shard) | {w_sibling_hits:,} | w_sibling_hits
  handed out (refs) | {w_refs:,} | w_refs
  inline: full / too large / busy | {w_inline_full:,} / {w_inline_too_large:,} / {w_inline_busy:,}
  sender CacheMissError resends | {w_sender_cache_miss:,}
  evictions | {w_evictions:,} | w_evictions
  relocations (second chance) | {reloc}
  cancelled (Task.cancel / move_on_after) | {w_cancelled_task:,} / {w_cancelled_scope:,} (+{late})
reader requests | {s_reads:,} | s_reads
  items verified (crc32) | {s_items_verified:,} | s_items_verified
  bytes verified | {verified} ({mib_s:,.0f} MiB/s)
  cancelled (Task.cancel / move_on_after) | {s_read_cancelled_task:,} / {s_read_cancelled_scope:,}
  skipped (writer gone) | {s_read_skip:,}
[close-read]  closed under / beside a read | {closed}
faults: reader SIGKILL / SIGSTOP | {s_reader_kills:,} / {s_reader_stops:,}
faults: writer SIGKILL / rotations | {s_writer_kills:,} / {s_writer_rotations:,}
[fork]faults: forked, then SIGKILL: writer / reader | {s_fork_kills_writer:,} / {forked}
[sweep-restart]faults: writers restarted while swept (kept) | {s_sweep_restarts:,}
[group]group: dead shards reclaimed by the replacement | {s_shards_reclaimed:,}
writer generations | {gens}
{errors}
  stale genuine refs explained | {s_stale_explained:,} ({causes})
forged/stale probes sent / answered | {p_sent:,} / {p_answered:,}
  rejected with a typed error / skipped | {rejected:,} / {p_skipped:,}
  by outcome | {outcomes}
writer loop lag max / slowest op | {lag:.0f} ms / {op_max:.2f} s
drain checks | {drains}
violations | {violations:,}
"""


HEAD: Final = (
    "aioshmcache stress: {elapsed:.1f} s{ops}, delivery {o.delivery}, {o.readers} readers x "
    "{o.reader_concurrency}, {group}{o.writers} writer tasks, ring {ring},\n  items {items}, "
    "faults {faults}, seed {o.seed}"
)
PROGRESS: Final = (
    "{lim}: g{gen} {delivery} readers {live}/{o.readers} | req {s_requests} ({rate:.0f}/s) "
    "verified {s_items_verified} {verified} hit {hit:.0%} evict {w_evictions} reloc "
    "{w_relocations} inline {w_inline} {sibling}| kills r{s_reader_kills} w{s_writer_kills} "
    "stops {s_reader_stops} wgone {wgone} revoked {e_ReaderEvictedError} miss {e_miss} "
    "probes {p_answered} | violations {violations}"
)


class _Values(dict[str, Any]):
    def __missing__(self, key: str) -> int:
        return 0


def _by(counts: Counter[str], prefix: str) -> str:
    """``a 1, b 2`` from the counters named ``<prefix>a``, ``<prefix>b``."""
    got = [f"{k[len(prefix) :]} {n:,}" for k, n in sorted(counts.items()) if k.startswith(prefix)]
    return ", ".join(got) or "-"


def _values(o: StressOptions, t: Tally, elapsed: float) -> _Values:
    """What the templates show: the counters (``s_``: the parent's, ``w_``: the writers'
    totals, ``p_``: the probes', ``e_``: the errors') and values derived from them."""
    st, wt, el = t.stats, t.writer_totals(), max(elapsed, 1e-9)
    v = _Values({f"s_{k}": n for k, n in st.items()}, o=o, el=el, violations=len(t.violations))
    for prefix, counts in (("w_", wt), ("p_", t.probes), ("e_", t.errors)):
        v.update({prefix + k: n for k, n in counts.items()})
    outcomes: Counter[str] = Counter()
    for k, n in t.probes.items():
        if ":" in k:
            outcomes["_" + k.split(":", 1)[1]] += n
    drains = [
        f"{f['why']}: {f.get('items')} items, {f.get('n_not_freeable')} stuck" for f in t.finals
    ]
    v.update(
        hit=wt["hits"] / max(wt["hits"] + wt["misses"], 1),
        reloc=f"{wt['relocations']:,} items, {fmt_bytes(wt['bytes_relocated'])}"
        if o.second_chance
        else "off (--no-second-chance)",
        late=f"{wt['cancel_too_late']:,} completed first",
        drains=", ".join(drains) or "-",
        verified=fmt_bytes(st["bytes_verified"], digits=2),
        mib_s=st["bytes_verified"] / el / 2**20,
        closed=f"{st['read_closed_during_read'] + st['closed_read_ok']:,} ({st['closed_read_ok']:,}"
        f" read ok) / {st['read_closed_beside_read']:,}",
        forked=f"{st['fork_kills_reader']:,} (dead slots dropped {st['fork_slots_dropped']:,})",
        causes=_by(st, "stale_explained_"),
        rejected=sum(n for k, n in outcomes.items() if k not in ("_skip", "_DATA")),
        outcomes=_by(outcomes, "_"),
        lag=t.writer_max("lag_max") * 1000,
        op_max=t.writer_max("op_max"),
        rate=st["requests"] / el,
        wgone=sum(n for k, n in t.errors.items() if k.startswith("WriterGoneError")),
        e_miss=t.errors["CacheMissError (stale genuine refs)"],
        sibling=f"sibling {wt['sibling_hits']} " if o.group else "",
    )
    return v


def progress_line(
    o: StressOptions, t: Tally, elapsed: float, gen: int, delivery: str, live: int
) -> str:
    """One line of progress (every second on stderr)."""
    lim = f"of {o.duration:.0f}s" if o.duration else f"ops {t.stats['requests']}/{o.ops}"
    return PROGRESS.format_map(
        _Values(_values(o, t, elapsed), lim=lim, gen=gen, delivery=delivery, live=live)
    )


def summary(o: StressOptions, t: Tally, elapsed: float, writer_gens: int, interrupted: bool) -> str:
    """The final table, the violations, and the verdict."""
    v = _values(o, t, elapsed)
    v["gens"] = f"{writer_gens} ({_by(t.stats, 'writer_gens_')})"
    errors = "\n".join(f"error {k} | {n:,}" for k, n in sorted(t.errors.items()))
    shown = {"group": bool(o.group), **{f: f in o.faults for f in FAULTS}}
    rows = []
    for line in TABLE.replace("{errors}", errors).strip().splitlines():
        cond, _, line = line[1:].partition("]") if line.startswith("[") else ("", "", line)
        if line and shown.get(cond, True):
            label, value, *rate = line.split(" | ")
            rows.append(
                (label, value.format_map(v), f"{v[rate[0]] / v['el']:,.1f}/s" if rate else "")
            )
    w1 = max(len(r[0]) for r in rows)
    w2 = max([len(r[1]) for r in rows if r[2] or r[1][:1].isdigit()] + [8])
    v.update(
        elapsed=elapsed,
        ops=f" (ops limit {o.ops})" if o.ops else "",
        group=f"group of {o.group} writer processes x " if o.group else "",
        ring=fmt_bytes(o.capacity),
        items=f"{fmt_bytes(o.min_item)}..{fmt_bytes(o.max_item)}",
        faults=",".join(sorted(o.faults)) or "none",
    )
    lines = [HEAD.format_map(v), "-" * (w1 + w2 + 14)]
    for a, b, c in rows:
        numeric = bool(c) or b.replace(",", "").isdigit()
        lines.append((f"{a:<{w1}}  {b:>{w2}}  {c}" if numeric else f"{a:<{w1}}  {b}").rstrip())
    if t.violations.items:
        lines += ["", f"VIOLATIONS ({len(t.violations)}):"]
        lines += [f"  {n:5d} x {k}" for k, n in t.violations.counts.most_common()]
        lines += ["first ones in full:", *(f"  - {x}" for x in t.violations.items[:30])]
    verdict = "FAIL" if t.violations.items else "OK"
    lines.append("RESULT: " + (f"INTERRUPTED ({verdict} so far)" if interrupted else verdict))
    return "\n".join(lines)

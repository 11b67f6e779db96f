"""Results: rows, targets, the markdown table, the JSON dump and the PNG plot.

Every row names its subject and, where it has one, a baseline measured in the same run. The ratio
is always ``baseline time / subject time`` (for rates: ``subject rate / baseline rate``), so a
ratio above 1 means the subject is faster than its baseline: a put at 0.85x runs at 85 % of the
speed of a plain ``np.copyto`` into warm shared memory; a round trip at 2.0x against Ray takes
half as long as Ray's put + get.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..units import fmt_bytes, fmt_seconds
from .timing import Stat

__all__ = ["Report", "Row", "Target"]

Kind = Literal["time", "rate", "ratio", "count", "bytes", "fraction"]


@dataclass(frozen=True)
class Target:
    """A stated target: ``value`` (or ``ratio``) compared with ``limit``."""

    on: Literal["value", "ratio"]
    op: Literal["<=", ">="]
    limit: float

    def holds(self, value: float, ratio: float | None) -> bool | None:
        x = value if self.on == "value" else ratio
        if x is None or not math.isfinite(x):
            return None
        return x <= self.limit if self.op == "<=" else x >= self.limit

    def text(self, kind: Kind) -> str:
        op = "≤" if self.op == "<=" else "≥"
        if self.on == "ratio":
            return f"ratio {op} {self.limit:g}x"
        return f"{op} {_fmt_value(self.limit, kind)}"


@dataclass
class Row:
    """One figure of the table."""

    section: str
    label: str
    param: str
    value: float
    kind: Kind = "time"
    stat: Stat | None = None
    baseline: str | None = None
    ratio: float | None = None
    target: Target | None = None
    note: str = ""
    plot: str | None = None  # which panel of the PNG draws it
    series: str | None = None
    x: float | None = None

    @property
    def holds(self) -> bool | None:
        return None if self.target is None else self.target.holds(self.value, self.ratio)


def _fmt_value(v: float, kind: Kind) -> str:
    if not math.isfinite(v):
        return "n/a"
    if kind == "time":
        return fmt_seconds(v)
    if kind == "rate":
        return f"{v:,.0f}/s"
    if kind == "ratio":
        return f"{v:.2f}x"
    if kind == "bytes":
        return fmt_bytes(int(v))
    if kind == "fraction":
        return f"{v:.1%}"
    return f"{v:,.0f}"


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return ""
    if not math.isfinite(r):
        return "n/a"
    return f"{r:.3g}x"


def _verdict(h: bool | None) -> str:
    return {True: "yes", False: "**NO**", None: ""}[h]


@dataclass
class Report:
    """Everything one run measured, plus the conditions it ran under."""

    title: str
    quick: bool
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: extra markdown tables: (heading, lines), written after the sections
    blocks: list[tuple[str, list[str]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    load_start: tuple[float, float, float] = field(default_factory=os.getloadavg)
    load_end: tuple[float, float, float] | None = None
    finished: float | None = None

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def row(
        self,
        section: str,
        label: str,
        param: str,
        value: float | Stat,
        *,
        vs: tuple[str, Stat] | None = None,
        **kw: Any,
    ) -> Row:
        """Add one row: a :class:`Stat` gives its median (and is kept); ``vs=(name, baseline)``
        names the baseline and sets the ratio baseline ÷ this (above 1: this is faster)."""
        stat = value if isinstance(value, Stat) else None
        v = value.median if isinstance(value, Stat) else value
        if vs is not None:
            kw.setdefault("baseline", vs[0])
            kw.setdefault("ratio", vs[1].median / v if v else math.nan)
        return self.add(Row(section, label, param, v, stat=stat, **kw))

    def extend(self, rows: Iterable[Row]) -> None:
        self.rows.extend(rows)

    def skip(self, what: str) -> None:
        self.skipped.append(what)

    def attempt(self, what: str, fn: Callable[[], None]) -> bool:
        """Run one workload; a failure is recorded (and printed), not fatal to the others."""
        try:
            fn()
        except Exception as exc:
            tb = traceback.format_exception(exc)
            self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
            print(f"bench: {what} FAILED\n{''.join(tb)}", file=sys.stderr, flush=True)
            return False
        return True

    def missed(self) -> list[Row]:
        """The rows whose target does not hold."""
        return [r for r in self.rows if r.holds is False]

    def finish(self) -> None:
        self.finished = time.time()
        self.load_end = os.getloadavg()

    # --- markdown ---------------------------------------------------------------------------
    def conditions(self) -> list[str]:
        import numpy as np

        t = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started))
        dur = (self.finished or time.time()) - self.started
        le = self.load_end or os.getloadavg()
        return [
            f"- date: {t}; duration {dur:.0f} s; "
            + ("quick (smoke) run" if self.quick else "full run"),
            f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            f"- Python {platform.python_version()}, numpy {np.__version__}",
            "- load average (1/5/15 min) at start: "
            + "/".join(f"{x:.2f}" for x in self.load_start)
            + "; at end: "
            + "/".join(f"{x:.2f}" for x in le),
        ]

    def targets_table(self) -> list[str]:
        rows = [r for r in self.rows if r.target is not None]
        if not rows:
            return []
        out = [
            "| target | measured | ratio | holds |",
            "|---|---|---|---|",
        ]
        for r in rows:
            if r.target is None:  # for mypy; filtered above
                continue
            what = f"{r.label} ({r.param})" if r.param else r.label
            out.append(
                f"| {what}: {r.target.text(r.kind)} | "
                f"{_fmt_value(r.value, r.kind)} | {_fmt_ratio(r.ratio)} | {_verdict(r.holds)} |"
            )
        return out

    def sections(self) -> list[str]:
        seen: list[str] = []
        for r in self.rows:
            if r.section not in seen:
                seen.append(r.section)
        return seen

    def section_table(self, section: str) -> list[str]:
        out = [
            "| workload | param | median | run medians (min-max) | p99 | baseline | ratio "
            "| target |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            if r.section != section:
                continue
            spread = p99 = ""
            if r.stat is not None and r.stat.runs > 1:
                spread = f"{_fmt_value(r.stat.lo, r.kind)} - {_fmt_value(r.stat.hi, r.kind)}"
            if r.stat is not None and r.kind == "time" and r.stat.n >= 20:
                p99 = _fmt_value(r.stat.p99, r.kind)
            tgt = ""
            if r.target is not None:
                tgt = f"{r.target.text(r.kind)}: {_verdict(r.holds)}"
            label = r.label + (f" — {r.note}" if r.note else "")
            out.append(
                f"| {label} | {r.param} | {_fmt_value(r.value, r.kind)} | {spread} | {p99} | "
                f"{r.baseline or ''} | {_fmt_ratio(r.ratio)} | {tgt} |"
            )
        return out

    def markdown(self) -> str:
        lines = [f"# {self.title}", "", *self.conditions(), ""]
        lines += [
            "Every figure is the median over several runs of each run's median; 'run medians' "
            "is their range (the noise between runs); p99 is over all samples. ratio = baseline "
            "time ÷ subject time (rates: subject ÷ baseline): above 1 the subject is faster.",
            "",
        ]
        tt = self.targets_table()
        if tt:
            lines += ["## Targets", "", *tt, ""]
        for s in self.sections():
            lines += [f"## {s}", "", *self.section_table(s), ""]
        for heading, block in self.blocks:
            lines += [f"## {heading}", "", *block, ""]
        if self.errors:
            lines += ["## Errors", ""] + [f"- {e}" for e in self.errors] + [""]
        if self.skipped:
            lines += ["## Skipped", ""] + [f"- {s}" for s in self.skipped] + [""]
        if self.notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(lines)

    # --- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        def row(r: Row) -> dict[str, Any]:
            d = asdict(r)
            d["holds"] = r.holds
            return d

        return {
            "title": self.title,
            "quick": self.quick,
            "started": self.started,
            "finished": self.finished,
            "load_start": self.load_start,
            "load_end": self.load_end,
            "python": sys.version,
            "rows": [row(r) for r in self.rows],
            "skipped": self.skipped,
            "errors": self.errors,
            "notes": self.notes,
            "blocks": [{"heading": h, "lines": b} for h, b in self.blocks],
        }

    # --- files ------------------------------------------------------------------------------
    def write(self, out_dir: Path, stem: str) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        md = out_dir / f"{stem}.md"
        md.write_text(self.markdown() + "\n", encoding="utf-8")
        js = out_dir / f"{stem}.json"
        js.write_text(json.dumps(self.to_json(), indent=1, allow_nan=True) + "\n", encoding="utf-8")
        written = [md, js]
        png = out_dir / f"{stem}.png"
        if plot(self, png):
            written.append(png)
        return written


# --- the plot -----------------------------------------------------------------------------

_PANELS: dict[str, tuple[str, str, str, bool, bool]] = {
    # key: (title, x label, y label, log x, log y)
    "store": ("Store, one array item (median)", "item size", "time per operation", True, True),
    "store_ratio": (
        "Speed relative to np.copyto into shm",
        "item size",
        "ratio (1 = memcpy)",
        True,
        False,
    ),
    "roundtrip": ("Round trip writer → reader → reply", "item size", "time", True, True),
    "readers": ("Read path vs attached readers", "attached readers", "get time", False, True),
    "cache_size": ("Cost vs cache size", "cache size", "time", True, True),
    "threshold": ("Async put: inline vs thread", "item size", "put latency", True, True),
    "looplag": ("Loop lag of a 1 ms ticker", "", "lag", False, True),
    "small": ("1 KiB steady state (writer/reader processes)", "", "time", False, False),
    "trace": ("Miss ratio on Zipf traces (lower is better)", "", "miss ratio", False, False),
}
#: bar colours of the trace panel, by policy (anything else: the next default colour)
_TRACE_COLOURS = {"FIFO": "C3", "second chance": "C2", "LRU model": "silver"}


def _trace_bars(ax: Any, rows: Sequence[Row]) -> None:
    """Grouped bars: one group per trace (the row's param), one bar per policy (its series)."""
    traces: list[str] = []
    policies: list[str] = []
    for r in rows:
        if r.param not in traces:
            traces.append(r.param)
        if (r.series or r.label) not in policies:
            policies.append(r.series or r.label)
    width = 0.8 / max(1, len(policies))
    for k, name in enumerate(policies):
        xs, ys = [], []
        for r in rows:
            if (r.series or r.label) == name and math.isfinite(r.value):
                xs.append(traces.index(r.param) + (k - (len(policies) - 1) / 2) * width)
                ys.append(r.value)
        bars = ax.bar(xs, ys, width, label=name, color=_TRACE_COLOURS.get(name, f"C{k}"))
        ax.bar_label(bars, labels=[f"{y:.0%}" for y in ys], fontsize=5, padding=1)
    ax.set_xticks(range(len(traces)))
    ax.set_xticklabels([t.replace(", ", "\n") for t in traces], fontsize=7)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6)


def _size_ticks(ax: Any, xs: Sequence[float]) -> None:
    ticks = sorted(set(xs))
    ax.set_xticks(ticks)
    ax.set_xticklabels([fmt_bytes(int(t)).replace(" ", "") for t in ticks], rotation=45, fontsize=7)
    ax.minorticks_off()


def plot(report: Report, path: Path) -> bool:
    """Draw every panel that has data into one PNG; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        report.skip("plot: matplotlib is not installed (pip install 'aioshmcache[bench]')")
        return False

    def rows_of(key: str) -> list[Row]:
        if key == "store_ratio":  # derived: the ratios of the store rows (the lease is not a copy)
            return [
                Row(r.section, r.label, r.param, r.ratio, kind="ratio", series=r.series, x=r.x)
                for r in report.rows
                if r.plot == "store" and r.ratio is not None and r.series != "get (lease)"
            ]
        return [r for r in report.rows if r.plot == key]

    panels = [k for k in _PANELS if rows_of(k)]
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    baseline_styles = [("black", "--", "s"), ("dimgray", ":", "^"), ("gray", "-.", "v")]

    if not panels:
        return False
    ncols = 3 if len(panels) > 4 else 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, panels):
        title, xlabel, ylabel, logx, logy = _PANELS[key]
        rows = rows_of(key)
        scale = 1.0
        unit = ""
        if all(r.kind == "time" for r in rows):
            m = max((r.value for r in rows if math.isfinite(r.value)), default=1.0)
            scale, unit = (1e3, "ms") if m > 2e-3 else (1e6, "µs")
        if key == "trace":
            _trace_bars(ax, rows)
        elif key in ("looplag", "small"):
            # categorical bars
            labels = [f"{r.series or r.label}" for r in rows]
            vals = [r.value * scale for r in rows]
            bars = ax.bar(range(len(rows)), vals, color="C0")
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
            for b, r in zip(bars, rows):
                if r.target is not None:
                    b.set_color("C2" if r.holds else "C3")
                    ax.axhline(r.target.limit * scale, color="gray", ls=":", lw=0.8)
            if logy:
                ax.set_yscale("log")
        else:
            series: dict[str, list[Row]] = {}
            for r in rows:
                if r.x is not None and math.isfinite(r.value):
                    series.setdefault(r.series or r.label, []).append(r)
            xs_all: list[float] = []
            n_base = n_subject = 0
            for name, rs in series.items():
                rs = sorted(rs, key=lambda r: r.x or 0.0)
                xs = [float(r.x or 0.0) for r in rs]
                ys = [r.value * scale for r in rs]
                xs_all += xs
                if name.startswith("np."):  # baselines: greys, dashed
                    c, ls, mk = baseline_styles[n_base % len(baseline_styles)]
                    n_base += 1
                else:
                    c, ls, mk = f"C{n_subject % 10}", "-", "o"
                    n_subject += 1
                ax.plot(xs, ys, ls, marker=mk, ms=3, label=name, color=c)
            if logx:
                ax.set_xscale("log")
            if logy:
                ax.set_yscale("log")
            if key == "store_ratio":
                ax.axhline(1.0, color="gray", lw=0.8)
                ax.axhline(0.8, color="gray", ls=":", lw=0.8)
            if key == "threshold":
                from aioshmcache.aio import DEFAULT_INLINE_THRESHOLD

                ax.axvline(DEFAULT_INLINE_THRESHOLD, color="gray", ls=":", lw=0.8)
            if xs_all and key in ("store", "store_ratio", "roundtrip", "threshold", "cache_size"):
                _size_ticks(ax, xs_all)
            ax.legend(fontsize=6)
        if logy:
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda _v, _pos: ""))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel + (f" ({unit})" if unit else ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(report.started))
    fig.suptitle(f"{report.title} — {when}{' (quick)' if report.quick else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

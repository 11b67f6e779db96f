"""The one report writer: rows and targets, the markdown tables, the JSON dump and the PNG plot.

Every row names its subject and, where it has one, a baseline measured in the same run. The ratio
is always ``baseline time / subject time`` (for rates: ``subject rate / baseline rate``), so a
ratio above 1 means the subject is faster than its baseline: a put at 0.85x runs at 85 % of the
speed of a plain ``np.copyto`` into warm shared memory; a round trip at 2.0x against a Pipe
takes half as long as sending the array through the Pipe.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..units import fmt_bytes, fmt_seconds
from .timing import Stat

__all__ = ["Report", "Row", "Target", "md_table"]

Kind = Literal["time", "rate", "ratio", "count", "bytes", "fraction"]

_FORMAT: dict[str, Callable[[float], str]] = {
    "time": fmt_seconds,
    "rate": lambda v: f"{v:,.0f}/s",
    "ratio": lambda v: f"{v:.2f}x",
    "bytes": lambda v: fmt_bytes(int(v)),
    "fraction": lambda v: f"{v:.1%}",
    "count": lambda v: f"{v:,.0f}",
    "x": lambda v: f"{v:.3g}x",  # the ratio column
}


def _fmt(v: float | None, kind: str) -> str:
    if v is None:
        return ""
    return _FORMAT[kind](v) if math.isfinite(v) else "n/a"


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table: the header, the rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


@dataclass(frozen=True)
class Target:
    """A stated target: the row's ``value`` (or its ``ratio``) ``<=`` or ``>=`` ``limit``."""

    op: Literal["<=", ">="]
    limit: float
    on: Literal["value", "ratio"] = "value"

    def holds(self, value: float, ratio: float | None) -> bool | None:
        x = value if self.on == "value" else ratio
        if x is None or not math.isfinite(x):
            return None
        return x <= self.limit if self.op == "<=" else x >= self.limit


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

    @property
    def target_text(self) -> str:
        if (t := self.target) is None:
            return ""
        op = "≤" if t.op == "<=" else "≥"
        return f"ratio {op} {t.limit:g}x" if t.on == "ratio" else f"{op} {_fmt(t.limit, self.kind)}"

    @property
    def verdict(self) -> str:
        return {True: "yes", False: "**NO**", None: ""}[self.holds]

    @property
    def what(self) -> str:
        return f"{self.label} ({self.param})" if self.param else self.label


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

    def section(self, name: str, param: str = "", **common: Any) -> Callable[..., Row]:
        """A writer of rows of section ``name``: ``add(label, value, **kw)``, with ``param`` and
        ``common`` preset (and overridable). A :class:`Stat` value gives its median (and is
        kept); ``vs=(name, baseline)`` names the baseline and sets the ratio baseline ÷ this
        (above 1: this is faster)."""

        def add(label: str, value: float | Stat, param: str = param, **kw: Any) -> Row:
            kw = common | kw
            stat = value if isinstance(value, Stat) else None
            v = value.median if isinstance(value, Stat) else value
            if (vs := kw.pop("vs", None)) is not None:
                kw.setdefault("baseline", vs[0])
                kw.setdefault("ratio", vs[1].median / v if v else math.nan)
            return self.add(Row(name, label, param, v, stat=stat, **kw))

        return add

    def skip(self, what: str) -> None:
        self.skipped.append(what)

    def attempt(self, what: str, fn: Callable[[], object]) -> bool:
        """Run one workload; a failure is recorded (and printed), not fatal to the others."""
        try:
            fn()
        except Exception as exc:
            self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
            tb = "".join(traceback.format_exception(exc))
            print(f"bench: {what} FAILED\n{tb}", file=sys.stderr, flush=True)
            return False
        return True

    def missed(self) -> list[Row]:
        """The rows whose target does not hold."""
        return [r for r in self.rows if r.holds is False]

    def finish(self) -> None:
        self.finished = time.time()
        self.load_end = os.getloadavg()

    def markdown(self) -> str:
        import numpy as np

        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started))
        dur = (self.finished or time.time()) - self.started
        loads = [
            " / ".join(f"{x:.2f}" for x in la)
            for la in (self.load_start, self.load_end or os.getloadavg())
        ]
        lines = [
            f"# {self.title}",
            "",
            f"- date: {when}; duration {dur:.0f} s; "
            + ("quick (smoke) run" if self.quick else "full run"),
            f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            f"- Python {platform.python_version()}, numpy {np.__version__}",
            f"- load average (1/5/15 min) at start: {loads[0]}; at end: {loads[1]}",
            "",
            "Every figure is the median over several runs of each run's median; 'run medians' "
            "is their range (the noise between runs); p99 is over all samples. ratio = baseline "
            "time ÷ subject time (rates: subject ÷ baseline): above 1 the subject is faster — "
            "except in a section whose title states the reverse (the vLLM suite: ours ÷ theirs).",
            "",
        ]
        targets = [
            (f"{r.what}: {r.target_text}", _fmt(r.value, r.kind), _fmt(r.ratio, "x"), r.verdict)
            for r in self.rows
            if r.target is not None
        ]
        if targets:
            head = ("target", "measured", "ratio", "holds")
            lines += ["## Targets", "", *md_table(head, targets), ""]
        for section in dict.fromkeys(r.section for r in self.rows):
            cells = [_section_cells(r) for r in self.rows if r.section == section]
            cols = ("workload", "param", "median", "run medians (min-max)", "p99", "baseline")
            lines += [f"## {section}", "", *md_table((*cols, "ratio", "target"), cells), ""]
        for heading, block in self.blocks:
            lines += [f"## {heading}", "", *block, ""]
        lists = {"Errors": self.errors, "Skipped": self.skipped, "Notes": self.notes}
        for heading, items in lists.items():
            lines += [f"## {heading}", "", *(f"- {x}" for x in items), ""] if items else []
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        rows = [asdict(r) | {"holds": r.holds} for r in self.rows]
        blocks = [{"heading": h, "lines": b} for h, b in self.blocks]
        return asdict(self) | {"python": sys.version, "rows": rows, "blocks": blocks}

    def write(self, out_dir: Path, stem: str) -> list[Path]:
        """``STEM.md``, ``STEM.json`` and (with matplotlib) ``STEM.png`` in ``out_dir``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        md, js, png = (out_dir / f"{stem}.{ext}" for ext in ("md", "json", "png"))
        md.write_text(self.markdown() + "\n", encoding="utf-8")
        js.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return [md, js, png] if plot(self, png) else [md, js]


def _section_cells(r: Row) -> tuple[str, ...]:
    runs = p99 = ""
    if r.stat is not None and r.stat.runs > 1:
        runs = f"{_fmt(r.stat.lo, r.kind)} - {_fmt(r.stat.hi, r.kind)}"
    if r.stat is not None and r.kind == "time" and r.stat.n >= 20:
        p99 = _fmt(r.stat.p99, r.kind)
    tgt = f"{r.target_text}: {r.verdict}" if r.target is not None else ""
    label = r.label + (f" — {r.note}" if r.note else "")
    value, ratio = _fmt(r.value, r.kind), _fmt(r.ratio, "x")
    return (label, r.param, value, runs, p99, r.baseline or "", ratio, tgt)


# --- the plot: one panel per plot key, one generic drawing for all of them -----------------------

#: plot key: (panel title, y label). A panel whose rows all have an x (an item size) draws lines
#: over it, else bars: one group per param, one bar per series.
_PANELS: dict[str, tuple[str, str]] = {
    "store": ("Store, one array item (median)", "time per operation"),
    "roundtrip": ("Round trip writer → reader → reply", "time"),
    "threshold": ("Async put: inline vs thread", "put latency"),
    "looplag": ("Loop lag of a 1 ms ticker", "lag"),
    "small": ("1 KiB steady state (writer/reader processes)", "time"),
    "trace": ("Miss ratio on Zipf traces (lower is better)", "miss ratio"),
}


def _draw(ax: Any, rows: list[Row]) -> str:
    """Draw ``rows`` into ``ax``: lines (baselines grey, dashed) or grouped bars; the time unit."""
    scale, unit = 1.0, ""
    if all(r.kind == "time" for r in rows):
        scale, unit = (1e3, "ms") if max(r.value for r in rows) > 2e-3 else (1e6, "µs")
    names = list(dict.fromkeys(r.series or r.label for r in rows))
    groups = list(dict.fromkeys(r.param for r in rows))
    lines, width = all(r.x is not None for r in rows), 0.8 / len(names)
    for k, name in enumerate(names):
        mine = sorted((r for r in rows if (r.series or r.label) == name), key=lambda r: r.x or 0)
        ys = [r.value * scale for r in mine]
        if lines:
            style = {"color": "gray", "ls": "--"} if name.startswith("np.") else {}
            ax.plot([r.x for r in mine], ys, marker="o", ms=3, label=name, **style)
        else:
            at = [groups.index(r.param) + (k - (len(names) - 1) / 2) * width for r in mine]
            ax.bar(at, ys, width, label=name)
    if lines:
        ticks = sorted({r.x for r in rows if r.x is not None})
        ax.set_xscale("log")
        ax.set_xticks(ticks, [fmt_bytes(int(t)).replace(" ", "") for t in ticks], rotation=45)
        ax.minorticks_off()
    else:
        ax.set_xticks(range(len(groups)), [g.replace(", ", "\n") for g in groups])
    values = [r.value for r in rows if r.value > 0]
    if values and max(values) > 50 * min(values):  # figures orders of magnitude apart
        ax.set_yscale("log")
    return unit


def plot(report: Report, path: Path) -> bool:
    """Draw every panel that has data into one PNG; False if matplotlib is missing (or none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        report.skip("plot: matplotlib is not installed (pip install -e '.[bench]' in a clone)")
        return False
    finite = [r for r in report.rows if r.plot in _PANELS and math.isfinite(r.value)]
    panels = {k: rows for k in _PANELS if (rows := [r for r in finite if r.plot == k])}
    if not panels:
        return False
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (key, rows) in zip(axes.flat, panels.items()):
        title, ylabel = _PANELS[key]
        unit = _draw(ax, rows)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel + (f" ({unit})" if unit else ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(report.started))
    fig.suptitle(f"{report.title} — {when}{' (quick)' if report.quick else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

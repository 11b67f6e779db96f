"""The harness's options: one dataclass, and the command line generated from its fields.

A field with ``help`` in its metadata is a flag ``--field-name`` (``flag`` renames it); ``parse``
is its parser where the field's type is not enough, ``lo``/``gt``/``hi`` its bounds, the rest
goes to ``argparse.add_argument``. A new option is one field.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
from collections.abc import Callable
from operator import ge, gt, le
from typing import Any, Final

from aioshmcache import CacheConfig

from ..units import fmt_bytes, parse_duration, parse_size

__all__ = ["FAULTS", "StressOptions", "parse_args"]

#: every fault, and the option that tunes it; the parent injects the first three
#: (``parent.PERIODIC``), the children the others
FAULTS: Final = {
    "kill-readers": "reader_kill_every",  # SIGKILL: its debts go, a new reader owes nothing older
    "stop-readers": "reader_stop_every",  # SIGSTOP: revoked past --evict-after, then reattaches
    "kill-writer": "writer_kill_every",  # readers see WriterGoneError within 1 s; sweep; restart
    "cancel": "cancel_prob",  # Task.cancel / anyio scopes mid-call, on both sides
    "close-read": "close_read_prob",  # a reader's cache closed under its own read
}
SABOTAGES: Final = frozenset({"digest", "drop"})
DELIVERIES: Final = ("broadcast", "one_of_n", "alternate")
BOUNDS: Final = {"lo": (">=", ge), "gt": (">", gt), "hi": ("<=", le)}


def _opt(default: Any, help: str, parse: Callable[[str], Any] | None = None, **kw: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse, **kw})


@dataclasses.dataclass
class StressOptions:
    """Everything a run is parametrised by (children get it as JSON)."""

    duration: float | None = _opt(30.0, "run time, e.g. 60s, 2h (default 30s)", parse_duration)
    ops: int | None = _opt(None, "stop after this many writer requests", int, lo=1)
    readers: int = _opt(3, "reader processes", lo=1, hi=64)
    writers: int = _opt(4, "concurrent writer tasks", lo=1)
    group: int = _opt(0, "writers of one cache group's shards (0: a plain cache)", lo=0, hi=16)
    reader_concurrency: int = _opt(2, "concurrent reads per reader", lo=1)
    delivery: str = _opt("alternate", "alternate: switch at each writer", choices=DELIVERIES)
    faults: frozenset[str] = frozenset()  # --faults LIST
    capacity: int = _opt(96 << 20, "ring capacity", parse_size)
    max_object: int = _opt(33 << 20, "max object", parse_size)
    min_item: int = _opt(1 << 10, "smallest item", parse_size, lo=1024)
    max_item: int = _opt(32 << 20, "largest item", parse_size)
    oversize_fraction: float = 0.003
    universe: int = _opt(2000, "distinct hashes", lo=1)
    zipf: float = _opt(1.1, "Zipf exponent of hash repeats", gt=0)
    window: int = _opt(16, "requests in flight", lo=1)
    evict_after: float = _opt(1.5, "evict_stuck_readers_after with stop-readers (s)", lo=0)
    handout_ttl: float = _opt(3.0, "one-of-N handout_ttl (s)", gt=0)
    wait_for_space: float = _opt(0.2, "largest wait_for_space a writer passes (s)", lo=0)
    second_chance: bool = _opt(True, "pure FIFO eviction", flag="--no-second-chance")
    op_deadline: float = _opt(10.0, "per-operation deadline (s)", gt=0)
    hang_timeout: float = _opt(15.0, "silent child = hang (s)", gt=0)
    max_loop_lag: float = _opt(5.0, "writer loop lag bound (s)")
    reader_kill_every: float = _opt(4.0, "kill-readers fault period", parse_duration)
    reader_stop_every: float = _opt(5.0, "stop-readers fault period", parse_duration)
    writer_kill_every: float = _opt(15.0, "kill-writer fault period", parse_duration)
    cancel_prob: float = _opt(0.1, "share of cancelled operations", lo=0, hi=1)
    close_read_prob: float = _opt(0.02, "share of reads closed under (close-read)", lo=0, hi=1)
    seed: int = _opt(0, "random seed (default: random)", int)
    loop: str = _opt("asyncio", "event loop of the children", choices=("asyncio", "uvloop"))
    json_path: str | None = _opt(None, "write the final statistics here as JSON", flag="--json")
    quiet: bool = _opt(False, "no progress line")
    keep_logs: bool = _opt(False, "keep the children's logs")
    private_shm: int = _opt(0, "run in a private /dev/shm of this size (root)", parse_size)
    switch_interval: float = _opt(0.0001, "sys.setswitchinterval in the children (s; 0: default)")
    sabotage: frozenset[str] = frozenset()  # the harness's self-test (a hidden flag)

    def child_dict(self) -> dict[str, Any]:
        return dict(
            dataclasses.asdict(self), faults=sorted(self.faults), sabotage=sorted(self.sabotage)
        )

    @classmethod
    def from_child_dict(cls, d: dict[str, Any]) -> StressOptions:
        return cls(**dict(d, faults=frozenset(d["faults"]), sabotage=frozenset(d["sabotage"])))


FIELDS: Final = [f for f in dataclasses.fields(StressOptions) if "help" in f.metadata]


def _add(p: Any, f: dataclasses.Field[Any]) -> None:
    """One flag for one field: its help with its default, its parser."""
    default: Any = f.default
    help_, parse = f.metadata["help"], f.metadata["parse"]
    meta = {k: v for k, v in f.metadata.items() if k not in ("help", "parse", "flag", *BOUNDS)}
    flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
    if isinstance(default, bool):
        p.add_argument(flag, dest=f.name, action=f"store_{not default}".lower(), help=help_)
        return
    if default is not None and f.name not in ("duration", "seed"):  # worked out after parsing
        shown = fmt_bytes(default).replace(" ", "") if parse is parse_size else default
        help_, meta["default"] = f"{help_} (default {shown})", default
    meta.setdefault("metavar", {parse_size: "SIZE", parse_duration: "TIME"}.get(parse))
    kind = parse or (str if default is None else type(default))
    p.add_argument(flag, dest=f.name, type=kind, help=help_, **meta)


def parse_args(argv: list[str]) -> StressOptions:
    """The options of ``python -m aioshmcache stress ARGV`` (argparse exits on bad usage)."""
    p = argparse.ArgumentParser(
        prog="python -m aioshmcache stress",
        description="Async stress and fault-injection harness (exit 0: clean, 1: violations).",
    )
    until = p.add_mutually_exclusive_group()
    for f in FIELDS:
        _add(until if f.name in ("duration", "ops") else p, f)
    names = ", ".join(FAULTS)
    p.add_argument("--faults", default="none", help=f"comma list of {names}; all; none (default)")
    p.add_argument("--sabotage", default="", help=argparse.SUPPRESS)  # harness self-test
    ns = p.parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in FIELDS}
    asked = {s.strip() for s in ns.faults.lower().split(",")} - {"", "none"}
    faults = set(FAULTS) if asked == {"all"} else asked
    if unknown := faults - set(FAULTS):
        p.error(f"unknown fault {min(unknown)!r}; choose from {names}")
    sabotage = frozenset(s for s in ns.sabotage.split(",") if s)
    if not sabotage <= SABOTAGES:
        p.error("--sabotage takes digest,drop")
    if ns.duration is None:
        values["duration"] = None if ns.ops else StressOptions.duration
    if ns.seed is None:
        values["seed"] = secrets.randbits(32)
    for f in FIELDS:
        for key, (op, fine) in BOUNDS.items():
            v = values[f.name]
            if key in f.metadata and v is not None and not fine(v, bound := f.metadata[key]):
                p.error(f"--{f.name.replace('_', '-')} must be {op} {bound}")
    opts = StressOptions(**values, faults=frozenset(faults), sabotage=sabotage)
    if opts.min_item > opts.max_item:
        p.error("need --min-item <= --max-item")
    try:
        CacheConfig(opts.capacity, opts.max_object, opts.readers)
    except ValueError as exc:
        p.error(f"cache configuration: {exc}")
    return opts

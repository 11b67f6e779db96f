"""The harness's options: what a run is parametrised by, and the command line that sets it.

Each field of :class:`StressOptions` carries its flag's help (and parser, where it is not the
field's own type) in its metadata; :func:`parse_args` builds the argparse parser from the fields,
so a new option is one field.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
from collections.abc import Callable
from typing import Any, Final, cast

from aioshmcache import CacheConfig

from ..units import fmt_bytes, parse_duration, parse_size

__all__ = ["FAULTS", "GROUP_DISABLED", "StressOptions", "parse_args"]

FAULTS: Final = (
    "kill-readers",
    "stop-readers",
    "cancel",
    "kill-writer",
    "forge",
    "fork",
    "sweep-restart",
    "close-read",
)
#: faults that cannot work with ``--group`` (none so far: every fault applies per shard)
GROUP_DISABLED: Final[frozenset[str]] = frozenset()


def _opt(default: Any, help: str, parse: Callable[[str], Any] | None = None, **kw: Any) -> Any:
    """A field that is also a command-line flag (``--field-name``), with its help text."""
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse, **kw})


@dataclasses.dataclass
class StressOptions:
    """Everything a run is parametrised by (the parent passes what children need as JSON)."""

    duration: float | None = _opt(30.0, "run time, e.g. 60s, 2h (default 30s)", parse_duration)
    ops: int | None = _opt(None, "stop after this many writer requests", int)
    readers: int = _opt(3, "reader processes")
    writers: int = _opt(4, "concurrent writer tasks")
    group: int = _opt(
        0,
        "run N writer processes, each the writer of its own shard of one cache group; readers "
        "attach to the group (attach_group) and writers share the hash space, so sibling hits "
        "happen. Faults apply per shard: kill-writer and fork kill one of the N writers (its "
        "shard is reclaimed by the replacement, readers get WriterGoneError for its "
        "references), alternate delivery rotates one writer at half time (0: one plain cache)",
        metavar="N",
    )
    reader_concurrency: int = _opt(2, "concurrent reads per reader")
    delivery: str = _opt(
        "alternate",
        "alternate: each writer generation switches mode",
        choices=("broadcast", "one_of_n", "alternate"),
    )
    faults: frozenset[str] = frozenset()  # --faults LIST and one --FAULT flag each
    capacity: int = _opt(96 << 20, "ring capacity", parse_size)
    max_object: int = _opt(33 << 20, "max object", parse_size)
    min_item: int = _opt(1 << 10, "smallest item", parse_size)
    max_item: int = _opt(32 << 20, "largest item", parse_size)
    oversize_fraction: float = 0.003
    universe: int = _opt(2000, "distinct hashes")
    zipf: float = _opt(1.1, "Zipf exponent of hash repeats")
    window: int = _opt(16, "requests in flight")
    evict_after: float = _opt(
        1.5, "evict_stuck_readers_after when stop-readers is on (s; 0: never)"
    )
    handout_ttl: float = _opt(3.0, "one-of-N handout_ttl (s)")
    wait_for_space: float = _opt(
        0.2, "largest wait_for_space a writer task passes (s; 0: never wait)"
    )
    second_chance: bool = _opt(
        True,
        "CacheConfig(second_chance=False): evict in pure FIFO order (default: hit items are "
        "moved to the ring's tail instead of evicted)",
        flag="--no-second-chance",
    )
    op_deadline: float = _opt(10.0, "per-operation deadline (s)")
    hang_timeout: float = _opt(15.0, "silent child = hang (s)")
    max_loop_lag: float = _opt(5.0, "writer loop lag bound (s)")
    reader_kill_every: float = _opt(4.0, "kill-readers fault period", parse_duration)
    reader_stop_every: float = _opt(5.0, "stop-readers fault period", parse_duration)
    writer_kill_every: float = _opt(15.0, "kill-writer fault period", parse_duration)
    fork_every: float = _opt(
        8.0, "fork fault: the writer or a reader, in turn, forks and is SIGKILLed", parse_duration
    )
    fork_linger: float = _opt(
        8.0, "how long the forked child outlives its killed parent", parse_duration
    )
    sweep_restart_every: float = _opt(
        6.0,
        "sweep-restart fault: a burst of writers that crash and restart under one name while "
        "another process sweeps it; each must keep its segment",
        parse_duration,
    )
    cancel_prob: float = _opt(0.1, "share of cancelled operations")
    close_read_prob: float = _opt(
        0.02,
        "close-read fault: share of requests during which the reader closes its cache (then "
        "attaches again)",
    )
    probe_rate: float = _opt(20.0, "forged/stale probes per second")
    seed: int = _opt(0, "random seed (default: random)", int)
    loop: str = _opt("asyncio", "event loop of the children", choices=("asyncio", "uvloop"))
    json_path: str | None = _opt(None, "write the final statistics here as JSON", flag="--json")
    quiet: bool = _opt(False, "no progress line")
    keep_logs: bool = _opt(False, "keep the children's logs")
    private_shm: int = _opt(
        0,
        "run in a private /dev/shm of this size (unshare -m; needs root): other processes' "
        "sweeps and cleanups cannot touch our segments",
        parse_size,
        metavar="SIZE",
    )
    switch_interval: float = _opt(
        0.0001,
        "sys.setswitchinterval in the children: more thread interleaving (s; 0: Python's default)",
    )
    sabotage: frozenset[str] = frozenset()  # the harness's self-test (a hidden flag)

    def child_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["faults"] = sorted(self.faults)
        d["sabotage"] = sorted(self.sabotage)
        return d

    @classmethod
    def from_child_dict(cls, d: dict[str, Any]) -> StressOptions:
        d = dict(d)
        d["faults"] = frozenset(d["faults"])
        d["sabotage"] = frozenset(d["sabotage"])
        return cls(**d)


def _add_field(p: argparse.ArgumentParser | Any, f: dataclasses.Field[Any]) -> None:
    """One flag for one field: its help, its default shown, its parser."""
    meta, default = dict(f.metadata), cast(Any, f.default)
    help_, parse, flag = meta.pop("help"), meta.pop("parse"), meta.pop("flag", None)
    flag = flag or "--" + f.name.replace("_", "-")
    if isinstance(default, bool):
        action = "store_false" if default else "store_true"
        p.add_argument(flag, dest=f.name, action=action, help=help_)
        return
    if f.name in ("duration", "ops", "seed"):  # their defaults are worked out after parsing
        p.add_argument(flag, dest=f.name, type=parse, help=help_, **meta)
        return
    if parse is parse_size:
        shown = fmt_bytes(default).replace(" ", "")
    else:
        shown = f"{default:g}" if isinstance(default, int | float) else str(default)
    p.add_argument(
        flag,
        dest=f.name,
        type=parse or (str if f.default is None else type(f.default)),
        default=f.default,
        help=f"{help_} (default {shown})",
        **meta,
    )


def _faults(p: argparse.ArgumentParser, ns: argparse.Namespace) -> frozenset[str]:
    faults: set[str] = set()
    spec = ns.faults.strip().lower()
    if spec == "all":
        faults.update(FAULTS)
    elif spec not in ("", "none"):
        for f in spec.split(","):
            if f.strip() not in FAULTS:
                p.error(f"unknown fault {f.strip()!r}; choose from {', '.join(FAULTS)}")
            faults.add(f.strip())
    faults |= {f for f in FAULTS if getattr(ns, "fault_" + f.replace("-", "_"))}
    return frozenset(faults - GROUP_DISABLED if ns.group else faults)


def parse_args(argv: list[str]) -> StressOptions:
    """The options of ``python -m aioshmcache stress ARGV`` (argparse exits on bad usage)."""
    p = argparse.ArgumentParser(
        prog="python -m aioshmcache stress",
        description="Async stress and fault-injection harness (exit 0: clean, 1: violations).",
    )
    until = p.add_mutually_exclusive_group()
    for field in dataclasses.fields(StressOptions):
        if "help" in field.metadata:
            _add_field(until if field.name in ("duration", "ops") else p, field)
    p.add_argument(
        "--faults",
        default="none",
        help=f"comma list of {', '.join(FAULTS)}; or 'all' / 'none' (default none)",
    )
    for f in FAULTS:
        p.add_argument(
            f"--{f}",
            dest="fault_" + f.replace("-", "_"),
            action="store_true",
            help=f"the {f} fault",
        )
    p.add_argument("--sabotage", default="", help=argparse.SUPPRESS)  # harness self-test
    ns = p.parse_args(argv)

    values = {
        f.name: getattr(ns, f.name)
        for f in dataclasses.fields(StressOptions)
        if "help" in f.metadata
    }
    if ns.duration is None:
        values["duration"] = None if ns.ops else StressOptions.duration
    if ns.seed is None:
        values["seed"] = secrets.randbits(32)
    sabotage = frozenset(s for s in ns.sabotage.split(",") if s)
    if not sabotage <= {"digest", "drop"}:
        p.error("--sabotage takes digest,drop")
    opts = StressOptions(**values, faults=_faults(p, ns), sabotage=sabotage)
    checks = [
        (1 <= opts.readers <= 64, "--readers must be in 1..64"),
        (opts.writers >= 1, "--writers must be >= 1"),
        (0 <= opts.group <= 16, "--group must be in 0..16"),
        (opts.reader_concurrency >= 1, "--reader-concurrency must be >= 1"),
        (opts.ops is None or opts.ops >= 1, "--ops must be >= 1"),
        (opts.window >= 1, "--window must be >= 1"),
        (opts.universe >= 1, "--universe must be >= 1"),
        (opts.zipf > 0, "--zipf must be > 0"),
        (1024 <= opts.min_item <= opts.max_item, "need 1KiB <= --min-item <= --max-item"),
        (opts.handout_ttl > 0, "--handout-ttl must be > 0"),
        (opts.op_deadline > 0 and opts.hang_timeout > 0, "deadlines must be > 0"),
        (0 <= opts.cancel_prob <= 1, "--cancel-prob must be in [0, 1]"),
        (0 <= opts.close_read_prob <= 1, "--close-read-prob must be in [0, 1]"),
        (opts.wait_for_space >= 0 and opts.evict_after >= 0, "negative seconds"),
    ]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    try:
        CacheConfig(opts.capacity, opts.max_object, opts.readers)
    except ValueError as exc:
        p.error(f"cache configuration: {exc}")
    return opts


def handout_ttl(opts: StressOptions, delivery: str) -> float:
    """The ``handout_ttl`` a writer generation uses.

    A hand-out the harness never delivers (a reader that attached just before it was connected,
    a request in flight to a reader being replaced) is a *lost* hand-out: in broadcast mode it
    lapses ``handout_ttl`` after it was made once its reader acknowledged a later one, so the
    drain check waits that long. The ``drop`` self-test sabotage drops hand-outs on purpose and
    must be seen as the leak it is: its broadcast generations keep hand-outs for 10 minutes.
    """
    if delivery != "one_of_n" and "drop" in opts.sabotage:
        return 600.0
    return opts.handout_ttl

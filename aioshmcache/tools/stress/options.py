"""The harness's options: what a run is parametrised by, and the command line that sets it."""

from __future__ import annotations

import argparse
import dataclasses
import secrets
from typing import Any, Final

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


@dataclasses.dataclass
class StressOptions:
    """Everything a run is parametrised by (the parent passes what children need as JSON)."""

    duration: float | None = 30.0
    ops: int | None = None
    readers: int = 3
    writers: int = 4
    group: int = 0
    reader_concurrency: int = 2
    delivery: str = "alternate"
    faults: frozenset[str] = frozenset()
    capacity: int = 96 << 20
    max_object: int = 33 << 20
    min_item: int = 1 << 10
    max_item: int = 32 << 20
    oversize_fraction: float = 0.003
    universe: int = 2000
    zipf: float = 1.1
    window: int = 16
    evict_after: float = 1.5
    handout_ttl: float = 3.0
    wait_for_space: float = 0.2
    second_chance: bool = True
    op_deadline: float = 10.0
    hang_timeout: float = 15.0
    max_loop_lag: float = 5.0
    reader_kill_every: float = 4.0
    reader_stop_every: float = 5.0
    writer_kill_every: float = 15.0
    fork_every: float = 8.0
    fork_linger: float = 8.0
    sweep_restart_every: float = 6.0
    cancel_prob: float = 0.1
    close_read_prob: float = 0.02
    probe_rate: float = 20.0
    seed: int = 0
    loop: str = "asyncio"
    json_path: str | None = None
    quiet: bool = False
    keep_logs: bool = False
    private_shm: int = 0
    switch_interval: float = 0.0001
    sabotage: frozenset[str] = frozenset()

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


def parse_args(argv: list[str]) -> StressOptions:
    """The options of ``python -m aioshmcache stress ARGV`` (argparse exits on bad usage)."""
    p = argparse.ArgumentParser(
        prog="python -m aioshmcache stress",
        description="Async stress and fault-injection harness (exit 0: clean, 1: violations).",
    )
    d = StressOptions()  # the defaults live in the dataclass only

    def size(n: int) -> str:
        return fmt_bytes(n).replace(" ", "")

    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--duration", type=parse_duration, help=f"run time, e.g. 60s, 2h (default {d.duration:g}s)"
    )
    g.add_argument("--ops", type=int, help="stop after this many writer requests")
    p.add_argument("--readers", type=int, default=d.readers, help="reader processes (%(default)s)")
    p.add_argument(
        "--writers", type=int, default=d.writers, help="concurrent writer tasks (%(default)s)"
    )
    p.add_argument(
        "--group",
        type=int,
        default=d.group,
        metavar="N",
        help="run N writer processes, each the writer of its own shard of one cache group; "
        "readers attach to the group (attach_group) and writers share the hash space, so "
        "sibling hits happen. Faults apply per shard: kill-writer and fork kill one of the N "
        "writers (its shard is reclaimed by the replacement, readers get WriterGoneError for its "
        "references), alternate delivery rotates one writer at half time (default 0: one "
        "plain cache)",
    )
    p.add_argument(
        "--reader-concurrency",
        type=int,
        default=d.reader_concurrency,
        help="concurrent reads per reader (%(default)s)",
    )
    p.add_argument(
        "--delivery",
        choices=("broadcast", "one_of_n", "alternate"),
        default=d.delivery,
        help="alternate: each writer generation switches mode (%(default)s)",
    )
    p.add_argument(
        "--faults",
        default="none",
        help=f"comma list of {', '.join(FAULTS)}; or 'all' / 'none' (default none)",
    )
    for f in FAULTS:
        p.add_argument(f"--{f}", action="store_true", help=f"enable the {f} fault")
    sizes = (
        ("--capacity", d.capacity, "ring capacity"),
        ("--max-object", d.max_object, "max object"),
        ("--min-item", d.min_item, "smallest item"),
        ("--max-item", d.max_item, "largest item"),
    )
    for flag, default, what in sizes:
        p.add_argument(flag, type=parse_size, default=default, help=f"{what} ({size(default)})")
    p.add_argument("--universe", type=int, default=d.universe, help="distinct hashes (%(default)s)")
    p.add_argument(
        "--zipf", type=float, default=d.zipf, help="Zipf exponent of hash repeats (%(default)s)"
    )
    p.add_argument("--window", type=int, default=d.window, help="requests in flight (%(default)s)")
    p.add_argument(
        "--evict-after",
        type=float,
        default=d.evict_after,
        help="evict_stuck_readers_after when stop-readers is on (%(default)s s; 0: never)",
    )
    p.add_argument(
        "--handout-ttl",
        type=float,
        default=d.handout_ttl,
        help="one-of-N handout_ttl (%(default)s s)",
    )
    p.add_argument(
        "--wait-for-space",
        type=float,
        default=d.wait_for_space,
        help="largest wait_for_space a writer task passes (%(default)s s; 0: never wait)",
    )
    p.add_argument(
        "--no-second-chance",
        dest="second_chance",
        action="store_false",
        help="CacheConfig(second_chance=False): evict in pure FIFO order (default: hit items "
        "are moved to the ring's tail instead of evicted)",
    )
    seconds = (
        ("--op-deadline", d.op_deadline, "per-operation deadline"),
        ("--hang-timeout", d.hang_timeout, "silent child = hang"),
        ("--max-loop-lag", d.max_loop_lag, "writer loop lag bound"),
    )
    for flag, secs, what in seconds:
        p.add_argument(flag, type=float, default=secs, help=f"{what} (%(default)s s)")
    p.add_argument("--reader-kill-every", type=parse_duration, default=d.reader_kill_every)
    p.add_argument("--reader-stop-every", type=parse_duration, default=d.reader_stop_every)
    p.add_argument("--writer-kill-every", type=parse_duration, default=d.writer_kill_every)
    p.add_argument(
        "--fork-every",
        type=parse_duration,
        default=d.fork_every,
        help="fork fault: the writer or a reader, in turn, forks and is SIGKILLed (%(default)s s)",
    )
    p.add_argument(
        "--fork-linger",
        type=parse_duration,
        default=d.fork_linger,
        help="how long the forked child outlives its killed parent (%(default)s s)",
    )
    p.add_argument(
        "--sweep-restart-every",
        type=parse_duration,
        default=d.sweep_restart_every,
        help="sweep-restart fault: a burst of writers that crash and restart under one name "
        "while another process sweeps it; each must keep its segment (%(default)s s)",
    )
    p.add_argument(
        "--cancel-prob",
        type=float,
        default=d.cancel_prob,
        help="share of cancelled operations (%(default)s)",
    )
    p.add_argument(
        "--close-read-prob",
        type=float,
        default=d.close_read_prob,
        help="close-read fault: share of requests during which the reader closes its cache "
        "(then attaches again) (%(default)s)",
    )
    p.add_argument(
        "--probe-rate",
        type=float,
        default=d.probe_rate,
        help="forged/stale probes per second (%(default)s)",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=d.switch_interval,
        help="sys.setswitchinterval in the children: more thread interleaving "
        "(%(default)s s; 0: Python's default)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default=d.loop)
    p.add_argument("--json", dest="json_path", help="write the final statistics here as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--keep-logs", action="store_true", help="keep the children's logs")
    p.add_argument(
        "--private-shm",
        type=parse_size,
        default=0,
        metavar="SIZE",
        help="run in a private /dev/shm of this size (unshare -m; needs root): other "
        "processes' sweeps and cleanups cannot touch our segments",
    )
    p.add_argument("--sabotage", default="", help=argparse.SUPPRESS)  # harness self-test
    ns = p.parse_args(argv)

    faults: set[str] = set()
    spec = ns.faults.strip().lower()
    if spec == "all":
        faults.update(FAULTS)
    elif spec not in ("", "none"):
        for f in spec.split(","):
            f = f.strip()
            if f not in FAULTS:
                p.error(f"unknown fault {f!r}; choose from {', '.join(FAULTS)}")
            faults.add(f)
    for f in FAULTS:
        if getattr(ns, f.replace("-", "_")):
            faults.add(f)
    if ns.group:
        faults -= GROUP_DISABLED
    sabotage = frozenset(s for s in ns.sabotage.split(",") if s)
    if not sabotage <= {"digest", "drop"}:
        p.error("--sabotage takes digest,drop")
    duration = ns.duration if ns.duration is not None else (None if ns.ops else d.duration)
    opts = StressOptions(
        duration=duration,
        ops=ns.ops,
        readers=ns.readers,
        writers=ns.writers,
        group=ns.group,
        reader_concurrency=ns.reader_concurrency,
        delivery=ns.delivery,
        faults=frozenset(faults),
        capacity=ns.capacity,
        max_object=ns.max_object,
        min_item=ns.min_item,
        max_item=ns.max_item,
        universe=ns.universe,
        zipf=ns.zipf,
        window=ns.window,
        evict_after=ns.evict_after,
        handout_ttl=ns.handout_ttl,
        wait_for_space=ns.wait_for_space,
        second_chance=ns.second_chance,
        op_deadline=ns.op_deadline,
        hang_timeout=ns.hang_timeout,
        max_loop_lag=ns.max_loop_lag,
        reader_kill_every=ns.reader_kill_every,
        reader_stop_every=ns.reader_stop_every,
        writer_kill_every=ns.writer_kill_every,
        fork_every=ns.fork_every,
        fork_linger=ns.fork_linger,
        sweep_restart_every=ns.sweep_restart_every,
        cancel_prob=ns.cancel_prob,
        close_read_prob=ns.close_read_prob,
        probe_rate=ns.probe_rate,
        seed=ns.seed if ns.seed is not None else secrets.randbits(32),
        loop=ns.loop,
        json_path=ns.json_path,
        quiet=ns.quiet,
        keep_logs=ns.keep_logs,
        private_shm=ns.private_shm,
        switch_interval=ns.switch_interval,
        sabotage=sabotage,
    )
    checks = [
        (opts.readers >= 1, "--readers must be >= 1"),
        (opts.readers <= 64, "--readers must be <= 64"),
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

"""The stress and fault-injection harness (``python -m aioshmcache stress``).

Quick tests check the harness itself: its parsers and workload, a short clean run, and that it
does catch what it is meant to catch (wrong data, a leaked acknowledgement). The ``stress``-marked
test is the CI run with every fault on; its length comes from ``AIOSHM_STRESS_DURATION``
(default ``60s``). Runs use a private /dev/shm when the machine allows it (root and
``unshare``), so that other processes' cleanups of /dev/shm cannot disturb them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest

from aioshmcache.tools.stress import (
    FAULTS,
    StressOptions,
    Workload,
    item_size,
    main,
    verify_item,
)
from aioshmcache.tools.stress.child import SABOTAGE_GRACE, SABOTAGE_MIN_SEEN
from aioshmcache.tools.stress.options import parse_args
from aioshmcache.tools.stress.parent import Orchestrator
from aioshmcache.tools.stress.report import Tally, summary
from aioshmcache.tools.units import parse_duration, parse_size


@functools.cache
def _private_shm_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return False
    probe = "mount -t tmpfs -o size=1m tmpfs /dev/shm"
    try:
        done = subprocess.run(
            [unshare, "-m", "--propagation", "private", "sh", "-c", probe],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def run_stress(tmp_path: pathlib.Path, *args: str, limit: float) -> tuple[int, str, dict[str, Any]]:
    """Run the harness in a subprocess; returns (exit status, its output, the JSON report)."""
    report = tmp_path / "stress.json"
    cmd = [sys.executable, "-m", "aioshmcache", "stress", "--quiet", "--json", str(report)]
    if _private_shm_works():
        cmd += ["--private-shm", "1GiB"]
    env = dict(os.environ, TMPDIR=str(tmp_path))  # children's logs of a failed run land here
    done = subprocess.run(
        [*cmd, *args],
        capture_output=True,
        text=True,
        timeout=limit,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    output = done.stdout + done.stderr
    data: dict[str, Any] = json.loads(report.read_text()) if report.exists() else {}
    return done.returncode, output, data


# --- the harness's own pieces -----------------------------------------------------------------
def test_parse_duration() -> None:
    assert parse_duration("60s") == 60
    assert parse_duration("2h") == 7200
    assert parse_duration("1m30s") == 90
    assert parse_duration("500ms") == 0.5
    assert parse_duration("90") == 90
    for bad in ("", "abc", "10x", "-5s", "0s"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_parse_size() -> None:
    assert parse_size("1KiB") == 1024
    assert parse_size("32MiB") == 32 << 20
    assert parse_size("96M") == 96 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("lots")


def test_item_sizes_are_heavy_tailed() -> None:
    sizes = np.array([item_size(7, k, 1 << 10, 32 << 20) for k in range(20000)])
    assert sizes.min() >= 1 << 10 and sizes.max() <= 32 << 20
    assert np.median(sizes) < 16 << 10  # mostly small
    assert (sizes > 16 << 20).mean() > 0.005  # but a real tail of large items
    assert sizes.mean() > 256 << 10


def test_workload_items_verify_and_corruption_is_caught() -> None:
    opts = StressOptions(seed=3, max_item=4 << 20, max_object=5 << 20, capacity=16 << 20)
    work = Workload(opts)
    k = next(k for k in range(100) if work.nbytes(k) > 64 << 10)
    item, digest, n = work.item(k)
    copy = {f: (v.copy() if isinstance(v, np.ndarray) else v) for f, v in item.items()}
    assert verify_item(copy, work.name(k), digest, n) is None
    again, digest2, _ = Workload(opts).item(k)  # another process builds the same bytes
    assert digest2 == digest and np.array_equal(again["grid"], item["grid"])
    torn = dict(copy, pixel_values=copy["pixel_values"].copy())
    torn["pixel_values"].view(np.uint8).reshape(-1)[12345 % torn["pixel_values"].nbytes] ^= 1
    err = verify_item(torn, work.name(k), digest, n)
    assert err is not None and "checksum" in err
    err = verify_item(copy, work.name(k + 1), digest, n)
    assert err is not None and "another hash" in err
    assert verify_item({"x": 1}, work.name(k), digest, n) is not None


def test_zipf_repeats_hashes() -> None:
    import random

    work = Workload(StressOptions(seed=1, universe=2000, max_item=1 << 20, max_object=2 << 20))
    rng = random.Random(0)
    draws = [work.sample(rng) for _ in range(5000)]
    assert all(0 <= k < 2000 for k in draws)
    assert len(set(draws)) < 2500 / 2  # heavy repetition


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--readers", "0"]) == 2
    assert main(["--faults", "meteor"]) == 2
    assert "unknown fault 'meteor'" in capsys.readouterr().err
    assert main(["--capacity", "1MiB", "--max-object", "2MiB"]) == 2
    assert set(FAULTS) == {
        "kill-readers",
        "stop-readers",
        "cancel",
        "kill-writer",
        "close-read",
    }
    assert parse_args(["--faults", "all"]).faults == frozenset(FAULTS)
    assert parse_args(["--faults", "cancel, Kill-Writer,close-read"]).faults == {
        "cancel",
        "kill-writer",
        "close-read",
    }
    for flag, value, bound in [
        ("--zipf", "0", "> 0"),
        ("--cancel-prob", "1.5", "<= 1"),
        ("--min-item", "512", ">= 1024"),
        ("--group", "17", "<= 16"),
    ]:
        assert main([flag, value]) == 2
        assert f"{flag} must be {bound}" in capsys.readouterr().err


def test_the_command_line_is_generated_from_the_options() -> None:
    """Every option field is a flag whose default is the field's own (duration and seed are
    worked out after parsing); sizes and durations take units."""
    assert parse_args(["--seed", "5"]) == dataclasses.replace(StressOptions(), seed=5)
    got = parse_args(
        ["--seed", "1", "--ops", "9", "--capacity", "64MiB", "--reader-stop-every", "2m"]
    )
    assert (got.duration, got.ops, got.capacity, got.reader_stop_every) == (None, 9, 64 << 20, 120)
    assert not parse_args(["--no-second-chance"]).second_chance
    got = parse_args(["--json", "out.json", "--group", "2", "--zipf", "1.5", "--loop", "uvloop"])
    assert (got.json_path, got.group, got.zipf, got.loop) == ("out.json", 2, 1.5, "uvloop")


def test_the_report_renders_any_tally() -> None:
    """The table shows what was counted, with no error rows at all too, and the verdict."""
    tally = Tally()
    tally.stats.update(requests=10, items_verified=7)
    text = summary(StressOptions(seed=1, faults=frozenset(FAULTS)), tally, 2.0, 1, False)
    assert "writer requests" in text and "closed under / beside a read" in text
    assert text.endswith("RESULT: OK")
    tally.violations.add("reader r1", "WRONG DATA: h000001: checksum")
    tally.errors["WriterGoneError (switch)"] += 1
    text = summary(StressOptions(seed=1), tally, 2.0, 1, True)
    assert "error WriterGoneError (switch)" in text and "1 x WRONG DATA" in text
    assert text.endswith("RESULT: INTERRUPTED (FAIL so far)")


def test_the_parent_reads_who_saw_a_writer_gone_from_the_error_counters() -> None:
    """Readers report errors as ``"Kind (where)": n`` counters; the parent takes the writer
    generations seen gone from them (the end check flags a WriterGoneError of a live one)."""
    orch = Orchestrator(StressOptions(seed=1))
    reader: Any = types.SimpleNamespace(token="r1")  # the sender of the counters
    try:
        orch.on_count(reader, {"gen": 3, "e": {"WriterGoneError (switch)": 1}}, b"")
        orch.on_count(reader, {"gen": 4, "e": {"reattach (revoked)": 1}, "text": "x"}, b"")
        orch.on_done(reader, {"gen": 5, "rid": 1, "e": {"WriterGoneError": 1}, "c": {}}, b"")
        stale = {"CacheMissError (stale genuine refs)": 2}
        orch.on_done(reader, {"gen": 6, "rid": 2, "e": stale, "c": {"reads": 1}}, b"")
        assert orch.tally.wgone_gens == {3, 5}
        assert orch.tally.errors["WriterGoneError (switch)"] == 1
        assert orch.tally.errors["CacheMissError (stale genuine refs)"] == 2
        assert orch.tally.err_texts == {"reattach (revoked)": "x"}
        assert orch.tally.stats["reads"] == 1
    finally:
        shutil.rmtree(orch.tmp)


# --- short runs -------------------------------------------------------------------------------
@pytest.mark.stress
def test_quick_run_without_faults(tmp_path: pathlib.Path) -> None:
    """5 s, both delivery modes (a mid-run writer rotation), no faults: clean and drained."""
    rc, out, data = run_stress(tmp_path, "--duration", "5s", "--readers", "2", limit=600)
    assert rc == 0, out[-6000:]
    assert "RESULT: OK" in out and "writer requests" in out
    st = data["stats"]
    assert st["items_verified"] > 0 and st["bytes_verified"] > 0
    assert st.get("writer_gens_broadcast") == 1 and st.get("writer_gens_one_of_n") == 1
    assert [f["why"] for f in data["finals"]] == ["rotation", "end of run"]
    assert all(f["n_not_freeable"] == 0 and f["after_items"] == 0 for f in data["finals"])
    assert data["violation_count"] == 0


@pytest.mark.stress
def test_harness_catches_wrong_data_and_leaks(tmp_path: pathlib.Path) -> None:
    """Self-test: a writer that lies about digests and a reader that drops requests must fail.

    The sabotage is count-based and the run goes on past ``--duration`` until each kind was seen
    (a loaded machine may fit few requests in 4 s): the outcome does not depend on the load.
    """
    rc, out, data = run_stress(
        tmp_path,
        "--duration",
        "4s",
        "--readers",
        "2",
        "--delivery",
        "broadcast",
        "--sabotage",
        "digest,drop",
        limit=SABOTAGE_GRACE + 240,
    )
    assert rc == 1, out[-6000:]
    st = data["stats"]
    assert st["items_wrong"] >= SABOTAGE_MIN_SEEN, out[-6000:]
    assert st["sabotage_dropped"] >= SABOTAGE_MIN_SEEN, out[-6000:]
    # every wrong read is a lie the writer told (each read by at most both readers): none invented
    assert 2 * data["writer"]["sabotaged"] >= st["items_wrong"]
    text = "\n".join(data["violations"])
    assert "WRONG DATA" in text
    assert "cache does not drain" in text
    assert "RESULT: FAIL" in out


# --- the CI stress run --------------------------------------------------------------------------
@pytest.mark.stress
def test_stress_all_faults(tmp_path: pathlib.Path) -> None:
    """Every fault on, both delivery modes: no violation, and every fault really happened."""
    duration = parse_duration(os.environ.get("AIOSHM_STRESS_DURATION", "60s"))
    rc, out, data = run_stress(
        tmp_path, "--duration", f"{duration}s", "--faults", "all", limit=duration + 240
    )
    assert rc == 0, "\n".join(data.get("violations", ["(no report)"])) + "\n\n" + out[-8000:]
    st = data["stats"]
    assert st["items_verified"] > 0
    assert st.get("reader_kills", 0) > 0
    assert st.get("reader_stops", 0) > 0
    assert st.get("writer_gens_broadcast", 0) >= 1 and st.get("writer_gens_one_of_n", 0) >= 1
    if duration >= 30:
        assert st.get("writer_kills", 0) > 0  # and readers saw WriterGoneError in time
    assert all(f["n_not_freeable"] == 0 for f in data["finals"])
    # cancel: calls cancelled mid-way on both sides (a raw Task.cancel or an anyio scope)
    writer = data["writer"]
    assert writer.get("cancelled_task", 0) + writer.get("cancelled_scope", 0) > 0
    assert st.get("read_cancelled_task", 0) + st.get("read_cancelled_scope", 0) > 0
    # close-read: readers closed their cache under a running read, and saw typed errors only
    assert st.get("read_closed_during_read", 0) + st.get("closed_read_ok", 0) > 0


@pytest.mark.stress
@pytest.mark.parametrize("group", ["0", "2"])
def test_stress_close_during_read(tmp_path: pathlib.Path, group: str) -> None:
    """The ``close-read`` fault alone: a reader's cache (or group reader) closed under a read.

    Every read ends with verified bytes or a typed error (an untyped one is a violation), the
    reader attaches again, and every shard still drains.
    """
    assert "close-read" in FAULTS
    rc, out, data = run_stress(
        tmp_path,
        "--duration",
        "6s",
        "--readers",
        "2",
        "--reader-concurrency",
        "3",
        "--group",
        group,
        "--faults",
        "close-read",
        "--close-read-prob",
        "0.3",
        limit=600,
    )
    assert rc == 0, "\n".join(data.get("violations", ["(no report)"])) + "\n\n" + out[-8000:]
    st = data["stats"]
    assert data["violation_count"] == 0
    assert st.get("read_closed_during_read", 0) + st.get("closed_read_ok", 0) > 0, out[-4000:]
    assert data["errors"].get("reattach (close-read)", 0) > 0
    assert all(f["n_not_freeable"] == 0 and f["after_items"] == 0 for f in data["finals"])


@pytest.mark.stress
def test_stress_group_with_faults(tmp_path: pathlib.Path) -> None:
    """``--group 3``: three writer processes, one shard each; readers attach to the group.

    Writers share the hash space, so items are copied from sibling shards; a killed writer's
    shard is reclaimed by its replacement; every read is verified and each shard drains.
    """
    rc, out, data = run_stress(
        tmp_path,
        "--group",
        "3",
        "--duration",
        "30s",  # long enough for a writer kill even on a loaded machine (15 s was not)
        "--faults",
        "all",
        "--writer-kill-every",
        "3s",
        limit=600,
    )
    assert rc == 0, "\n".join(data.get("violations", ["(no report)"])) + "\n\n" + out[-8000:]
    st = data["stats"]
    assert data["violation_count"] == 0
    assert st["items_verified"] > 0
    assert data["writer"].get("sibling_hits", 0) > 0, out[-4000:]
    assert st.get("writer_kills", 0) > 0
    assert st.get("shards_reclaimed", 0) > 0
    assert "sibling hits" in out
    # the drain check ran on every shard at the end
    assert sum(f["why"].startswith("end of run") for f in data["finals"]) == 3
    assert all(f["n_not_freeable"] == 0 for f in data["finals"])

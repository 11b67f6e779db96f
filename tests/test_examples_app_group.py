"""examples/fastapi_app.py as a cache group under a real ``uvicorn --workers 2`` (spawned workers).

One engine worker process attached to the whole group (started here, as the example's docstring
says: ``python examples/fastapi_app.py --engine``), two gateway processes each writing its own
shard. Requests on short connections land on both processes; an image preprocessed by one is not
preprocessed again by the other (its ``get_or_put`` copies it from the sibling shard), every
checksum the engine worker answers is the one computed here, and after shutdown nothing of the
group is left in /dev/shm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import RUN_PREFIX, SHM
from .helpers import gone, wait_until
from .test_examples_app import (
    EXAMPLES,
    ROOT,
    _body,
    _expected_crc,
    _free_port,
    _image,
)

N_IMAGES = 12
MAX_TRIES = 400  # fresh connections tried to reach a given gateway process


def _ours(group: str) -> list[str]:
    return [n for n in os.listdir(SHM) if group in n]


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    """One request on its own connection, so the kernel may hand it to either process."""
    return httpx.post(url, json=body, headers={"Connection": "close"}, timeout=60.0)


def _get(url: str) -> httpx.Response:
    return httpx.get(url, headers={"Connection": "close"}, timeout=60.0)


def _stop(proc: subprocess.Popen[bytes], sig: int) -> int | None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        return None


@pytest.mark.e2e
def test_fastapi_example_as_a_group_under_uvicorn_workers_2(tmp_path: Path) -> None:
    group = f"{RUN_PREFIX}ga{uuid.uuid4().hex[:8]}"
    sock = str(tmp_path / "engine.sock")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        AIOSHM_GROUP=group,
        AIOSHM_ENGINE_SOCKET=sock,
        AIOSHM_EXAMPLE_CACHE_MB="16",
        AIOSHM_EXAMPLE_MAX_OBJECT_MB="1",
    )
    engine_log, server_log = tmp_path / "engine.log", tmp_path / "uvicorn.log"
    engine_cmd = [sys.executable, str(EXAMPLES / "fastapi_app.py"), "--engine"]
    engine_cmd += ["--group", group, "--socket", sock]
    cmd = [sys.executable, "-m", "uvicorn", "--loop", "uvloop", "--app-dir", str(EXAMPLES)]
    cmd += ["fastapi_app:app", "--host", "127.0.0.1", "--port", str(port), "--workers", "2"]
    cmd += ["--timeout-worker-healthcheck", "60"]  # a loaded host: never replaced mid-test
    with engine_log.open("wb") as out:
        engine = subprocess.Popen(engine_cmd, env=env, cwd=ROOT, stdout=out, stderr=out)
    server: subprocess.Popen[bytes] | None = None
    try:
        assert wait_until(lambda: os.path.exists(sock), timeout=60), engine_log.read_text()
        with server_log.open("wb") as out:
            server = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=out)

        # both gateway processes up: each has opened its own shard and reached the engine
        seen: dict[str, int] = {}
        deadline = time.monotonic() + 120.0
        while len(seen) < 2 and time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"uvicorn exited: {server_log.read_text()[-3000:]}")
            try:
                r = _get(f"{base}/healthz")
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if r.status_code == 200:
                seen[r.json()["segment"]] = r.json()["worker_pid"]
        assert sorted(seen) == [f"aioshm-{group}.shard0", f"aioshm-{group}.shard1"], seen
        assert set(seen.values()) == {engine.pid}  # one engine worker for the whole group

        images = [_image(10 + i, 32 + i, 48) for i in range(N_IMAGES)]
        preprocessed: Counter[str] = Counter()  # segment -> preprocessings it answered
        by_image: list[str] = []  # the segment that put each image
        for img in images:
            r = _post(f"{base}/v1/embed", _body(img, with_pixels=True))
            assert r.status_code == 200, r.text
            ans = r.json()
            assert ans["preprocessed"] and ans["transport"] == "shm"
            assert ans["crc32"] == _expected_crc(img)
            preprocessed[ans["segment"]] += 1
            by_image.append(ans["segment"])
        assert sum(preprocessed.values()) == N_IMAGES

        # every image again, until the OTHER gateway process has answered it: hash only (the
        # group holds it, so no 409) and once with pixels (get_or_put finds it in the sibling)
        cross = 0
        for img, putter in zip(images, by_image):
            for with_pixels in (False, True):
                for _ in range(MAX_TRIES):
                    r = _post(f"{base}/v1/embed", _body(img, with_pixels=with_pixels))
                    assert r.status_code == 200, r.text
                    ans = r.json()
                    assert not ans["preprocessed"], ans  # never again, in either process
                    assert ans["crc32"] == _expected_crc(img)
                    assert ans["transport"] == "shm"
                    if ans["segment"] != putter:
                        cross += 1
                        break
        assert cross == 2 * N_IMAGES, "requests did not reach both gateway processes"

        # the counters of both processes, summed: preprocessings == images, sibling copies seen
        stats: dict[int, dict[str, Any]] = {}
        for _ in range(MAX_TRIES):
            s = _get(f"{base}/stats").json()
            stats[s["cache"]["shard"]] = s
            if len(stats) == 2:
                break
        assert sorted(stats) == [0, 1]
        assert all(s["cache"]["group"] == group for s in stats.values())
        assert sum(s["single_flight"]["runs"] for s in stats.values()) == N_IMAGES
        # each image was copied once into the process that had not put it
        assert sum(s["cache"]["sibling_hits"] for s in stats.values()) == N_IMAGES
        for s in stats.values():
            assert all(r["lag"] == 0 for r in s["cache"]["readers"] if r["attached"])
        text = _get(f"{base}/metrics").text
        assert "aioshmcache_sibling_hits_total{" in text and f'group="{group}"' in text
        assert len(_ours(group)) >= 2

        assert _stop(server, signal.SIGINT) == 0, server_log.read_text()[-3000:]
        assert _stop(engine, signal.SIGTERM) == 0, engine_log.read_text()[-3000:]
        assert _ours(group) == [], "the group left a shard (or a semaphore) behind"
        assert not os.path.exists(sock)
    finally:
        for proc in (server, engine):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)
        assert gone(engine.pid)
        for left in _ours(group):
            os.unlink(os.path.join(SHM, left))

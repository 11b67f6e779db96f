"""examples/fastapi_app.py under a real ``uvicorn --loop uvloop`` with its real worker process.

Hash first (409 for an image the gateway does not hold), preprocessing and the worker's checksum
checked against the same computation done here, a second round served from the cache, an image
too large to cache sent inline over the wire, concurrent requests for one new image preprocessed
once, a claimed hash that does not name the pixels refused (400) and nothing cached, metrics;
then a clean shutdown leaves nothing in /dev/shm and no worker behind.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from aioshmcache import tenant_key

from .conftest import RUN_PREFIX, SHM
from .helpers import gone, wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
import fastapi_app  # noqa: E402  (the example, imported to compute the expected answers)

sys.path.remove(str(EXAMPLES))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _image(seed: int, height: int, width: int) -> tuple[bytes, int, int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8).tobytes(), height, width


def _body(img: tuple[bytes, int, int], *, with_pixels: bool) -> dict[str, Any]:
    pixels, h, w = img
    body: dict[str, Any] = {"mm_hash": fastapi_app.image_hash(pixels, h, w)}
    if with_pixels:
        body.update(pixels=base64.b64encode(pixels).decode(), height=h, width=w)
    return body


def _expected_crc(img: tuple[bytes, int, int]) -> int:
    return fastapi_app.tensor_crc(fastapi_app.preprocess(*img))


def _ours(name: str) -> list[str]:
    return [n for n in os.listdir(SHM) if name in n]


@pytest.mark.e2e
def test_fastapi_example_under_uvicorn(tmp_path: Path) -> None:
    name = f"{RUN_PREFIX}app-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        AIOSHM_EXAMPLE_NAME=name,
        AIOSHM_EXAMPLE_CACHE_MB="16",
        AIOSHM_EXAMPLE_MAX_OBJECT_MB="1",  # so that a 256x512 image (1.5 MiB) goes inline
    )
    cmd = [sys.executable, "-m", "uvicorn", "--loop", "uvloop", "--app-dir", str(EXAMPLES)]
    cmd += ["fastapi_app:app", "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "uvicorn.log"
    with log.open("wb") as out:  # a file, not a pipe: a full pipe would stall the server
        server = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    worker_pid = 0
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client:
            deadline = time.monotonic() + 90.0
            health: dict[str, Any] = {}
            while time.monotonic() < deadline:
                if server.poll() is not None:
                    pytest.fail(f"uvicorn exited: {log.read_text()[-3000:]}")
                try:
                    r = client.get("/healthz")
                except httpx.TransportError:
                    time.sleep(0.1)
                    continue
                if r.status_code == 200:
                    health = r.json()
                    break
                time.sleep(0.1)
            assert health.get("ok"), "the gateway did not become ready in time"
            worker_pid = health["worker_pid"]
            assert health["segment"] == f"aioshm-{name}"

            a, b = _image(1, 48, 64), _image(2, 96, 128)
            big = _image(3, 256, 512)

            # hash first: not held yet -> 409 naming it; then resend with the pixels
            r = client.post("/v1/embed", json=_body(a, with_pixels=False))
            assert r.status_code == 409
            assert r.json()["missing"] == [_body(a, with_pixels=False)["mm_hash"]]
            for img, transport in ((a, "shm"), (b, "shm"), (big, "inline")):
                got = client.post("/v1/embed", json=_body(img, with_pixels=True))
                assert got.status_code == 200, got.text
                ans = got.json()
                assert ans["crc32"] == _expected_crc(img)
                assert ans["shape"] == [3, img[1], img[2]]
                assert (ans["transport"], ans["preprocessed"]) == (transport, True)

            # second round, hashes alone: served from the cache, never preprocessed again
            for img in (a, b):
                ans = client.post("/v1/embed", json=_body(img, with_pixels=False)).json()
                assert ans["crc32"] == _expected_crc(img)
                assert (ans["transport"], ans["preprocessed"]) == ("shm", False)
            assert client.post("/v1/embed", json=_body(big, with_pixels=False)).status_code == 409

            # a new image asked for by 8 requests at once: preprocessed once
            d = _image(4, 120, 160)
            with ThreadPoolExecutor(8) as pool:
                answers = list(
                    pool.map(
                        lambda _: client.post("/v1/embed", json=_body(d, with_pixels=True)).json(),
                        range(8),
                    )
                )
            assert sum(ans["preprocessed"] for ans in answers) == 1
            assert all(ans["crc32"] == _expected_crc(d) for ans in answers)
            assert all(ans["transport"] == "shm" for ans in answers)

            # a hash is a claim: one that does not name the pixels is refused (400), not cached;
            # one that is not a content key looks nothing up; each image keeps its own answer
            e = _image(5, 8, 8)
            refused = [
                _body(e, with_pixels=True) | {"mm_hash": "0" * 32},
                _body(e, with_pixels=True) | {"mm_hash": _body(a, with_pixels=False)["mm_hash"]},
                _body(b, with_pixels=True) | {"mm_hash": _body(a, with_pixels=False)["mm_hash"]},
                {"mm_hash": "photo-1"},
                {"mm_hash": tenant_key("photo-1", tenant="anyone")},
            ]
            for bad in refused:
                r = client.post("/v1/embed", json=bad)
                assert (r.status_code, r.json()["error"]) == (400, "bad_hash"), r.text
            for img in (a, b):
                ans = client.post("/v1/embed", json=_body(img, with_pixels=False)).json()
                assert ans["crc32"] == _expected_crc(img) and not ans["preprocessed"]
            r = client.post("/v1/embed", json=_body(e, with_pixels=False))
            assert r.status_code == 409, "a refused claim cached nothing"

            stats = client.get("/stats").json()
            flight = stats["single_flight"]
            assert flight["runs"] == 4  # a, b, big, d: each preprocessed exactly once
            assert flight["calls"] == flight["hits"] + flight["runs"] + flight["saved"]
            cache = stats["cache"]
            assert cache["items"] == 3 and cache["inline_too_large"] >= 1
            assert all(r["lag"] == 0 for r in cache["readers"] if r["attached"])
            text = client.get("/metrics").text
            assert f'aioshmcache_hits_total{{cache="aioshm-{name}",role="sender"}}' in text
            assert _ours(name), "the segment should exist while the gateway runs"

        server.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown runs the lifespan exit
        assert server.wait(60) == 0, log.read_text()[-3000:]
        assert wait_until(lambda: gone(worker_pid), timeout=30), "the worker outlived the gateway"
        assert _ours(name) == [], "the gateway left its segment (or a semaphore) behind"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        if worker_pid and not gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)
        for left in _ours(name):
            os.unlink(os.path.join(SHM, left))

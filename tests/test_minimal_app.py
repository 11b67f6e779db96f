"""examples/minimal_app.py: one screen of code, run as ``uvicorn --workers 2`` for real.

Two gateway processes (each the writer of its own shard of one cache group), one engine worker
that a gateway started for the whole group, raw image bytes in, the CRC-32 of the tensor as the
worker read it out, checked against the same computation here; a client's ``X-MM-Hash`` never
gives one body another's answer (a claim that does not name the body: 400, nothing cached); bad
input answered 413 / 400;
after shutdown nothing of the group is left (segments, semaphores, socket, engine worker).
"""

from __future__ import annotations

import ast
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tokenize
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioshmcache import AsyncSenderCache, FeatureSpec, ReceiverCache, content_key
from aioshmcache._channel_keeper import lock_held
from aioshmcache._flight import marker_directory

from .conftest import RUN_PREFIX, SHM
from .helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "minimal_app.py"


def code_lines(source: str, *, aside: tuple[str, ...] = ()) -> int:
    """Lines holding code: no blank line, comment or docstring, nor the functions ``aside``."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in aside:
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    blank = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER}
    blank |= {tokenize.INDENT, tokenize.DEDENT}
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in blank:
            lines.add(tok.start[0])
    return len(lines - skip)


def test_minimal_app_is_one_screen() -> None:
    source = APP.read_text()
    n = code_lines(source, aside=("preprocess",))
    assert n <= 60, f"examples/minimal_app.py has {n} code lines (goal: 60)"
    assert code_lines("x = 1\n# c\n\n") == 1  # the counter counts code and nothing else
    assert code_lines('"""doc"""\ndef f():\n    """d"""\n    return 1\n', aside=("f",)) == 0


def expected_crc(body: bytes) -> int:
    return zlib.crc32((np.frombuffer(body, np.uint8).astype(np.float32) / 255.0).tobytes())


def _minimal_app() -> Any:
    sys.path.insert(0, str(APP.parent))
    try:
        import minimal_app
    finally:
        sys.path.remove(str(APP.parent))
    return minimal_app


async def test_the_app_keys_each_body_itself_and_a_header_is_only_a_claim(
    make_config: Any,
) -> None:
    """In process (the fast twin of the uvicorn test): the app's route, a real cache, and an
    engine stand-in that reads each reference from shared memory and runs the app's handler."""
    example = _minimal_app()

    class ReadingEngine:
        def __init__(self, rx: ReceiverCache) -> None:
            self.rx = rx

        async def call(self, features: list[FeatureSpec], **kw: Any) -> Any:
            return await example.embed_in_engine(self.rx.get_and_update_features(features), None)

    a, b = b"README.md " * 300, b"pyproject.toml " * 200
    async with AsyncSenderCache.from_config(make_config(1 << 20, 256 << 10, 1)) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            example.app.state.cache, example.app.state.engine = cache, ReadingEngine(rx)
            transport = httpx.ASGITransport(app=example.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:

                async def post(body: bytes, claim: str | None = None) -> httpx.Response:
                    headers = {"X-MM-Hash": claim} if claim else {}
                    return await client.post("/embed", content=body, headers=headers)

                for body, claim in ((a, "photo-1"), (b, "photo-1"), (b, content_key(a))):
                    r = await post(body, claim)
                    assert r.status_code == 400 and r.json()["error"] == "KeyMismatchError"
                assert cache.snapshot().items == 0  # a refused claim cached nothing
                assert (await post(a, content_key(a))).json() == {"crc32": expected_crc(a)}
                assert (await post(b, content_key(a))).status_code == 400  # a is cached now
                assert not cache.is_cached(content_key(b))
                for body in (b, a, b):
                    assert (await post(body)).json() == {"crc32": expected_crc(body)}
                assert cache.is_cached(content_key(a)) and cache.is_cached(content_key(b))
                assert cache.snapshot().items == 2


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    """One request on its own connection, so the kernel may hand it to either process."""
    h = {"Connection": "close", **(headers or {})}
    return httpx.post(url, content=body, headers=h, timeout=120.0)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric ``name`` (counters: its ``_total``) in a Prometheus text page."""
    return [
        (s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in (name, name + "_total")
    ]


def _ours(group: str) -> list[str]:
    return [n for n in os.listdir(SHM) if f"aioshm-{group}." in n]


@pytest.mark.e2e
@pytest.mark.slow
def test_minimal_app_under_uvicorn_workers_2(tmp_path: Path) -> None:
    group = f"{RUN_PREFIX}m{uuid.uuid4().hex[:8]}"
    sock = str(tmp_path / "engine.sock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/embed"
    env = dict(os.environ, AIOSHM_GROUP=group, AIOSHM_ENGINE_SOCKET=sock)
    cmd = [sys.executable, "-m", "uvicorn", "--workers", "2", "--app-dir", str(APP.parent)]
    cmd += ["minimal_app:app", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--timeout-worker-healthcheck", "60"]  # a loaded host: never replaced mid-test
    log = tmp_path / "uvicorn.log"
    with log.open("wb") as out:
        server = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                if _post(url, b"ping").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        rng = np.random.default_rng(7)
        bodies = [rng.integers(0, 256, 1000 + 97 * i, dtype=np.uint8).tobytes() for i in range(16)]
        with ThreadPoolExecutor(8) as pool:  # each image three times, on fresh connections
            answers = list(pool.map(lambda b: (b, _post(url, b)), bodies * 3))
        for body, r in answers:
            assert r.status_code == 200, r.text
            assert r.json() == {"crc32": expected_crc(body)}
        # the second worker may still be starting (one answering was enough above): its shard
        # comes when its startup is done, which a loaded host stretches far beyond 10 s
        assert wait_until(lambda: len([n for n in _ours(group) if "sem." not in n]) == 2, 120)
        assert lock_held(sock)  # one engine worker serves the group

        # bursts of identical new requests: each image preprocessed once in the whole group
        bursts = [rng.integers(0, 256, 5000 + 13 * i, dtype=np.uint8).tobytes() for i in range(12)]
        with ThreadPoolExecutor(6) as pool:
            for body in bursts:
                for r in pool.map(lambda b: _post(url, b), [body] * 6):
                    assert r.status_code == 200 and r.json() == {"crc32": expected_crc(body)}
        # X-MM-Hash is a claim checked against the body: another body under it is refused,
        # and caches nothing; no header, or the right one, gives each body its own answer
        a, b = (rng.integers(0, 256, 3000, dtype=np.uint8).tobytes() for _ in range(2))
        for body, claim in ((a, "photo-1"), (b, "photo-1"), (a, content_key(b)), (b, "h" * 129)):
            r = _post(url, body, {"X-MM-Hash": claim})
            assert r.status_code == 400 and r.json()["error"] == "KeyMismatchError", r.text
        r = _post(url, a, {"X-MM-Hash": content_key(a)})
        assert r.status_code == 200 and r.json() == {"crc32": expected_crc(a)}
        assert _post(url, b, {"X-MM-Hash": content_key(a)}).status_code == 400  # a cached now
        for body, headers in ((b, {}), (a, {}), (b, {"X-MM-Hash": content_key(b)})):
            r = _post(url, body, headers)
            assert r.status_code == 200 and r.json() == {"crc32": expected_crc(body)}
        distinct = 1 + len(bodies) + len(bursts) + 2  # "ping", the images, a and b

        # a scrape of either process shows both shards (read from shared memory); the
        # single-flight series (process-local) tell which process answered
        base = url.rsplit("/", 1)[0]
        answered: dict[str, float] = {}
        for _ in range(400):
            text = httpx.get(f"{base}/metrics/", headers={"Connection": "close"}).text
            items = samples(text, "aioshmcache_items")
            assert sorted(lb["shard"] for lb, _v in items) == ["0", "1"], text
            assert sum(v for _lb, v in items) >= len(bodies)
            [(local, runs)] = samples(text, "aioshmcache_single_flight_runs")
            answered[local["cache"]] = runs
            if len(answered) == 2:
                break
        assert sorted(answered) == [f"aioshm-{group}.shard0", f"aioshm-{group}.shard1"]
        assert sum(answered.values()) == distinct, answered  # no preprocessing done twice

        assert _post(url, bytes(8 << 20) + b"x").status_code == 413

        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 0, log.read_text()[-3000:]
        assert wait_until(lambda: not lock_held(sock), timeout=30)  # the engine worker ended
        assert not os.path.exists(sock)
        assert _ours(group) == [], "the group left a shard (or a semaphore) behind"
        assert not os.path.exists(marker_directory(group))  # every marker, and their directory
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        for left in _ours(group):
            os.unlink(os.path.join(SHM, left))
        shutil.rmtree(marker_directory(group), ignore_errors=True)

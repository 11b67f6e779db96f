"""The FastAPI gateway demo, end to end: real uvicorn on loopback, real worker processes, httpx.

Each gateway runs as ``python -m aioshmcache demo serve`` in its own process (started and
stopped by :class:`GatewayProcess`, with a unique segment name); its engine workers are real
reader processes. Every answer is checked against the same computation done locally from the
image bytes. Teardown proves that nothing is left: the gateway and every worker it ever started
are gone, and so are the segment and its semaphore.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioshmcache import CacheConfig, FeatureSpec, SenderCache, ShmRef
from aioshmcache.tools.demo.gateway import Gateway, GatewayError, GatewaySettings, ImageInput
from aioshmcache.tools.demo.imaging import (
    ImageDecodeError,
    ProcessorConfig,
    decode_image,
    expected_summary,
    mm_hash,
    preprocess,
    smart_resize,
    summarize,
    synthetic_image,
)
from aioshmcache.tools.demo.ipc import decode_features, encode_features
from aioshmcache.tools.demo.load import GatewayProcess, check_response, plan_requests
from aioshmcache.tools.demo.settings import default_max_object_bytes, largest_item_bytes
from aioshmcache.tools.framing import (
    MAX_FRAME,
    ProtocolError,
    TruncatedFrameError,
    pack,
    read_frame,
)
from aioshmcache.wire import FRAME_PREFIX_BYTES, encode_frame

SHM = "/dev/shm"
PROC = ProcessorConfig()
JSON_CT = {"content-type": "application/json"}
# a bound for a hung test, not a speed target; end to end: real gateway and worker processes
pytestmark = [pytest.mark.timeout(600), pytest.mark.e2e]


# --- helpers -------------------------------------------------------------------------------------
def _unique_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _gone(pid: int, timeout: float = 60.0) -> bool:
    """True once ``pid`` no longer exists (or is a zombie, i.e. has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Poll ``cond`` until it holds; fail (naming ``what``) after a generous deadline."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {timeout:.0f} s")
        time.sleep(0.05)


def _shm_files(name: str) -> list[str]:
    seg = name if name.startswith("aioshm-") else f"aioshm-{name}"
    return [n for n in os.listdir(SHM) if n == seg or n.startswith(f"sem.{seg}.")]


class RunningGateway:
    """A running gateway under test, its images' local truth, and its leak check."""

    def __init__(self, proc: GatewayProcess, n_workers: int) -> None:
        self.proc = proc
        self.client = httpx.Client(base_url=proc.url, timeout=30.0)
        self.n_workers = n_workers
        self.pids_seen: set[int] = set()
        self.note_pids()

    def note_pids(self) -> list[int]:
        pids = [w["pid"] for w in self.stats()["workers"]]
        self.pids_seen.update(pids)
        return pids

    def stats(self) -> dict[str, Any]:
        r = self.client.get("/stats")
        assert r.status_code == 200
        body: dict[str, Any] = r.json()
        return body

    def post_json(self, images: list[dict[str, str]], prompt: str = "Describe.") -> httpx.Response:
        return self.client.post("/v1/generate", json={"prompt": prompt, "images": images})

    def stop_and_check(self) -> None:
        self.client.close()
        try:
            rc = self.proc.stop()
            log = self.stderr()
        finally:
            if self.proc.stderr is not None:
                self.proc.stderr.close()
        assert rc == 0, f"gateway exit code {rc}\n{log}"
        assert "Traceback" not in log, log
        for pid in self.pids_seen | {self.proc.pid}:
            assert _gone(pid), f"process {pid} is still running"
        assert _shm_files(self.proc.name) == [], "segment or semaphore left in /dev/shm"
        assert not list(Path(tempfile.gettempdir()).glob(f"aioshmcache-demo-{self.proc.name}-*"))

    def stderr(self) -> str:
        f = self.proc.stderr
        if f is None:
            return ""
        f.flush()
        return Path(f.name).read_text(errors="replace")[-4000:]


def _start(tmp: Path, *args: str, workers: int = 2) -> RunningGateway:
    name = _unique_name()
    err = open(tmp / f"gateway-{name}.log", "w")  # noqa: SIM115 - closed with the gateway
    proc = GatewayProcess(
        ["--workers", str(workers), "--loop", "uvloop", *args], name=name, stderr=err
    )
    try:
        proc.start(timeout=120.0)
    except BaseException:
        err.close()
        raise
    return RunningGateway(proc, workers)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    """One broadcast gateway for the request-level tests (small limits to reach every path)."""
    gw = _start(
        tmp_path_factory.mktemp("gw"),
        "--delivery",
        "broadcast",
        "--cache-mb",
        "24",
        "--max-object-mb",
        "2",
        "--max-images",
        "4",
    )
    try:
        yield gw
    finally:
        gw.stop_and_check()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    """Small images (tensors well under max_object_bytes), distinct from other tests' images."""
    return [synthetic_image(9000 + i, width=160 + 32 * i, height=128 + 16 * i) for i in range(6)]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _verify(body: dict[str, Any], sent: list[bytes], n_workers: int) -> None:
    expected = {e["mm_hash"]: e for e in (expected_summary(b, PROC) for b in sent)}
    ok, checks, matched, problem = check_response(
        body, [mm_hash(b, PROC) for b in sent], expected, n_workers
    )
    assert ok, problem
    assert checks == matched == n_workers * len(set(expected))


# --- pure parts: processor, hashing, channel -----------------------------------------------------
def test_processor_shapes_and_hash() -> None:
    data = synthetic_image(1, width=300, height=200)
    item = preprocess(data, PROC)
    pv, grid = item["pixel_values"], item["image_grid_thw"]
    assert pv.dtype == np.float32 and pv.flags.c_contiguous and pv.shape[0] == 3
    assert pv.shape[1] % 28 == 0 and pv.shape[2] % 28 == 0
    assert grid.dtype == np.int64 and list(grid) == [1, pv.shape[1] // 14, pv.shape[2] // 14]
    assert abs(float(pv.mean())) < 3.0  # normalised, not raw 0..255
    # the hash covers the bytes and the processor settings
    assert mm_hash(data, PROC) == mm_hash(data, ProcessorConfig())
    assert mm_hash(data, PROC) != mm_hash(data, ProcessorConfig(max_pixels=320 * 320))
    assert mm_hash(data, PROC) != mm_hash(data + b"\0", PROC)
    # within bounds, multiples of the patch factor
    for h, w in [(10, 10), (5000, 4000), (224, 224), (100, 3000)]:
        th, tw = smart_resize(h, w, PROC)
        assert th % 28 == 0 and tw % 28 == 0 and th * tw <= PROC.max_pixels
    with pytest.raises(ImageDecodeError):
        decode_image(b"GIF89a but not really", PROC)
    summary = summarize(item, PROC)
    assert summary == summarize(preprocess(data, PROC), PROC)  # deterministic
    assert summary["num_image_tokens"] == int(grid.prod()) // 4


async def test_channel_frames_and_features() -> None:
    """Messages are aioshmcache.wire frames; features are pack_features bytes, checked on decode."""
    item = preprocess(synthetic_image(2, width=100, height=90), PROC)
    ref = ShmRef(nonce=1, epoch=1, address=4096, id=7, length=1000)
    reader = asyncio.StreamReader()
    reader.feed_data(pack({"t": "infer", "features": encode_features([FeatureSpec("a", ref)])}))
    reader.feed_data(pack({"t": "infer", "features": encode_features([FeatureSpec("b", item)])}))
    reader.feed_data(encode_frame(b"\x91\x01"))  # not a map
    reader.feed_data((MAX_FRAME + 1).to_bytes(FRAME_PREFIX_BYTES, "little"))
    m1, m2 = await read_frame(reader), await read_frame(reader)
    assert m1 is not None and m2 is not None
    assert decode_features(m1["features"]) == [FeatureSpec("a", ref)]
    back = decode_features(m2["features"])[0].data
    assert np.array_equal(back["pixel_values"], item["pixel_values"])
    assert back["image_grid_thw"].dtype == np.int64
    with pytest.raises(ProtocolError, match="map"):
        await read_frame(reader)
    with pytest.raises(ProtocolError, match="exceeds"):
        await read_frame(reader)
    reader.feed_eof()
    assert await read_frame(reader) is None
    truncated = asyncio.StreamReader()
    truncated.feed_data(encode_frame(b"\x81\xa1t\xa1x")[:-1])
    truncated.feed_eof()
    with pytest.raises(TruncatedFrameError):
        await read_frame(truncated)
    good = encode_features([FeatureSpec("x", {"p": np.zeros(4, np.float32)})])
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_features(good[:-3])  # cut short
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_features(b"\x93\x01\x02\x03" + good[4:])  # not a features message
    with pytest.raises(ProtocolError, match="bytes"):
        decode_features([{"mm_hash": "x"}])  # the old hand-made form
    with pytest.raises(ProtocolError, match="neither"):
        encode_features([FeatureSpec("x", None)])


def test_documented_hash_format_matches() -> None:
    """The mm_hash recipe in examples/README.md computes the gateway's hash."""
    readme = (Path(__file__).resolve().parent.parent / "examples" / "README.md").read_text()
    block = re.search(r"## The image hash.*?```python\n(.*?)```", readme, re.S)
    assert block is not None
    namespace: dict[str, Any] = {}
    exec(block.group(1), namespace)
    data = synthetic_image(4242, width=200, height=150)
    settings = json.loads(json.dumps(PROC.to_dict()))  # as GET /v1/processor sends it
    assert namespace["mm_hash"](data, settings) == mm_hash(data, PROC)


def test_request_plan_is_zipf_and_reproducible() -> None:
    a = plan_requests(400, 16, max_per_request=3, zipf=1.1, seed=3, hash_first=0.3)
    assert a == plan_requests(400, 16, max_per_request=3, zipf=1.1, seed=3, hash_first=0.3)
    counts = np.bincount([i for r in a for i in r.images], minlength=16)
    assert counts.max() > 4 * max(1, counts.min())  # a few hot images, a long tail
    assert all(1 <= len(r.images) <= 3 for r in a)
    assert any(r.multipart for r in a) and any(not r.multipart for r in a)
    assert any(r.hash_first for r in a)


# --- the gateway ---------------------------------------------------------------------------------
def test_json_fresh_then_repeated(gateway: RunningGateway, images: list[bytes]) -> None:
    first = gateway.post_json([{"data": _b64(images[0])}, {"data": _b64(images[1])}])
    assert first.status_code == 200, first.text
    body = first.json()
    _verify(body, images[:2], gateway.n_workers)
    assert [im["preprocessed"] for im in body["images"]] == [True, True]
    assert {im["transport"] for im in body["images"]} == {"shm"}
    assert len({w["pid"] for w in body["workers"]}) == 2  # broadcast: both ranks answered
    # repeated (and one fresh): the cached images are not preprocessed again
    again = gateway.post_json([{"data": _b64(b)} for b in (images[1], images[0], images[2])])
    assert again.status_code == 200, again.text
    body = again.json()
    _verify(body, [images[1], images[0], images[2]], gateway.n_workers)
    assert [im["preprocessed"] for im in body["images"]] == [False, False, True]
    assert [im["index"] for im in body["images"]] == [0, 1, 2]
    tokens = sum(im["num_image_tokens"] for im in body["images"])
    assert body["prompt_tokens"] == 1 + tokens


def test_multipart_upload(gateway: RunningGateway, images: list[bytes]) -> None:
    files = [("images", ("a.png", images[3], "image/png")), ("images", ("b.jpg", images[4], None))]
    r = gateway.client.post("/v1/generate/upload", data={"prompt": "two images"}, files=files)
    assert r.status_code == 200, r.text
    _verify(r.json(), images[3:5], gateway.n_workers)
    # the same image twice in one request: read once, answered twice
    dup = [("images", ("a.png", images[3])), ("images", ("a2.png", images[3]))]
    r = gateway.client.post("/v1/generate/upload", data={"prompt": "twice"}, files=dup)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [im["mm_hash"] for im in body["images"]] == [mm_hash(images[3], PROC)] * 2
    assert [im["preprocessed"] for im in body["images"]] == [False, False]
    _verify(body, [images[3], images[3]], gateway.n_workers)


def test_drift_409_then_resend(gateway: RunningGateway) -> None:
    fresh = synthetic_image(424242, width=200, height=150)
    h = mm_hash(fresh, PROC)
    r = gateway.post_json([{"mm_hash": h}])
    assert r.status_code == 409
    body = r.json()
    assert body["error"] == "cache_miss" and body["missing"] == [h] and h in body["message"]
    r = gateway.post_json([{"data": _b64(fresh)}])  # the client resends with the bytes
    assert r.status_code == 200, r.text
    _verify(r.json(), [fresh], gateway.n_workers)
    # now the hash alone is enough, in JSON and in multipart
    r = gateway.post_json([{"mm_hash": h}])
    assert r.status_code == 200, r.text
    assert r.json()["images"][0]["preprocessed"] is False
    _verify(r.json(), [fresh], gateway.n_workers)
    r = gateway.client.post("/v1/generate/upload", data={"prompt": "p", "mm_hashes": [h]})
    assert r.status_code == 200, r.text
    _verify(r.json(), [fresh], gateway.n_workers)
    # hash and data together must agree
    r = gateway.post_json([{"data": _b64(fresh), "mm_hash": "0" * 32}])
    assert r.status_code == 422 and r.json()["error"] == "hash_mismatch"


def test_bad_inputs_are_4xx_and_the_server_keeps_serving(
    gateway: RunningGateway, images: list[bytes]
) -> None:
    c = gateway.client
    png = images[0]
    cases: list[tuple[httpx.Response, int, str]] = [
        (
            c.post("/v1/generate/upload", data={"prompt": "p"}, files=[("images", ("x", b"hi"))]),
            415,
            "not an image",
        ),
        (gateway.post_json([{"data": _b64(png[: len(png) // 3])}]), 415, "image 0"),
        (gateway.post_json([{"data": "@@not base64@@"}]), 422, "base64"),
        (
            c.post(
                "/v1/generate",
                content=b'{"prompt": "x", "images": [',
                headers={"content-type": "application/json"},
            ),
            422,
            "JSON",
        ),
        (c.post("/v1/generate", json={"images": [{"data": _b64(png)}]}), 422, "prompt"),
        (gateway.post_json([]), 422, "at least one image"),
        (gateway.post_json([{"data": _b64(png)}] * 5), 413, "at most 4"),
        (gateway.post_json([{"mm_hash": "not-a-hash"}]), 422, "32 lowercase hex"),
        (gateway.post_json([{}]), 422, "'data' or 'mm_hash'"),
        (c.post("/v1/generate", json={"prompt": "p", "images": [], "extra": 1}), 422, "extra"),
    ]
    for resp, status, text in cases:
        assert resp.status_code == status, (status, resp.text)
        assert text.lower() in resp.text.lower(), (text, resp.text)
        assert {"error", "message"} <= set(resp.json()), resp.text  # one shape everywhere
    too_many = [("images", (f"{i}.png", png)) for i in range(5)]
    r = c.post("/v1/generate/upload", data={"prompt": "p"}, files=too_many)
    assert r.status_code == 413 and r.json()["error"] == "too_many_images"
    # the server is fine afterwards
    r = gateway.post_json([{"data": _b64(png)}])
    assert r.status_code == 200, r.text
    _verify(r.json(), [png], gateway.n_workers)
    assert c.get("/healthz").status_code == 200


def test_one_error_shape_for_validation_and_routing(gateway: RunningGateway) -> None:
    """FastAPI's own errors (validation, 404, 405) come in the gateway's shape too."""
    c = gateway.client
    r = c.post("/v1/generate", json={"prompt": 3, "images": "no"})
    body = r.json()
    assert r.status_code == 422 and body["error"] == "invalid_request", r.text
    assert "detail" not in body and "images" in body["message"] and "prompt" in body["message"]
    assert {e["field"] for e in body["errors"]} == {"prompt", "images"}
    r = c.get("/nowhere")
    assert r.status_code == 404 and r.json() == {"error": "not_found", "message": "Not Found"}
    r = c.get("/v1/generate")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"
    assert "POST" in r.headers.get("allow", "")


def test_wrong_content_type_is_415(gateway: RunningGateway, images: list[bytes]) -> None:
    c = gateway.client
    body = json.dumps({"prompt": "p", "images": [{"data": _b64(images[0])}]})
    for ctype in ("text/plain", None, "multipart/form-data; boundary=x"):
        headers = {} if ctype is None else {"content-type": ctype}
        r = c.post("/v1/generate", content=body.encode(), headers=headers)
        assert r.status_code == 415, (ctype, r.text)
        assert r.json()["error"] == "unsupported_media_type" and "application/json" in r.text
    r = c.post("/v1/generate/upload", json={"prompt": "p"})
    assert r.status_code == 415 and "multipart/form-data" in r.json()["message"]
    r = c.post("/v1/generate", content=body.encode(), headers={"content-type": "Application/JSON"})
    assert r.status_code == 200, r.text  # media types are case-insensitive


def test_default_max_object_caches_a_1080p_photo(shm_name: str) -> None:
    """The default maximum object size holds a preprocessed 1920x1080 photo (and 640x480)."""
    settings = GatewaySettings()
    assert settings.max_object_mb is None
    limit = settings.max_object_bytes
    assert limit == default_max_object_bytes(PROC) == 6 << 20
    full_hd = preprocess(synthetic_image(77, width=1920, height=1080, fmt="JPEG"), PROC)
    vga = preprocess(synthetic_image(78, width=640, height=480, fmt="JPEG"), PROC)
    assert full_hd["pixel_values"].shape == (3, 476, 840)
    nbytes = sum(int(a.nbytes) for a in full_hd.values())
    assert 3 << 20 < nbytes <= largest_item_bytes(PROC) < limit  # the old 3 MiB did not fit
    config = CacheConfig(4 * limit, limit, 1, name=shm_name)
    with SenderCache(config) as sender:
        for i, item in enumerate((full_hd, vga)):
            ref, _ = sender.get_and_update_item((item, ()), f"{i:032x}")
            assert isinstance(ref, ShmRef), "served inline: the default is too small"
        assert sender.snapshot().inline_too_large == 0


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes, from /proc/<pid>/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _post_chunked(
    url: str, path: str, content_type: str, total: int, preamble: bytes = b""
) -> tuple[int, bytes]:
    """POST ``preamble`` and ``total`` bytes of junk, chunked; stops sending once answered."""
    host, _, port = url.removeprefix("http://").partition(":")
    sock = socket.create_connection((host, int(port.rstrip("/"))), timeout=60)
    with sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        payload = b"7" * (1 << 20)
        chunk = b"%x\r\n" % len(payload) + payload + b"\r\n"
        frames = [chunk] * -(-total // len(payload)) + [b"0\r\n\r\n"]
        if preamble:
            frames.insert(0, b"%x\r\n" % len(preamble) + preamble + b"\r\n")
        pending = memoryview(b"")
        sock.setblocking(False)
        deadline = time.monotonic() + 60
        while (pending or frames) and time.monotonic() < deadline:
            if not pending:
                pending = memoryview(frames.pop(0))
            readable, writable, _ = select.select([sock], [sock], [], 5)
            if readable:
                break  # the answer came before the body ended: stop sending
            if writable:
                try:
                    pending = pending[sock.send(pending) :]
                except (BrokenPipeError, ConnectionResetError):
                    break
        sock.setblocking(True)
        data = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                got = sock.recv(65536)
                if not got:
                    break
                data += got
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data.partition(b"\r\n\r\n")[2]


def test_chunked_body_stops_at_the_limit_without_buffering(tmp_path: Path) -> None:
    """A 160 MB chunked body against an 8 MiB limit: 413, and the gateway's memory stays put."""
    limit_mb, total = 8, 160 * 1000 * 1000
    gw = _start(tmp_path, "--max-body-mb", str(limit_mb), workers=1)
    try:
        pid = gw.proc.pid
        warm = gw.client.post("/v1/generate", content=b"x" * 4096, headers=JSON_CT)
        assert warm.status_code == 422, warm.text  # not JSON, but under the limit
        before = _status(pid)
        file_part = (
            b'--zzz\r\nContent-Disposition: form-data; name="images"; filename="a.png"\r\n'
            b"Content-Type: image/png\r\n\r\n"
        )
        answers = [
            _post_chunked(gw.proc.url, path, ctype, total, preamble)
            for path, ctype, preamble in (
                ("/v1/generate", "application/json", b""),
                ("/v1/generate/upload", "multipart/form-data; boundary=zzz", file_part),
            )
        ]
        after = _status(pid)
        margin = 48 << 20  # the limit may be held once or twice while the app reads; not 160 MB
        assert after["VmHWM"] <= max(before["VmHWM"], before["VmRSS"] + (limit_mb << 20) + margin)
        assert after["VmRSS"] <= before["VmRSS"] + (limit_mb << 20) + margin
        for status, body in answers:
            assert status == 413, (status, body[:300])
            err = json.loads(body)
            assert err["error"] == "body_too_large" and str(limit_mb << 20) in err["message"]
        r = gw.client.get("/healthz")  # and it keeps serving
        assert r.status_code == 200
    finally:
        gw.stop_and_check()


def test_oversize_image_served_inline_and_correct(gateway: RunningGateway) -> None:
    big = synthetic_image(777, width=600, height=560)  # ~3.8 MiB of tensors > 2 MiB max object
    assert expected_summary(big, PROC)["nbytes"] > 2 << 20
    before = gateway.stats()["cache"]
    for _ in range(2):  # never cached: preprocessed and sent inline both times
        r = gateway.post_json([{"data": _b64(big)}])
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["images"][0]["transport"] == "inline"
        assert body["images"][0]["preprocessed"] is True
        _verify(body, [big], gateway.n_workers)
    after = gateway.stats()["cache"]
    assert after["inline_too_large"] - before["inline_too_large"] == 2
    assert after["items"] == before["items"]


def test_metrics_parse_and_show_hits(gateway: RunningGateway, images: list[bytes]) -> None:
    for _ in range(2):
        assert gateway.post_json([{"data": _b64(images[5])}]).status_code == 200
    r = gateway.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}

    def value(name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in fams[name].samples
            if s.name in (name, name + "_total")
            and all(s.labels.get(k) == v for k, v in labels.items())
        )

    # the cache's metrics come from aioshmcache.metrics.CacheCollector
    assert value("aioshmcache_hits") > 0
    assert value("aioshmcache_misses") > 0
    assert value("aioshmcache_capacity_bytes") == 24 << 20
    assert value("aioshmcache_items") >= 1 and value("aioshmcache_used_bytes") > 0
    causes = {s.labels["cause"] for s in fams["aioshmcache_inline_serves"].samples}
    assert causes >= {"too_large", "full"}
    alive = [s for s in fams["aioshmcache_reader_alive"].samples]
    assert len(alive) == 2 and all(s.value == 1.0 for s in alive)
    assert "aioshmcache_reader_lag" in fams and "aioshmcache_evictions" in fams
    assert value("aioshmcache_single_flight_calls") >= 2
    assert value("aioshmcache_single_flight_runs") >= 1
    assert "aioshmcache_single_flight_saved" in fams
    # the demo's own: which worker holds which reader slot
    slots = fams["gateway_reader_slot_info"].samples
    assert {s.labels["worker"] for s in slots} == {"0", "1"} and all(s.value == 1 for s in slots)
    assert {s.labels["slot"] for s in slots} == {s.labels["slot"] for s in alive}
    assert value("gateway_worker_up") == 2
    assert value("gateway_http_requests", route="/v1/generate", status="200") >= 2
    assert value("gateway_feature_bytes", path="from_cache") > 0
    stats = gateway.stats()
    assert stats["cache"]["hits"] > 0 and len(stats["workers"]) == 2
    assert stats["loop_lag"]["samples"] > 0


def test_example_client(gateway: RunningGateway, tmp_path: Path) -> None:
    """examples/client.py: hashes first, 409, resend as multipart, then served from the cache."""
    img = tmp_path / "photo.png"
    img.write_bytes(synthetic_image(31337, width=250, height=180, fmt="PNG"))
    script = Path(__file__).resolve().parent.parent / "examples" / "client.py"
    cp = subprocess.run(
        [sys.executable, str(script), gateway.proc.url, str(img)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    round1, round2 = cp.stdout.split("round 2:")
    assert "409: gateway does not hold 1 image(s)" in round1 and "(preprocessed)" in round1
    assert "409" not in round2 and "(cache)" in round2 and "worker(s) 0, 1" in round2


async def test_concurrent_clients(gateway: RunningGateway, images: list[bytes]) -> None:
    """Many requests in flight at once (runs on both asyncio and uvloop)."""
    async with httpx.AsyncClient(base_url=gateway.proc.url, timeout=30.0) as client:

        async def one(k: int) -> tuple[httpx.Response, list[bytes]]:
            sent = [images[(k + j) % len(images)] for j in range(1 + k % 3)]
            body = {"prompt": f"req {k}", "images": [{"data": _b64(b)} for b in sent]}
            return await client.post("/v1/generate", json=body), sent

        results = await asyncio.gather(*(one(k) for k in range(16)))
    for resp, sent in results:
        assert resp.status_code == 200, resp.text
        _verify(resp.json(), sent, gateway.n_workers)


async def test_lifespan_in_process_drift_recovery(
    shm_name: str, images: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's lifespan on the test's own loop, with real workers: hit skipping, the
    worker-side drift path (stale references -> invalidate -> resend), the eviction race,
    single flight, and hand-outs given back when a request fails."""
    a, b = images[0], images[1]
    ha, hb = mm_hash(a, PROC), mm_hash(b, PROC)
    gw = Gateway(GatewaySettings(workers=2, name=shm_name, cache_mb=16, max_object_mb=2))
    async with gw.running():
        assert gw.pool is not None and gw.cache is not None and gw.pool.all_ready()
        pids = [w.pid for w in gw.pool.info()]
        out = await gw.generate("p", [ImageInput(0, a, ha)])
        _verify(out, [a], 2)
        n = gw.counters["preprocessed"]
        out = await gw.generate("p", [ImageInput(0, a, ha), ImageInput(1, None, ha)])
        assert gw.counters["preprocessed"] == n  # a hit is never preprocessed again
        assert [im["preprocessed"] for im in out["images"]] == [False, False]
        _verify(out, [a, a], 2)

        # the workers find the references stale (the cache was cleared after the hand-out)
        cache, real_dispatch = gw.cache, gw.pool.dispatch
        calls = 0

        async def clear_then_dispatch(features: Any, *, timeout: float) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                await cache.clear_cache()
            return await real_dispatch(features, timeout=timeout)

        monkeypatch.setattr(gw.pool, "dispatch", clear_then_dispatch)
        out = await gw.generate("p", [ImageInput(0, a, ha)])
        assert out["attempts"] == 2 and gw.counters["worker_cache_miss"] == 1
        assert out["images"][0]["preprocessed"] is True  # resent with fresh tensors
        _verify(out, [a], 2)
        calls = 0  # the same with a hash only: the client has to resend -> 409
        with pytest.raises(GatewayError) as info:
            await gw.generate("p", [ImageInput(0, None, ha)])
        assert info.value.status == 409 and info.value.extra["missing"] == [ha]
        monkeypatch.setattr(gw.pool, "dispatch", real_dispatch)

        # evicted between is_cached_item and the hand-out: get_or_put preprocesses at once
        real_is_cached = cache.is_cached_item
        lies = {hb}

        def is_cached_once(h: str) -> bool:
            if h in lies:
                lies.discard(h)
                return True
            return real_is_cached(h)

        monkeypatch.setattr(cache, "is_cached_item", is_cached_once)
        out = await gw.generate("p", [ImageInput(0, b, hb)])
        assert out["attempts"] == 1 and out["images"][0]["preprocessed"] is True
        assert not lies  # the lie was told (and handled by the single-flight call)
        _verify(out, [b], 2)
        monkeypatch.setattr(cache, "is_cached_item", real_is_cached)

        # single flight: concurrent requests for one new image preprocess it once, each gets
        # its own hand-out; a request with an undecodable image gives its other hand-outs back
        c = synthetic_image(77, width=120, height=100)
        hc = mm_hash(c, PROC)
        before, flights = gw.counters["preprocessed"], cache.single_flight_stats()
        outs = await asyncio.gather(*(gw.generate("p", [ImageInput(0, c, hc)]) for _ in range(6)))
        for o in outs:
            _verify(o, [c], 2)
        after = cache.single_flight_stats()
        assert gw.counters["preprocessed"] == before + 1
        assert after.runs - flights.runs == 1 and after.calls - flights.calls == 6
        assert (after.saved - flights.saved) + (after.hits - flights.hits) == 5
        real_preprocess = gw._preprocess

        async def fail_after_the_hand_out(img: ImageInput) -> dict[str, Any]:
            deadline = time.monotonic() + 60  # the other image's hand-out is made (owed) first
            while not any(r.lag for r in cache.snapshot().readers if r.attached):
                assert time.monotonic() < deadline, "the other image was never handed out"
                await asyncio.sleep(0.01)
            return await real_preprocess(img)

        monkeypatch.setattr(gw, "_preprocess", fail_after_the_hand_out)
        with pytest.raises(GatewayError) as info:
            await gw.generate("p", [ImageInput(0, c, hc), ImageInput(1, b"not an image", "0" * 64)])
        assert info.value.status == 415
        owed = [r.lag for r in cache.snapshot().readers if r.attached]
        assert owed and all(lag == 0 for lag in owed), owed  # nothing owed for the failed request
    assert _shm_files(shm_name) == []
    for pid in pids:
        assert _gone(pid)


# --- worker failures -----------------------------------------------------------------------------
def _hammer(
    gw: RunningGateway, pool: list[bytes], stop: threading.Event, out: list[tuple[int, str]]
) -> None:
    with httpx.Client(base_url=gw.proc.url, timeout=30.0) as c:
        k = 0
        while not stop.is_set():
            k += 1
            sent = [pool[k % len(pool)], pool[(3 * k + 1) % len(pool)]]
            r = c.post(
                "/v1/generate", json={"prompt": "p", "images": [{"data": _b64(b)} for b in sent]}
            )
            if r.status_code != 200:
                out.append((r.status_code, r.text))
                continue
            body = r.json()
            try:
                _verify(body, sent, gw.n_workers if body["delivery"] == "broadcast" else 1)
            except AssertionError as exc:
                out.append((-1, str(exc)))
                continue
            out.append((200, ""))


@pytest.mark.parametrize("delivery", ["broadcast", "one_of_n"])
def test_worker_sigkilled_mid_run(tmp_path: Path, delivery: str) -> None:
    gw = _start(tmp_path, "--delivery", delivery, "--cache-mb", "32", "--handout-ttl", "2")
    try:
        pool = [synthetic_image(5000 + i, width=128 + 24 * i, height=128) for i in range(6)]
        old = gw.note_pids()
        stop = threading.Event()
        out: list[tuple[int, str]] = []
        threads = [threading.Thread(target=_hammer, args=(gw, pool, stop, out)) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(out) >= 3, "the load to get answers")
            os.kill(old[1], signal.SIGKILL)

            def replaced() -> bool:
                st = gw.stats()
                return st["worker_restarts"] >= 1 and all(w["ready"] for w in st["workers"])

            wait_for(replaced, "the replacement worker")
            n_before = len(out)
            # keep the load on the new worker until every client got answers from it
            wait_for(
                lambda: len(out) > n_before + 3 and [s for s, _ in out[-3:]] == [200, 200, 200],
                "answers after the restart",
            )
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        statuses = [s for s, _ in out]
        assert len(out) > n_before + 3, "no requests were answered after the restart"
        bad = [(s, m) for s, m in out if s not in (200, 503)]
        assert not bad, bad[:3]
        if delivery == "one_of_n":  # a dead worker's requests go to another worker
            assert set(statuses) == {200}, [m for s, m in out if s != 200][:3]
        else:  # broadcast needs every rank: requests during the outage fail cleanly
            assert all(
                json.loads(m)["error"] in ("worker_died", "workers_unavailable")
                for s, m in out
                if s == 503
            )
        assert statuses[-3:] == [200, 200, 200]
        st = gw.stats()
        new = gw.note_pids()
        assert new[0] == old[0] and new[1] != old[1] and st["worker_restarts"] == 1
        assert _gone(old[1])
        alive = [r for r in st["cache"]["readers"] if r["alive"]]
        assert sorted(r["pid"] for r in alive) == sorted(new)
        # every worker answers and agrees after the restart
        r = gw.post_json([{"data": _b64(b)} for b in pool[:3]])
        assert r.status_code == 200, r.text
        _verify(r.json(), pool[:3], 2 if delivery == "broadcast" else 1)
    finally:
        gw.stop_and_check()


def test_gateway_sigkilled_workers_exit_and_orphan_is_removed(tmp_path: Path) -> None:
    """The writer dies without cleaning up: its workers notice and exit; stop() sweeps it."""
    gw = _start(tmp_path)
    try:
        pids = gw.note_pids()
        assert gw.post_json([{"data": _b64(synthetic_image(11, width=96, height=96))}]).is_success
        os.kill(gw.proc.pid, signal.SIGKILL)
        for pid in pids:  # the channel's end (and WriterGoneError) stop the workers
            assert _gone(pid), f"worker {pid} survived its gateway"
        assert _shm_files(gw.proc.name), "a SIGKILLed writer cannot unlink its segment"
    finally:
        gw.client.close()
        rc = gw.proc.stop()
        if gw.proc.stderr is not None:
            gw.proc.stderr.close()
    assert rc == -signal.SIGKILL
    assert _shm_files(gw.proc.name) == []  # removed: its writer is dead
    assert not list(Path(tempfile.gettempdir()).glob(f"aioshmcache-demo-{gw.proc.name}-*"))


# --- the main job --------------------------------------------------------------------------------
def _run_demo(
    tmp: Path, *args: str, timeout: float = 300.0
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp / "demo.json"
    cp = subprocess.run(
        [sys.executable, "-m", "aioshmcache", "demo", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    data: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    return cp, data


def test_demo_quick(tmp_path: Path) -> None:
    cp, data = _run_demo(tmp_path, "--quick")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "PASS: all 120 requests" in cp.stdout
    for label in ("hit ratio", "latency p50 / p95 / p99", "worker checks matched", "cache off"):
        assert label in cp.stdout
    assert re.search(r"\[cache on\] \d+/60 requests", cp.stderr)  # progress was shown
    on, off = data["phases"]
    assert data["passed"] is True
    for ph in (on, off):
        assert ph["requests"] == ph["ok"] == ph["verified"] == 60 and ph["failed"] == 0
        assert ph["worker_checks"] == ph["worker_checks_ok"] > 60
        assert ph["throughput_rps"] > 0 and 0 < ph["p50_ms"] <= ph["p95_ms"] <= ph["p99_ms"]
    assert on["hit_ratio"] > 0.5 and on["preprocess_skipped"] > 0 and on["bytes_from_cache"] > 0
    assert on["hits"] + on["misses"] > 0 and on["items"] > 0
    assert off["hit_ratio"] == 0 and off["bytes_from_cache"] == 0
    assert off["preprocessed"] > on["preprocessed"]
    # single flight: the table reports the preprocessings it saved, and its accounting adds up
    sf = on["single_flight"]
    assert sf["saved"] >= 0 and sf["runs"] >= on["preprocessed"] > 0
    rest = sf["calls"] - sf["hits"] - sf["runs"] - sf["saved"]
    assert rest >= 0 and (rest == 0 or sf["failures"] + sf["takeovers"] > 0)
    row = re.search(r"preprocessings saved \(single flight\)\s+(\d+)", cp.stdout)
    assert row is not None and int(row.group(1)) == sf["saved"], cp.stdout
    flight = re.search(r"calls = hits\+runs\+saved\s+(\d+) = (\d+)\+(\d+)\+(\d+)", cp.stdout)
    assert flight is not None, cp.stdout
    assert [int(x) for x in flight.groups()] == [sf[k] for k in ("calls", "hits", "runs", "saved")]
    segments = _demo_segments(cp.stderr)
    assert len(segments) == 2
    for seg in segments:
        assert _shm_files(seg) == []


def test_demo_gateway_workers(tmp_path: Path) -> None:
    """``--gateway-workers 2``: the gateway as 2 uvicorn processes (one cache group, engine
    workers attached to the group), next to the 1-process run; every answer verified."""
    cp, data = _run_demo(tmp_path, "--gateway-workers", "2", "--quick", "--no-compare")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "PASS: all 120 requests" in cp.stdout
    one, two = data["phases"]
    assert data["passed"] is True
    assert (one["gateway_processes"], two["gateway_processes"]) == (1, 2)
    for ph in (one, two):
        assert ph["requests"] == ph["ok"] == ph["verified"] == 60 and ph["failed"] == 0
        assert ph["worker_checks"] == ph["worker_checks_ok"] > 60
        assert ph["hit_ratio"] > 0.5 and ph["preprocessed"] > 0
    # the merged stats of both processes: every image was handed out by one of them
    assert two["hits"] + two["misses"] >= one["hits"] + one["misses"] > 0
    assert two["capacity_bytes"] == 2 * one["capacity_bytes"]  # a shard per process
    header = re.search(r"^\s+cache on\s+cache on, 2 gw\s*$", cp.stdout, re.M)
    assert header is not None, cp.stdout
    for label in ("gateway processes", "hit ratio", "images preprocessed / skipped"):
        assert re.search(rf"^\s+{re.escape(label)}\s", cp.stdout, re.M), label
    procs = re.search(r"gateway processes\s+1\s+2\s*$", cp.stdout, re.M)
    assert procs is not None, cp.stdout
    pre = re.search(r"images preprocessed / skipped\s+(\d+) / (\d+)\s+(\d+) / (\d+)", cp.stdout)
    assert pre is not None
    assert [int(x) for x in pre.groups()] == [
        one["preprocessed"],
        one["preprocess_skipped"],
        two["preprocessed"],
        two["preprocess_skipped"],
    ]
    for seg in _demo_segments(cp.stderr):
        assert _shm_files(seg) == []
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(seg + ".shard")]


def _demo_segments(text: str) -> list[str]:
    return re.findall(r"segment (aioshm-demo-[\w.-]+)\)", text)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_demo_interrupted_cleans_up(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aioshmcache",
            "demo",
            "--requests",
            "100000",
            "--no-compare",
            "--images",
            "6",
            "--concurrency",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    gateway_pid = 0
    segments: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"gateway at \S+ \(pid (\d+)", line)
            if m:
                gateway_pid = int(m.group(1))
                segments = _demo_segments(line)
                break
        assert gateway_pid and segments
        url = re.search(r"gateway at (\S+)", line)
        assert url is not None

        def load_running() -> bool:
            try:
                stats = httpx.get(f"{url.group(1)}/stats", timeout=10.0).json()
            except httpx.HTTPError:
                return False
            return bool(stats["gateway"]["requests"] > 0)

        wait_for(load_running, "the load to start")
        assert os.path.exists(os.path.join(SHM, segments[0]))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert _gone(gateway_pid)
    assert _shm_files(segments[0]) == []
    assert not list(Path(tempfile.gettempdir()).glob(f"aioshmcache-demo-{segments[0]}-*"))

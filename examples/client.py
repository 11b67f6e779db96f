"""A tiny client of the example gateway: hash first, the pixels on 409.

    python examples/client.py http://127.0.0.1:8000 [IMAGE ...]

Serve the gateway with ``python -m aioshmcache demo serve --port 8000`` (or ``uvicorn
--app-dir examples fastapi_app:app``). With no image files the client makes two synthetic
ones; files are decoded to RGB with Pillow. For each image the client computes the
``mm_hash`` itself (``image_hash``: the SHA-256 content key of the RGB bytes in the namespace of
their size, exactly as the gateway keys it) and first sends the hash alone, trusting that the
gateway's cache still holds it. The gateway answers 409 for a
hash it does not hold; the client resends that image with its pixels. A second round of hashes
alone is then answered from the cache.
"""

from __future__ import annotations

import argparse
import base64
import sys
from typing import Any

import httpx

from aioshmcache.tools.demo.app import image_hash
from aioshmcache.tools.demo.load import synthetic_image


def load_rgb(path: str) -> tuple[bytes, int, int]:
    """An image file as RGB bytes, height and width (Pillow: the examples extra has it)."""
    from PIL import Image

    with Image.open(path) as img:
        rgb = img.convert("RGB")
    return rgb.tobytes(), rgb.height, rgb.width


def ask(client: httpx.Client, pixels: bytes, height: int, width: int) -> Any:
    """The hash alone first; on 409 the same request with the pixels."""
    mm_hash = image_hash(pixels, height, width)
    r = client.post("/v1/embed", json={"mm_hash": mm_hash})
    if r.status_code == 409:
        print(f"  409: the gateway does not hold {mm_hash[:12]}: resending its pixels")
        body = {"mm_hash": mm_hash, "height": height, "width": width}
        r = client.post("/v1/embed", json={**body, "pixels": base64.b64encode(pixels).decode()})
    r.raise_for_status()
    return r.json()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python examples/client.py",
        description="Send images to the example gateway hash first, the pixels on 409.",
    )
    p.add_argument("url", help="the gateway, e.g. http://127.0.0.1:8000")
    p.add_argument("images", nargs="*", help="image files (default: two synthetic images)")
    ns = p.parse_args(argv)
    try:
        images = [load_rgb(path) for path in ns.images] or [synthetic_image(1), synthetic_image(2)]
    except OSError as exc:  # missing, unreadable, or not an image (Pillow's error is an OSError)
        p.error(f"cannot read an image: {exc}")
    try:
        run(ns.url, images)
    except httpx.HTTPStatusError as exc:  # the gateway's JSON error, e.g. 413 too_large
        print(f"{exc.request.url}: {exc.response.status_code} {exc.response.text}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:  # no gateway there, a bad URL, a timeout
        print(f"cannot reach the gateway at {ns.url}: {exc}", file=sys.stderr)
        return 1
    return 0


def run(url: str, images: list[tuple[bytes, int, int]]) -> None:
    """Two rounds of every image: the first fills the gateway's cache, the second hits it."""
    with httpx.Client(base_url=url, timeout=30.0) as client:
        for round_ in (1, 2):
            print(f"round {round_}:")
            for k, image in enumerate(images):
                answer = ask(client, *image)
                where = "preprocessed" if answer["preprocessed"] else "cache"
                print(
                    f"  image {k} {answer['mm_hash'][:12]}: {answer['shape']} via "
                    f"{answer['transport']} ({where}), crc32 {answer['crc32']:08x}"
                )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A tiny client of the demo gateway: hash-first requests with the 409 drift fallback.

    python examples/client.py http://127.0.0.1:8000 [IMAGE ...]

With no image files it generates two synthetic ones. For each image the client computes the
``mm_hash`` itself (with the processor settings the gateway publishes on ``/v1/processor``) and
first sends only the hashes, trusting that the gateway's cache still holds them. The gateway
answers 409 with the hashes it does not hold; the client resends those with their bytes (as a
multipart upload). A second round of hashes alone is then answered from the cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import httpx

from aioshmcache.tools.demo.imaging import ProcessorConfig, mm_hash, synthetic_image


def processor_of(client: httpx.Client) -> ProcessorConfig:
    settings: dict[str, Any] = client.get("/v1/processor").raise_for_status().json()
    for key in ("image_mean", "image_std"):
        settings[key] = tuple(settings[key])
    return ProcessorConfig(**settings)


def ask(client: httpx.Client, prompt: str, images: list[bytes], hashes: list[str]) -> Any:
    """Hashes first; on 409 resend the missing images with their bytes (as multipart)."""
    body = {"prompt": prompt, "images": [{"mm_hash": h} for h in hashes]}
    r = client.post("/v1/generate", json=body)
    resend: set[str] = set()
    for _ in range(3):  # others may be evicted in between: then they are resent too
        if r.status_code != 409:
            break
        missing = set(r.json()["missing"])
        print(f"  409: gateway does not hold {len(missing)} image(s): resending their bytes")
        resend |= missing
        files = [("images", (f"{h}.img", b)) for b, h in zip(images, hashes) if h in resend]
        data: dict[str, Any] = {"prompt": prompt}
        others = [h for h in hashes if h not in resend]
        if others:
            data["mm_hashes"] = others
        r = client.post("/v1/generate/upload", data=data, files=files)
    r.raise_for_status()
    return r.json()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python examples/client.py",
        description="Send images to the demo gateway hash-first, resending the bytes on 409.",
    )
    p.add_argument("url", help="the gateway, e.g. http://127.0.0.1:8000")
    p.add_argument("images", nargs="*", help="image files (default: two synthetic images)")
    ns = p.parse_args(argv)
    url, paths = ns.url, ns.images
    images = [Path(p).read_bytes() for p in paths] or [synthetic_image(1), synthetic_image(2)]
    with httpx.Client(base_url=url, timeout=30.0) as client:
        processor = processor_of(client)
        hashes = [mm_hash(b, processor) for b in images]
        for round_ in (1, 2):
            print(f"round {round_}:")
            answer = ask(client, "Describe the images.", images, hashes)
            for im in answer["images"]:
                where = "cache" if not im["preprocessed"] else "preprocessed"
                print(
                    f"  image {im['index']} {im['mm_hash'][:12]}: {im['shape']} via "
                    f"{im['transport']} ({where}), crc32 {im['crc32']:08x}, "
                    f"{im['num_image_tokens']} tokens"
                )
            workers = ", ".join(str(w["worker"]) for w in answer["workers"])
            print(f"  answered by worker(s) {workers}; prompt tokens {answer['prompt_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

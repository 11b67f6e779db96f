"""Image decoding, vision-language preprocessing, hashing and the workers' "embedding".

Everything that both sides of the demo must compute identically lives here: the gateway
preprocesses with :func:`preprocess`, the engine workers compute :func:`summarize` from the
tensors they read back from shared memory, and the load driver (and the tests) compute the same
:func:`expected_summary` locally from the raw image bytes to check every answer.

The processor follows Qwen2-VL's image processor in spirit: the image is resized so that both
sides are multiples of ``patch_size * merge_size`` (28 px) and the pixel count lies within
``[min_pixels, max_pixels]`` (keeping the aspect ratio), rescaled to ``[0, 1]``, normalised with
the CLIP mean and standard deviation, and laid out channel-first as float32 ``pixel_values``
``(3, H, W)``, together with the int64 patch grid ``image_grid_thw = [1, H / 14, W / 14]``. One
image becomes ``t * h * w / merge_size**2`` placeholder tokens in the prompt.

``mm_hash`` is a BLAKE2b digest of the processor settings and the raw bytes: the same file under
other settings is another cache item.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import zlib
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = [
    "EMBED_DIM",
    "ImageDecodeError",
    "ImageTooLargeError",
    "ProcessorConfig",
    "decode_image",
    "embed",
    "expected_summary",
    "image_nbytes",
    "is_mm_hash",
    "mm_hash",
    "num_image_tokens",
    "preprocess",
    "preprocess_array",
    "smart_resize",
    "summarize",
    "synthetic_image",
]

EMBED_DIM: Final = 16
_HASH_RE = re.compile(r"^[0-9a-f]{32}$")


class ImageDecodeError(ValueError):
    """The bytes are not an image Pillow can decode."""


class ImageTooLargeError(ValueError):
    """The decoded image has more pixels than the processor accepts (a decompression bomb)."""


@dataclass(frozen=True)
class ProcessorConfig:
    """The settings of the image processor; part of every ``mm_hash``."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 640 * 640
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    #: images with more source pixels than this are refused before decoding (bomb guard)
    max_source_pixels: int = 40_000_000
    resample: str = field(default="bicubic")

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.merge_size < 1:
            raise ValueError("patch_size and merge_size must be >= 1")
        factor = self.patch_size * self.merge_size
        if not factor * factor <= self.min_pixels <= self.max_pixels:
            raise ValueError("need (patch_size*merge_size)**2 <= min_pixels <= max_pixels")
        if self.resample not in _RESAMPLE:
            raise ValueError(f"resample must be one of {sorted(_RESAMPLE)}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def fingerprint(self) -> bytes:
        """A canonical encoding of the settings (what the hash of an image depends on)."""
        settings = asdict(self)
        settings.pop("max_source_pixels")  # a guard, not a preprocessing parameter
        return json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_RESAMPLE: Final = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "lanczos": Image.Resampling.LANCZOS,
}


def is_mm_hash(value: object) -> bool:
    """Whether ``value`` looks like one of our hashes (32 lowercase hex digits)."""
    return isinstance(value, str) and _HASH_RE.match(value) is not None


def mm_hash(data: bytes, config: ProcessorConfig) -> str:
    """BLAKE2b-128 of the processor settings and the raw image bytes, as hex."""
    h = hashlib.blake2b(digest_size=16, person=b"aioshm-demo-img")
    fp = config.fingerprint()
    h.update(len(fp).to_bytes(4, "little"))
    h.update(fp)
    h.update(data)
    return h.hexdigest()


def smart_resize(height: int, width: int, config: ProcessorConfig) -> tuple[int, int]:
    """Target size: multiples of ``factor``, aspect kept, pixels within the configured bounds."""
    factor = config.factor
    if height < 1 or width < 1:
        raise ImageDecodeError("image has a zero dimension")
    if max(height, width) / min(height, width) > 200:
        raise ImageDecodeError(f"aspect ratio of {width}x{height} is above 200")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > config.max_pixels:
        beta = math.sqrt(height * width / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes, config: ProcessorConfig) -> Image.Image:
    """Decode with Pillow into RGB; ``ImageDecodeError`` / ``ImageTooLargeError`` otherwise."""
    if not data:
        raise ImageDecodeError("empty image data")
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > config.max_source_pixels:
            raise ImageTooLargeError(
                f"image of {w}x{h} pixels exceeds the limit of {config.max_source_pixels} pixels"
            )
        img.load()
        upright = ImageOps.exif_transpose(img)
        return upright.convert("RGB")
    except UnidentifiedImageError:
        raise ImageDecodeError("not an image (Pillow cannot identify the format)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(f"image refused: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, (ImageDecodeError, ImageTooLargeError)):
            raise
        raise ImageDecodeError(f"corrupt or truncated image: {exc}") from None


def preprocess_array(img: Image.Image, config: ProcessorConfig) -> dict[str, npt.NDArray[Any]]:
    """Resize, rescale, normalise: ``{"pixel_values": (3, H, W) f32, "image_grid_thw": i64}``."""
    height, width = smart_resize(img.height, img.width, config)
    resized = img.resize((width, height), _RESAMPLE[config.resample])
    arr = np.asarray(resized, dtype=np.float32)  # (H, W, 3)
    mean = np.asarray(config.image_mean, dtype=np.float32) * np.float32(255.0)
    inv_std = np.float32(1.0) / (np.asarray(config.image_std, dtype=np.float32) * np.float32(255.0))
    arr -= mean
    arr *= inv_std
    pixel_values = np.ascontiguousarray(arr.transpose(2, 0, 1))
    p = config.patch_size
    grid = np.array([1, height // p, width // p], dtype=np.int64)
    return {"pixel_values": pixel_values, "image_grid_thw": grid}


def preprocess(data: bytes, config: ProcessorConfig) -> dict[str, npt.NDArray[Any]]:
    """Decode and preprocess raw image bytes (CPU-heavy: run it off the event loop)."""
    return preprocess_array(decode_image(data, config), config)


def num_image_tokens(grid_thw: npt.NDArray[Any] | list[int], config: ProcessorConfig) -> int:
    """Placeholder tokens one image takes in the prompt: ``t * h * w / merge_size**2``."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (config.merge_size * config.merge_size)


def image_nbytes(item: dict[str, npt.NDArray[Any]]) -> int:
    return sum(int(a.nbytes) for a in item.values())


@lru_cache(maxsize=8)
def _projection(in_dim: int, out_dim: int, seed: int) -> npt.NDArray[np.float64]:
    rng = np.random.default_rng(seed)
    proj = rng.standard_normal((in_dim, out_dim)) / math.sqrt(in_dim)
    proj.flags.writeable = False
    return proj


def embed(pixel_values: npt.NDArray[Any], patch_size: int, *, seed: int = 1234) -> list[float]:
    """A tiny deterministic "vision encoder": mean-pooled patches times a seeded projection."""
    c, height, width = pixel_values.shape
    p = patch_size
    if height % p or width % p:
        raise ValueError(f"pixel_values {pixel_values.shape} is not a whole number of patches")
    patches = (
        pixel_values.reshape(c, height // p, p, width // p, p)
        .transpose(1, 3, 0, 2, 4)
        .reshape(-1, c * p * p)
    )
    pooled = patches.mean(axis=0, dtype=np.float64)
    vec = pooled @ _projection(c * p * p, EMBED_DIM, seed)
    return [float(x) for x in vec]


def summarize(item: dict[str, Any], config: ProcessorConfig) -> dict[str, Any]:
    """What a worker reports for one image: proof that it read exactly the gateway's tensors."""
    pv = item["pixel_values"]
    grid = item["image_grid_thw"]
    if not isinstance(pv, np.ndarray) or not isinstance(grid, np.ndarray):
        raise TypeError("pixel_values and image_grid_thw must be numpy arrays")
    if pv.dtype != np.float32 or pv.ndim != 3 or grid.dtype != np.int64 or grid.shape != (3,):
        raise ValueError(f"unexpected tensors: pixel_values {pv.dtype}{pv.shape}, grid {grid}")
    pv = np.ascontiguousarray(pv)
    return {
        "shape": [int(x) for x in pv.shape],
        "dtype": str(pv.dtype),
        "grid_thw": [int(x) for x in grid],
        "crc32": zlib.crc32(pv.data),
        "nbytes": int(pv.nbytes + grid.nbytes),
        "num_image_tokens": num_image_tokens(grid, config),
        "embedding": embed(pv, config.patch_size),
    }


def expected_summary(data: bytes, config: ProcessorConfig) -> dict[str, Any]:
    """The local computation a response is checked against."""
    out = summarize(preprocess(data, config), config)
    out["mm_hash"] = mm_hash(data, config)
    return out


def synthetic_image(
    seed: int, *, width: int | None = None, height: int | None = None, fmt: str | None = None
) -> bytes:
    """A seeded, photo-like synthetic image (gradients, blobs, noise) as PNG or JPEG bytes."""
    rng = np.random.default_rng(seed)
    w = int(width if width is not None else rng.integers(96, 577))
    h = int(height if height is not None else rng.integers(96, 577))
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.empty((h, w, 3), np.float32)
    for c in range(3):
        fx, fy, ph = rng.uniform(0.5, 6.0), rng.uniform(0.5, 6.0), rng.uniform(0, 2 * math.pi)
        base[..., c] = 127 + 90 * np.sin(2 * math.pi * (fx * x / w + fy * y / h) + ph)
    for _ in range(int(rng.integers(2, 6))):  # a few soft blobs
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        r = rng.uniform(0.05, 0.3) * min(w, h)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
        base += blob[..., None] * rng.uniform(-120, 120, size=3).astype(np.float32)
    base += rng.normal(0, 6, size=base.shape).astype(np.float32)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    fmt = fmt or ("PNG" if seed % 3 == 0 else "JPEG")
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, format="JPEG", quality=88)
    else:
        img.save(buf, format=fmt)
    return buf.getvalue()

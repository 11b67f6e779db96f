"""The demo's settings and their defaults, in one place (the command line reads them from here).

Light on imports (no FastAPI, uvicorn or httpx): the command line builds its flags from these
defaults before it starts anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final, Literal

from aioshmcache import CacheConfig

from .imaging import ProcessorConfig

__all__ = ["DemoOptions", "GatewaySettings", "default_max_object_bytes", "largest_item_bytes"]

_MiB: Final = 1 << 20


def largest_item_bytes(processor: ProcessorConfig) -> int:
    """The largest item the processor makes: float32 ``(3, H, W)`` with ``H*W <= max_pixels``.

    A 1920x1080 photo under the default settings (``max_pixels = 640*640``) is resized to
    840x476 (multiples of 28, aspect kept): 3 * 840 * 476 * 4 = 4,798,080 bytes (4.6 MiB), plus
    the 24-byte ``image_grid_thw``. No image, whatever its size, makes more than this.
    """
    return 3 * processor.max_pixels * 4 + 3 * 8


def default_max_object_bytes(processor: ProcessorConfig) -> int:
    """The default ``max_object_bytes``: the largest item, rounded up to MiB, plus 1 MiB headroom.

    6 MiB under the default processor settings: every photo (1080p, 4K, ...) is cached.
    """
    return (math.ceil(largest_item_bytes(processor) / _MiB) + 1) * _MiB


@dataclass(frozen=True)
class GatewaySettings:
    """Everything the gateway is configured with (the demo CLI maps its flags onto it)."""

    workers: int = 2
    delivery: Literal["broadcast", "one_of_n"] = "broadcast"
    cache_mb: float = 64.0
    #: None: just large enough for the largest image the processor makes (a 1080p photo fits)
    max_object_mb: float | None = None
    cache_enabled: bool = True
    name: str | None = None
    handout_ttl: float = 10.0
    evict_stuck_readers_after: float | None = 30.0
    max_images: int = 8
    max_image_bytes: int = 16 * _MiB
    max_body_bytes: int = 64 * _MiB
    preprocess_threads: int = 2
    worker_timeout: float = 30.0
    worker_loop: Literal["asyncio", "uvloop"] = "asyncio"
    restart_workers: bool = True
    exit_with_parent: bool = False
    processor: ProcessorConfig = field(default_factory=ProcessorConfig)
    #: --gateway-workers N: uvicorn runs N gateway processes; each opens its own shard of this
    #: cache group, and connects to the engine workers the serving process started (they
    #: attach to the group and find the gateways' sockets in ``worker_dir``)
    gateway_processes: int = 1
    group: str | None = None
    worker_dir: str | None = None

    @property
    def max_object_bytes(self) -> int:
        if self.max_object_mb is None:
            return default_max_object_bytes(self.processor)
        return int(self.max_object_mb * _MiB)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            int(self.cache_mb * _MiB),
            self.max_object_bytes,
            self.workers + 1,  # a spare slot: a replacement never waits for a dead one's slot
            name=None if self.group else self.name,
            group=self.group,
            delivery=self.delivery,
            handout_ttl=self.handout_ttl,
            evict_stuck_readers_after=self.evict_stuck_readers_after,
        )


@dataclass
class DemoOptions:
    """What ``python -m aioshmcache demo run`` does (its flags map onto these fields)."""

    requests: int = 300
    concurrency: int = 20
    images: int = 64
    max_per_request: int = 3
    zipf: float = 1.1
    seed: int = 0
    workers: int = GatewaySettings.workers
    delivery: str = GatewaySettings.delivery
    cache_mb: float = GatewaySettings.cache_mb
    max_object_mb: float | None = None  # None: the gateway's default
    loop: str = "auto"
    compare: bool = True
    hash_first: float = 0.2
    gateway_workers: int = 1
    json_path: str | None = None
    progress: bool = True

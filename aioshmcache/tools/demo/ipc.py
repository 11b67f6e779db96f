"""The gateway <-> engine worker messages, on a Unix-domain stream socket.

Each message is one frame of :mod:`aioshmcache.tools.framing` (a 4-byte big-endian length, then
a msgpack map, with a maximum size and explicit decoding limits): the channel is as
hostile-input-proof as the cache itself.

Messages (``t`` is the type)::

    worker -> gateway  {"t": "hello", "worker": i, "pid": pid, "token": secret}
    gateway -> worker  {"t": "infer", "id": n, "features": [feature, ...]}
    worker -> gateway  {"t": "result", "id": n, "ok": true, "results": [summary, ...]}
                       {"t": "result", "id": n, "ok": false, "error": kind, "message": text,
                        "mm_hashes": [...]}       # kind: cache_miss, invalid_reference, ...
    gateway -> worker  {"t": "stop"}

A feature is ``{"mm_hash": h, "ref": ShmRef.to_dict()}`` (the tensors are in shared memory) or
``{"mm_hash": h, "inline": {field: {"dtype": str, "shape": [...], "data": bytes}}}`` (served
inline: too large for the cache, or the cache is off).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from aioshmcache import FeatureSpec, ShmRef

from ..framing import ProtocolError

__all__ = ["decode_feature", "encode_feature"]

_DTYPES: Final = frozenset({"float32", "float16", "int64", "int32", "uint8"})
_MAX_DIMS: Final = 8


def _encode_array(a: npt.NDArray[Any]) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    return {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tobytes()}


def _decode_array(d: object) -> npt.NDArray[Any]:
    if not isinstance(d, dict) or set(d) != {"dtype", "shape", "data"}:
        raise ProtocolError("an inline array is {dtype, shape, data}")
    dtype, shape, data = d["dtype"], d["shape"], d["data"]
    if dtype not in _DTYPES:
        raise ProtocolError(f"inline array dtype {dtype!r} is not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(isinstance(x, int) and 0 <= x < 1 << 40 for x in shape)
    ):
        raise ProtocolError("inline array shape must be a short list of non-negative ints")
    if not isinstance(data, bytes):
        raise ProtocolError("inline array data must be bytes")
    dt = np.dtype(dtype)
    if int(np.prod(shape, dtype=np.int64)) * dt.itemsize != len(data):
        raise ProtocolError("inline array data does not match its dtype and shape")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def encode_feature(f: FeatureSpec) -> dict[str, Any]:
    """A sender's output feature as a message field (a reference, or inline tensors)."""
    if isinstance(f.data, ShmRef):
        return {"mm_hash": f.mm_hash, "ref": f.data.to_dict()}
    if isinstance(f.data, Mapping):
        return {
            "mm_hash": f.mm_hash,
            "inline": {str(k): _encode_array(np.asarray(v)) for k, v in f.data.items()},
        }
    raise ProtocolError(f"feature {f.mm_hash} has neither a reference nor inline data")


def decode_feature(d: object) -> FeatureSpec:
    """The worker's side of :func:`encode_feature` (references are validated by the cache)."""
    if not isinstance(d, dict) or not isinstance(d.get("mm_hash"), str):
        raise ProtocolError("a feature is a map with a string 'mm_hash'")
    h: str = d["mm_hash"]
    if "ref" in d:
        return FeatureSpec(h, ShmRef.from_dict(d["ref"]))
    inline = d.get("inline")
    if not isinstance(inline, dict) or not inline:
        raise ProtocolError(f"feature {h} has neither 'ref' nor 'inline'")
    return FeatureSpec(h, {str(k): _decode_array(v) for k, v in inline.items()})

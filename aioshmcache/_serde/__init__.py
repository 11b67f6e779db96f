"""Serialization straight into shared memory: `MsgpackSerde` and the `Serde` protocol.

A private subpackage: :mod:`.format` is the payload's byte layout and what the reader accepts
(its docstring is the format's reference), :mod:`.encode` the plan and the encoder,
:mod:`.decode` the checks and the compiled headers. The rest of the package imports only the
names this module exports, and :func:`.decode.unpack_bounded` (the bounded msgpack unpacking
other parsers share).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable

import msgpack
import numpy as np

from .._core_api import core
from ..errors import SerdeError
from .decode import (
    _TEMPLATE_HEADER_MAX,
    _TEMPLATE_KEY_MAX,
    _TEMPLATES_MAX,
    _Compiler,
    _Template,
    unpack_bounded,
)
from .encode import (
    _ENC_DTYPES,
    _FLAT_MAX,
    _FLAT_SHAPES_MAX,
    _ZEROS,
    MsgpackPlan,
    _Encoder,
    _fit,
    _frombuffer,
    _Layout,
    _layout,
    _ndarray,
    _new_object,
    _new_plan,
)
from .format import (
    ALIGN_MASK,
    HLEN,
    HLEN_OFFSET,
    MAGIC,
    MAX_DATA_BYTES,
    MAX_NDIM_FORMAT,
    PREFIX,
    PREFIX_SIZE,
    VERSION,
)

__all__ = ["EncodePlan", "MsgpackPlan", "MsgpackSerde", "Serde"]

#: each limit's largest value (the smallest is 1)
_LIMIT_MAX: dict[str, int] = {
    "max_header_bytes": (1 << 32) - 1,
    "max_arrays": 1 << 32,
    "max_ndim": MAX_NDIM_FORMAT,
    "max_depth": 256,
    "max_containers": 1 << 32,
}

#: the copy of a big C-contiguous array into the chunk: the core's (``_core_api``)
_copy_into = core.copy_into


@runtime_checkable
class EncodePlan(Protocol):
    """What :meth:`Serde.plan` returns: everything :meth:`Serde.write` needs, sized exactly."""

    @property
    def nbytes(self) -> int:
        """Exact number of bytes the encoded value occupies."""
        ...


@runtime_checkable
class Serde(Protocol):
    """A pluggable serializer: size first (``plan``), then write into shared memory, then read."""

    def plan(self, obj: object) -> EncodePlan:
        """Walk ``obj`` and size its encoding; copies no array bytes. Raises ``SerdeError``."""
        ...

    def write(self, plan: EncodePlan, buf: memoryview) -> None:
        """Write ``plan`` into ``buf[0:plan.nbytes]`` (a writable, 64-byte aligned uint8 view)."""
        ...

    def read(self, buf: memoryview, *, copy: bool = True) -> object:
        """Decode exactly one payload; arrays are copies, or read-only views with ``copy=False``."""
        ...


# --- the serde --------------------------------------------------------------------------------


class MsgpackSerde:
    """The default :class:`Serde`: a msgpack structure header plus raw, 64-byte aligned arrays.

    The limits bound what :meth:`read` accepts (and :meth:`plan` refuses to produce anything the
    reader would refuse): the structure header's size, the number of arrays (and large bytes
    values), the dimensions of one array, the nesting depth of containers and the number of
    containers (``max_containers``: maps, lists, tuples and numpy scalars, which bounds the
    memory and time a hostile header can cost; see the docstring of
    :mod:`aioshmcache._serde.format`).
    """

    __slots__ = (
        "_local",
        "_shapes",
        "_templates",
        "max_arrays",
        "max_containers",
        "max_depth",
        "max_header_bytes",
        "max_ndim",
    )

    def __init__(
        self,
        *,
        max_header_bytes: int = 1 << 20,
        max_arrays: int = 4096,
        max_ndim: int = 32,
        max_depth: int = 64,
        max_containers: int = 1 << 15,
    ) -> None:
        self.max_header_bytes = max_header_bytes  # each checked by __setattr__
        self.max_arrays = max_arrays
        self.max_ndim = max_ndim
        self.max_depth = max_depth
        self.max_containers = max_containers
        self._local = threading.local()
        # Layouts of flat items (a dict of str -> plain ndarray), by item shape (keys, dtypes,
        # shapes in order): the header depends on nothing else, so a repeated shape skips the
        # walk and the msgpack packing. Only layouts that passed every check are kept.
        self._shapes: dict[tuple[object, ...], _Layout] = {}
        self._templates: dict[bytes, _Template] = {}

    def __setattr__(self, name: str, value: object) -> None:
        # A limit is an int in its range, set in the constructor or later (the compiled plan
        # computes with them as C integers). Cached layouts and templates were validated
        # against the limits: changing one forgets them. The caches are replaced, not cleared,
        # after the limit is set: a walk captures its cache before it reads the limits, so one
        # that read the old limits stores into a cache that is no longer used.
        hi = _LIMIT_MAX.get(name)
        if hi is not None and (type(value) is not int or not 1 <= value <= hi):
            raise ValueError(f"{name} must be an int in [1, {hi}], got {value!r}")
        object.__setattr__(self, name, value)
        if hi is not None and hasattr(self, "_templates"):
            object.__setattr__(self, "_shapes", {})
            object.__setattr__(self, "_templates", {})

    def __repr__(self) -> str:
        return (
            f"MsgpackSerde(max_header_bytes={self.max_header_bytes}, "
            f"max_arrays={self.max_arrays}, max_ndim={self.max_ndim}, max_depth={self.max_depth}, "
            f"max_containers={self.max_containers})"
        )

    def _packer(self) -> msgpack.Packer:
        packer: msgpack.Packer | None = getattr(self._local, "packer", None)
        if packer is None:
            packer = msgpack.Packer(use_bin_type=True, strict_types=True, datetime=False)
            self._local.packer = packer
        return packer

    def plan(self, obj: object) -> EncodePlan:
        """Walk ``obj``, pack its structure header and size the payload (no array bytes copied).

        A flat item (a dict of str keys to plain ndarrays, as preprocessed features are) whose
        shape was planned before reuses that layout: the same keys, dtypes and shapes in the
        same order give the very same header and array offsets.
        """
        if type(obj) is dict:
            shape: list[object] = []
            for k, v in obj.items():
                if type(k) is not str or type(v) is not _ndarray:
                    return self._plan(obj)
                shape += (k, v.dtype, v.shape)
            key = tuple(shape)
            try:
                layout = self._shapes[key]
            except KeyError:
                return self._plan_flat(obj, key)
            # A hit passed every check under the current limits (a change forgets them all).
            # This is _new_plan, inlined: no call on the put path.
            plan = _new_object(MsgpackPlan)
            plan.nbytes = layout[0]
            plan._layout = layout
            plan._sources = tuple(obj.values())
            return plan
        return self._plan(obj)

    def _plan_flat(
        self, obj: dict[str, np.ndarray[Any, Any]], key: tuple[object, ...]
    ) -> MsgpackPlan:
        """Plan a flat item of a shape not seen yet (under these limits), and remember it."""
        shapes = self._shapes  # before the walk reads the limits: see __setattr__
        plan = self._plan(obj)
        if len(obj) <= _FLAT_MAX:
            if len(shapes) >= _FLAT_SHAPES_MAX:
                shapes.clear()
            shapes[key] = plan._layout
        return plan

    def _plan(self, obj: object) -> MsgpackPlan:
        enc = _Encoder(self.max_depth, self.max_ndim, self.max_arrays, self.max_containers)
        try:
            structure = enc.conv(obj, 0)
            header: bytes = self._packer().pack(structure)
        except SerdeError:
            raise
        except MemoryError:
            raise
        except Exception as exc:  # e.g. a surrogate in a str, a hostile __iter__
            raise SerdeError(f"cannot encode value: {exc}") from exc
        if len(header) > self.max_header_bytes:
            raise SerdeError(
                f"structure header of {len(header)} bytes exceeds "
                f"max_header_bytes={self.max_header_bytes} (large str values live in the header)"
            )
        if enc.cursor > MAX_DATA_BYTES:
            raise SerdeError(
                f"the arrays' {enc.cursor} bytes exceed the format's {MAX_DATA_BYTES} bytes"
            )
        chunks = enc.chunks
        return _new_plan(_layout(header, chunks, enc.cursor), tuple([src for _o, src in chunks]))

    def write(self, plan: EncodePlan, buf: memoryview) -> None:
        """Write ``plan`` into ``buf[0:plan.nbytes]``: every byte of it, and nothing else."""
        if type(plan) is not MsgpackPlan and not isinstance(plan, MsgpackPlan):
            raise SerdeError(f"not a plan made by MsgpackSerde: {plan!r}")
        try:  # one frame on the put path: the checks and copies, errors made typed
            nbytes, head, blob, slots, gaps = plan._layout
            if type(buf) is not memoryview:
                buf = memoryview(buf)
            # uint8 and one-dimensional: the store's view already is, so this costs little; a
            # buffer that is not C-contiguous is refused here (TypeError)
            buf = buf.cast("B")
            if buf.readonly or len(buf) != nbytes:
                buf = _fit(buf, nbytes)
            buf[head] = blob  # prefix, header and its padding
            for gap, zeros in gaps:  # every byte is written: the chunk held other data
                buf[gap] = zeros
            for (slot, tiny, small), src in zip(slots, plan._sources):
                if tiny:  # C order whatever the layout; a size changed since plan fails here
                    buf[slot] = src.tobytes()
                    continue
                if small:
                    try:  # the raw bytes of a C-contiguous array, without making a numpy view
                        buf[slot] = src.data.cast("B")
                        continue
                    except (TypeError, ValueError, NotImplementedError):
                        pass  # not C-contiguous, or a dtype with no buffer format: numpy's copy
                start: int = slot.start
                if src.nbytes != slot.stop - start:
                    raise SerdeError("a source array changed size since it was planned")
                if src.nbytes:
                    try:  # the core's copy: streaming stores for big ones, no GIL
                        _copy_into(buf, start, src)
                        continue
                    except TypeError:  # not C-contiguous, or no buffer (datetime): numpy's copy
                        pass
                    dst = _frombuffer(buf, src.dtype, src.size, start)
                    if src.ndim != 1:
                        dst = dst.reshape(src.shape)
                    dst[...] = src  # see .encode's docstring: np.copyto's loop, less overhead
        except SerdeError:
            raise
        except MemoryError:
            raise
        except Exception as exc:  # not a writable contiguous buffer; a source changed since plan
            raise SerdeError(f"cannot write plan: {exc}") from exc

    def _compile(self, header: bytes, data_off: int, data_len: int) -> _Template:
        """Unpack and validate a structure header into a template (``SerdeError`` if invalid).

        ``header`` is a private copy: it is read more than once (checked complete, then
        unpacked), so it must not be shared memory that a writer may change in between.
        """
        try:
            structure = unpack_bounded(header, max_containers=self.max_containers)
        except SerdeError:
            raise
        except Exception as exc:
            raise SerdeError(f"malformed structure header: {exc}") from exc
        comp = _Compiler(data_off, data_len, self.max_depth, self.max_ndim, self.max_arrays)
        build, value = comp.conv(structure, 0)
        if comp.cursor != data_len:
            raise SerdeError("data section holds bytes no array refers to")
        return build, value, data_off + data_len

    def read(self, buf: memoryview, *, copy: bool = True) -> object:
        """Decode one payload (exactly ``nbytes`` long). Anything not in our format: SerdeError."""
        try:
            if type(buf) is not memoryview or buf.format != "B" or buf.ndim != 1:
                buf = (buf if type(buf) is memoryview else memoryview(buf)).cast("B")
            size = len(buf)
            if size >= PREFIX_SIZE:
                # A template is keyed by the prefix and the header: a hit (of the same payload
                # size) implies every check below passed when it was compiled.
                hend = PREFIX_SIZE + HLEN.unpack_from(buf, HLEN_OFFSET)[0]
                if hend <= _TEMPLATE_KEY_MAX:
                    tmpl = self._templates.get(buf[:hend].tobytes())
                    if tmpl is not None and tmpl[2] == size:
                        build = tmpl[0]
                        if build is None:
                            return tmpl[1]
                        return build(buf, buf if copy or buf.readonly else buf.toreadonly(), copy)
            return self._read(buf, size, copy)
        except SerdeError:
            raise
        except MemoryError:
            raise
        except Exception as exc:
            raise SerdeError(f"cannot decode payload: {exc}") from exc

    def _read(self, buf: memoryview, size: int, copy: bool) -> object:
        """``read`` without a template at hand: check the prefix, compile (and keep) one."""
        templates = self._templates  # before the limits are read: see __setattr__
        if size < PREFIX_SIZE:
            raise SerdeError(f"truncated payload ({size} bytes)")
        magic, version, pflags, hlen, data_len = PREFIX.unpack_from(buf)
        if magic != MAGIC:
            raise SerdeError("not an aioshmcache payload (bad magic)")
        if version != VERSION or pflags != 0:
            raise SerdeError(f"unsupported payload version {version} / flags {pflags}")
        if not 0 < hlen <= self.max_header_bytes:
            raise SerdeError(
                f"header length {hlen} outside (0, max_header_bytes={self.max_header_bytes}]"
            )
        hend = PREFIX_SIZE + hlen
        data_off = (hend + ALIGN_MASK) & ~ALIGN_MASK
        if data_off + data_len != size:
            raise SerdeError(
                f"payload is {size} bytes, its prefix says {data_off + data_len} "
                "(truncated or trailing bytes)"
            )
        if hlen > _TEMPLATE_HEADER_MAX:
            # one private copy of the header, which the compile reads twice (not kept)
            build, value, _ = self._compile(buf[PREFIX_SIZE:hend].tobytes(), data_off, data_len)
        else:
            # the key is a private copy, and the template is compiled from that copy: bytes
            # changing in shared memory meanwhile cannot give a key another header's template
            key = buf[:hend].tobytes()
            if PREFIX.unpack_from(key) != (magic, version, pflags, hlen, data_len):
                raise SerdeError("payload prefix changed while it was read")
            tmpl = self._compile(key[PREFIX_SIZE:], data_off, data_len)
            if len(templates) >= _TEMPLATES_MAX:
                templates.clear()
            templates[key] = tmpl
            build, value, _ = tmpl
        if build is None:
            return value
        # copies may come from the writable view; views must come from a read-only one
        return build(buf, buf if copy or buf.readonly else buf.toreadonly(), copy)


# The core's compiled plan (``plan_item``; the one-item miss of a sender calls it first) makes
# the plans ``MsgpackSerde.plan`` makes, for the usual values; it reads these.
core.configure_plan(MsgpackSerde, MsgpackPlan, _ENC_DTYPES, _ZEROS)

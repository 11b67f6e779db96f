"""The pure-Python core: the reference of every function of the compiled ``aioshmcache._core``.

Same names, same results, same errors (``_core_api`` picks one at import; ``AIOSHM_PURE=1``
forces this one). Every argument named a *word* is a 64-bit unsigned integer: an int outside
``[0, 2**64)`` is an ``OverflowError`` and anything else a ``TypeError``, in both.
"""

from __future__ import annotations

import threading
from typing import Any, Final

import numpy as np

from . import _layout as L
from ._types import _M1, _M2, _M3, _M4
from ._types import finish_tag as _finish_tag
from ._types import tag_base as _tag_base

__all__ = [
    "LAYOUT",
    "MapState",
    "ReadCtx",
    "RingState",
    "atom_runs",
    "atom_tuple",
    "bytes_of",
    "chan_call4",
    "chan_call4_frames",
    "chan_cut",
    "chan_frame",
    "chan_ok_frame",
    "chan_ok_result",
    "chan_take_call",
    "chan_unpack",
    "configure",
    "configure_chan",
    "configure_evict",
    "configure_hand_out",
    "configure_plan",
    "configure_specs",
    "copy_info",
    "copy_into",
    "drain_logs",
    "finish_tag",
    "hand_out",
    "keep_updates",
    "loop_turned",
    "loop_turns",
    "make_ref",
    "plan_item",
    "publish_plain",
    "put_item",
    "put_plain",
    "read_item",
    "read_layout",
    "restore_kept",
    "set_stream_kind",
    "set_stream_min",
    "settle_pairs",
    "spec_with",
    "specs_from",
    "split_features",
    "stream_kinds",
    "streamed_copies",
    "tag_base",
]

_U64: Final = (1 << 64) - 1

#: the segment layout constants the compiled core is built with (a test compares the two)
LAYOUT: Final[dict[str, int]] = {
    "MAGIC": L.MAGIC,
    "LAYOUT_VERSION": L.LAYOUT_VERSION,
    "HEADER_SIZE": L.HEADER_SIZE,
    "H_MAGIC": L.H_MAGIC,
    "H_VERSION": L.H_VERSION,
    "H_CAPACITY": L.H_CAPACITY,
    "H_RING_OFF": L.H_RING_OFF,
    "H_NONCE": L.H_NONCE,
    "H_EPOCH": L.H_EPOCH,
    "H_NEXT_ID": L.H_NEXT_ID,
    "H_WAITING": L.H_WAITING,
    "H_HITS": L.H_HITS,
    "H_MISSES": L.H_MISSES,
    "H_BYTES_USED": L.H_BYTES_USED,
    "H_ITEMS": L.H_ITEMS,
    "H_SECRET": L.H_SECRET,
    "H_HEAD_POS": L.H_HEAD_POS,
    "SLOT_HEADER": L.SLOT_HEADER,
    "RS_SESSION": L.RS_SESSION,
    "RS_HEAD": L.RS_HEAD,
    "WS_CONSUMED": L.WS_CONSUMED,
    "WS_OWED": L.WS_OWED,
    "LOG_ENTRY_BYTES": L.LOG_ENTRY_BYTES,
    "CHUNK_HEADER": L.CHUNK_HEADER,
    "CHUNK_MAGIC": L.CHUNK_MAGIC,
    "C_ID": L.C_ID,
    "C_LENGTH": L.C_LENGTH,
    "C_STATE": L.C_STATE,
    "C_CHECK": L.C_CHECK,
    "WRITING": L.WRITING,
    "COMMITTED": L.COMMITTED,
    "FREED": L.FREED,
    "DEAD": L.DEAD,
    "TAG_M1": _M1,
    "TAG_M2": _M2,
    "TAG_M3": _M3,
    "TAG_M4": _M4,
    "PAYLOAD_PREFIX_SIZE": 20,
    "PAYLOAD_ALIGN": 64,
}


def _word(x: object) -> int:
    if not isinstance(x, int):
        raise TypeError(f"expected an int, not {type(x).__name__}")
    if not 0 <= x <= _U64:
        raise OverflowError("a 64-bit word must be an int in [0, 2**64)")
    return x


def tag_base(secret: int, epoch: int, address: int, cid: int, length: int, position: int) -> int:
    """The hand-out-independent part of a reference's tag, as a 64-bit word."""
    return _tag_base(*(_word(x) for x in (secret, epoch, address, cid, length, position))) & _U64


def finish_tag(base: int, seq: int) -> int:
    """The 64-bit tag of hand-out ``seq`` from its :func:`tag_base`."""
    return _finish_tag(_word(base), _word(seq))


#: copies of this many bytes or more go through numpy, which lets go of the GIL (the C core's
#: threshold for the same)
_NOGIL_MIN: Final = 64 * 1024
_stream_min = 64 * 1024


def _contiguous(obj: object, writable: bool, what: str) -> memoryview:
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise
    except Exception:  # e.g. numpy refusing to export a datetime dtype
        raise TypeError(f"{what} does not export its bytes") from None
    if writable and view.readonly:
        raise TypeError(f"{what} must be writable")
    if not view.c_contiguous:
        raise TypeError(f"{what} must be C-contiguous")
    return view


def copy_into(dst: object, offset: int, src: object) -> None:
    """Copy ``src``'s bytes into ``dst[offset:]`` (both C-contiguous buffers, ``dst``
    writable): ``TypeError`` for a wrong buffer, ``ValueError`` if they do not fit. The C core
    uses streaming stores for big copies; the bytes written are the same."""
    if not isinstance(offset, int):
        raise TypeError("offset must be an int")
    d = _contiguous(dst, True, "dst")
    s = _contiguous(src, False, "src")
    n = s.nbytes
    if offset < 0 or offset > d.nbytes or n > d.nbytes - offset:
        raise ValueError("offset out of range")
    if n >= _NOGIL_MIN:
        np.frombuffer(d, np.uint8, n, offset)[...] = np.frombuffer(s, np.uint8)
    elif n:
        d.cast("B")[offset : offset + n] = s.cast("B")


_ATOM_TYPES: Final = frozenset({str, int, float, bool, bytes, type(None)})


def atom_tuple(seq: list[Any]) -> tuple[Any, ...]:
    """``tuple(seq)`` of a ``list`` (``TypeError`` otherwise). The C core untracks it at once
    when it holds no tracked container, as CPython's next collection would after walking it;
    here that collection does."""
    if type(seq) is not list:
        raise TypeError("atom_tuple: a list is expected")
    return tuple(seq)


def atom_runs(seq: list[Any]) -> tuple[Any, ...] | None:
    """A list of atoms (``TypeError`` otherwise: a list of anything else, a subclass of an
    atom type included) as its runs, ``(item, count, ...)``: an item that is the same object as
    the one before it extends that one's run. None when that is not shorter than the list (as
    many runs as half its length, or more). ``_kept``'s atoms: exactly ``str``, ``int``,
    ``float``, ``bool``, ``bytes`` and ``None``."""
    if type(seq) is not list or not all(type(x) in _ATOM_TYPES for x in seq):
        raise TypeError("atom_runs: a list of atoms is expected")
    out: list[Any] = []
    for x in seq:
        if out and out[-2] is x:
            out[-1] += 1
        else:
            out += (x, 1)
    return tuple(out) if len(out) < len(seq) else None


def keep_updates(
    updates: object, how: object, numbers: object, objects: object, max_depth: int, marker: object
) -> Any:
    """The sender's kept form of ``updates`` in one call, which may decline (None): here it
    always does, before any side effect, so ``_kept.keep_py`` (the reference) makes it."""
    return None


def restore_kept(kept: object, objects: object, how: object) -> Any:
    """``(updates,)`` made again from a kept form, which may decline (None): here it always
    does, so ``_kept.restore_py`` (the reference) makes them."""
    return None


def bytes_of(src: object) -> bytes:
    """A new ``bytes`` of ``src``'s bytes (a C-contiguous buffer; ``TypeError`` otherwise).
    The C core copies a big one with the GIL released (another thread's event loop runs on);
    the bytes are the same."""
    return _contiguous(src, False, "src").tobytes()


def copy_info() -> tuple[str, int]:
    """``(kind, stream_min)``: the streaming copy in use (here always ``"memcpy"``: numpy's
    copy) and the size from which the C core would stream."""
    return "memcpy", _stream_min


def streamed_copies() -> int:
    """How many copies took streaming stores in this process: none here (the C core counts
    its streamed copies, for the tests that check a big put streams)."""
    return 0


def set_stream_min(n: int) -> None:
    """Set the size from which copies stream (for benchmarks; no effect on this core)."""
    global _stream_min
    if n < 0:
        raise ValueError("stream_min must be >= 0")
    _stream_min = n


def set_stream_kind(kind: str) -> None:
    """Copy with this streaming kind (for benchmarks): this core has only ``"memcpy"``
    (numpy's copy); any other is a ``ValueError``, as a kind the CPU lacks is in the C core."""
    if not isinstance(kind, str):
        raise TypeError("the streaming kind must be a str")
    if kind != "memcpy":
        raise ValueError(f"streaming kind {kind!r} is not available in the pure core")


def stream_kinds() -> tuple[str, ...]:
    """The copy kinds :func:`set_stream_kind` accepts here: ``("memcpy",)``."""
    return ("memcpy",)


class _LoopTurns(threading.local):
    n = 0


_turns: Final = _LoopTurns()


def loop_turned() -> None:
    """Count a loop turn an I/O callback witnessed, in this thread (``_loop_turns``)."""
    _turns.n += 1


def loop_turns() -> int:
    """The loop turns counted in this thread so far."""
    return _turns.n


def configure(ref_type: type, plan_type: type, serde_type: type) -> None:
    """Name the types :func:`put_plain` recognises (the C core checks them; nothing here)."""
    if not issubclass(ref_type, tuple):
        raise TypeError("the reference type must be a tuple subclass")


def configure_hand_out(
    acks_type: type,
    ledger_type: type,
    debts_type: type,
    slot_state_type: type,
    reader_table_type: type,
) -> None:
    """Name the classes whose state the C core's :func:`hand_out` and :func:`drain_logs` read
    and write (``Acknowledgements``, ``HandoutLedger``, ``Debts``, ``SlotState``,
    ``ReaderTable``; nothing here)."""


def configure_evict(evict_type: type, ahead_puts: int, slack_chunks: int, h_evictions: int) -> None:
    """Name the eviction class and constants the C core's eviction pass in :func:`put_plain`
    follows (``_evict.Eviction``, ``EVICT_AHEAD_PUTS``, ``EVICT_SLACK_CHUNKS``,
    ``H_EVICTIONS``; nothing here: the pure core's puts always decline)."""


def configure_plan(
    serde_type: type, plan_type: type, enc_dtypes: dict[Any, bytes], zeros: memoryview
) -> bool:
    """Name what the C core's :func:`plan_item` reads; here it never runs (``False``)."""
    return False


def plan_item(serde: object, value: object) -> None:
    """The compiled plan of a usual value, which may decline: here it always does, so
    ``MsgpackSerde.plan`` (the reference) plans it."""
    return None


def hand_out(acks: object, cid: int) -> None:
    """The writer's usual hand-out of chunk ``cid``, which may decline: here it always does
    (``Acknowledgements.hand_out`` is the reference)."""
    return None


def settle_pairs(ledger: object, acks: object, session: object) -> tuple[int, int]:
    """``HandoutLedger.settle_all``'s loop as far as the core goes: here not at all
    (``(0, 0)``: nothing settled, no pair gone through), so the ledger's own loop settles
    every pair."""
    return 0, 0


def drain_logs(acks: object) -> None:
    """The writer's usual drain of the readers' logs, which may decline: here it always does
    (``Acknowledgements.drain`` is the reference)."""
    return None


def put_plain(store: object, key: object, plan: object) -> None:
    """The compiled put of a plain item, which may decline: here it always does, before any
    side effect, so the store's own steps (``StoreWriter.put_now``, the reference) run."""
    return None


def put_item(
    store: object, book: object, mm_item: object, mm_hash: object, inline_below: int
) -> None:
    """The compiled one-item call of a sender (a miss, a hit, or a look-up when ``mm_item`` is
    None), which may decline: here it always does, before any side effect, so the sender request
    (``_request.SenderRequest``, the reference) runs."""
    return None


def configure_specs(spec_type: type, ref_type: type) -> None:
    """Name the classes :func:`split_features` and :func:`specs_from` know (``FeatureSpec``,
    ``ShmRef``; nothing here)."""


def split_features(features: object) -> None:
    """A request's features split into specs, items and hashes, which may decline: here it
    always does (``SenderRequest.for_features`` is the reference)."""
    return None


def specs_from(features: object, results: object) -> None:
    """The new specs of a request's results, which may decline: here it always does
    (``_request.features_from`` is the reference)."""
    return None


def spec_with(spec: object, data: object) -> None:
    """A spec's copy carrying ``data``, which may decline: here it always does
    (``FeatureSpec.with_data`` is the reference)."""
    return None


def make_ref(store: object, cid: int, seq: int) -> None:
    """The reference of a hand-out, which may decline: here it always does (the store's own
    ``StoreWriter._ref`` is the reference)."""
    return None


def publish_plain(store: object, key: object, address: int, cid: int, length: int) -> None:
    """The publish of a written chunk, which may decline: here it always does (the store's own
    ``StoreWriter._publish_put`` is the reference)."""
    return None


# --- the writer's counters (``_core_state.c``) ---------------------------------------------------
class RingState:
    """The ring's counters: the base of ``ShmRingBuffer`` (``_ring``, which documents them).

    The compiled core's ``RingState`` holds the same names as C integers that the compiled put
    reads and writes directly; here they are plain slots.
    """

    __slots__ = (
        "_at_mask",
        "_end",
        "_head",
        "_lap",
        "_limit",
        "_mask",
        "_tail",
        "capacity",
        "used_bytes",
    )
    _tail: int
    _limit: int
    _end: int
    _head: int
    _mask: int
    _at_mask: int
    _lap: int
    used_bytes: int
    capacity: int


class MapState:
    """A sharded map's shard mask and entry count: the base of ``ShardedMap`` (the compiled
    core's ``MapState`` holds them as C integers)."""

    __slots__ = ("mask", "n")
    mask: int
    n: int


# --- the channel section (``_core_chan.c``): its reference is the channel's own modules ----------


def configure_chan(spec_type: type, ref_type: type) -> None:
    """Name the classes the channel's call steps know (``FeatureSpec``, ``ShmRef``; nothing
    here)."""


def chan_cut(data: object, max_bytes: int) -> tuple[list[bytes], int] | None:
    """The whole frames at the start of ``data``, which may decline: here it always does
    (``wire.FrameDecoder`` is the reference)."""
    return None


def chan_frame(data: object, max_bytes: int) -> bytes | None:
    """The payload of ``data`` when it is exactly one whole frame, which may decline: here it
    always does (``wire.FrameDecoder`` is the reference)."""
    return None


def chan_unpack(data: object) -> list[Any] | None:
    """A plain envelope under the bounded unpack's rules, which may decline: here it always
    does (``wire.unpack_bounded`` is the reference)."""
    return None


def chan_call4(head: object) -> tuple[Any, list[Any]] | None:
    """A version-4 call's ``(payload, features)``, which may decline: here it always does
    (``_channel_format.decode_call`` is the reference)."""
    return None


def chan_take_call(data: object, max_bytes: int) -> tuple[Any, list[Any]] | None:
    """A version-4 call's ``(payload, features)`` from its two frames' bytes, which may
    decline: here it always does (``wire.FrameDecoder`` then ``decode_call`` are the
    reference)."""
    return None


def chan_ok_frame(result: object, max_bytes: int) -> bytes | None:
    """The plain ok answer's frame, which may decline: here it always does
    (``_channel_format.encode`` and ``wire.frame_parts`` are the reference)."""
    return None


def chan_ok_result(answer: object) -> tuple[Any] | None:
    """``(result,)`` of a plain ok answer, which may decline: here it always does
    (``_channel_format.decode`` is the reference)."""
    return None


def chan_call4_frames(payload: object, features: object, max_bytes: int) -> bytes | None:
    """A version-4 call's two frames as one buffer, which may decline: here it always does
    (``_channel_format.call_frames`` is the reference)."""
    return None


# --- the read section (``_core_read.c``): its reference is ``_core_read_py`` ---------------------
from ._core_read_py import ReadCtx, read_item, read_layout  # noqa: E402

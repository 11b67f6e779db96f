"""The sync caches, their async twins and the vLLM adapter behave the same: one table of
scenarios, every face.

Each scenario drives a sender and a receiver through a ``Face`` (the sync classes called
directly, the async twins awaited, or ``aioshmcache.vllm``'s adapters called the way vLLM's
processor cache is: ``get_and_update(mm_items, mm_hashes)`` in P0, ``get_and_update_features``
in P1) and returns what a user sees: results, raised errors, counters, and the debts left in
the store afterwards. Every face must give equal outcomes.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest

from aioshmcache import (
    AsyncReceiverCache,
    AsyncSenderCache,
    CacheMissError,
    FeatureSpec,
    InvalidReferenceError,
    MsgpackSerde,
    ReceiverCache,
    SenderCache,
    SerdeError,
    ShmRef,
)
from aioshmcache.vllm import VllmReceiverCache, VllmSenderCache

from .helpers import checksum, random_item

KiB = 1 << 10
MiB = 1 << 20


class _FailingSerde(MsgpackSerde):
    """A reader's serde whose every read fails (a decoder limit, a MemoryError, a bug...)."""

    def read(self, view: memoryview, *, copy: bool = True) -> Any:
        raise SerdeError("decoder limit exceeded (test)")


@dataclass
class Face:
    """One face of the caches: every call is awaitable so one scenario serves both."""

    kind: str
    sender: SenderCache
    receiver: ReceiverCache
    send: Callable[..., Awaitable[list[FeatureSpec]]]
    read: Callable[[Sequence[FeatureSpec]], Awaitable[list[FeatureSpec]]]
    read_item: Callable[[Any, str], Awaitable[Any]]


def _faces(sender: SenderCache, receiver: ReceiverCache, kind: str) -> Face:
    if kind == "sync":

        async def send(feats: Sequence[FeatureSpec], **kw: Any) -> list[FeatureSpec]:
            return sender.get_and_update_features(feats, **kw)

        async def read(feats: Sequence[FeatureSpec]) -> list[FeatureSpec]:
            return receiver.get_and_update_features(feats)

        async def read_item(item: Any, h: str) -> Any:
            return receiver.get_and_update_item(item, h)

        return Face(kind, sender, receiver, send, read, read_item)
    if kind == "vllm":  # vLLM's P0 call shape: items (or None for a cached hash) and hashes
        vtx, vrx = VllmSenderCache(sender), VllmReceiverCache(receiver)

        async def send_items(feats: Sequence[FeatureSpec], **kw: Any) -> list[FeatureSpec]:
            items = [None if f.data is None else (f.data, f.prompt_updates) for f in feats]
            out = vtx.get_and_update(items, [f.mm_hash for f in feats], **kw)
            return [FeatureSpec(f.mm_hash, d, prompt_updates=u) for f, (d, u) in zip(feats, out)]

        async def read_vllm(feats: Sequence[FeatureSpec]) -> list[FeatureSpec]:
            return vrx.get_and_update_features(feats)

        async def read_item_vllm(item: Any, h: str) -> Any:
            return vrx.get_and_update_item(item, h)

        return Face(kind, sender, receiver, send_items, read_vllm, read_item_vllm)
    # small threshold: big copies really go through worker threads
    tx = AsyncSenderCache(sender, inline_threshold_bytes=64 * KiB)
    rx = AsyncReceiverCache(receiver, inline_threshold_bytes=64 * KiB)
    return Face(
        kind,
        sender,
        receiver,
        tx.get_and_update_features,
        rx.get_and_update_features,
        rx.get_and_update_item,
    )


def _shape(features: Sequence[FeatureSpec]) -> list[tuple[str, str]]:
    return [(f.mm_hash, "ref" if isinstance(f.data, ShmRef) else "inline") for f in features]


def _content(features: Sequence[FeatureSpec]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for f in features:
        d = f.data
        out.append((f.mm_hash, checksum(d["data"]) == d["crc"] if isinstance(d, dict) else d))
    return out


async def _settle(face: Face) -> dict[str, Any]:
    """Counters and debts once the reader has flushed: what both faces must agree on."""
    face.receiver.get_and_update_features([])  # flushes a locally buffered acknowledgement log
    snap = face.sender.snapshot()
    return {
        "sender": face.sender.make_stats(),
        "receiver": face.receiver.make_stats(),
        "inline": (snap.inline_too_large, snap.inline_full, face.sender.inline_busy),
        "items": snap.items,
        "lag": [r.lag for r in snap.readers if r.attached],
        "freeable": {h: face.sender.is_freeable(h) for h in face.sender.cached_order()},
    }


def _item(rng: np.random.Generator, n: int) -> dict[str, Any]:
    return random_item(rng, n)


# --- the scenarios ------------------------------------------------------------------------
async def sc_hits_and_misses(face: Face, rng: np.random.Generator) -> list[Any]:
    items = {h: _item(rng, n) for h, n in (("a", 200), ("b", 300 * KiB), ("c", 5 * KiB))}
    first = await face.send([FeatureSpec(h, it) for h, it in items.items()])
    again = await face.send([FeatureSpec(h, None) for h in items])
    return [_shape(first), _content(await face.read(first)), _content(await face.read(again))]


async def sc_duplicate_hashes(face: Face, rng: np.random.Generator) -> list[Any]:
    it = _item(rng, 200 * KiB)
    out = await face.send([FeatureSpec("d", it), FeatureSpec("d", it)])
    with pytest.raises(CacheMissError):  # None for a hash neither cached nor given before it
        await face.send([FeatureSpec("e", None), FeatureSpec("e", it)])
    after = await face.send([FeatureSpec("e", it), FeatureSpec("e", None)])  # the item's hit
    again = await face.send([FeatureSpec("d", None), FeatureSpec("d", None)])
    return [
        _shape(out),
        _shape(after),
        _content(await face.read(out)),
        _content(await face.read(after)),
        _content(await face.read(again)),
    ]


async def sc_oversize(face: Face, rng: np.random.Generator) -> list[Any]:
    big = _item(rng, 3 * MiB)  # max object is 1 MiB
    out = await face.send([FeatureSpec("big", big), FeatureSpec("ok", _item(rng, 10))])
    again = await face.send([FeatureSpec("big", big)])  # remembered: not serialised again
    return [_shape(out), _shape(again), _content(await face.read(out))]


async def _fill(face: Face, rng: np.random.Generator) -> list[FeatureSpec]:
    """Fill the 4 MiB ring with hand-outs nobody has read yet."""
    return await face.send([FeatureSpec(f"f{i}", _item(rng, 900 * KiB)) for i in range(4)])


async def sc_full_no_wait(face: Face, rng: np.random.Generator) -> list[Any]:
    held = await _fill(face, rng)
    out = await face.send([FeatureSpec("new", _item(rng, 900 * KiB))])
    return [_shape(held), _shape(out), _content(await face.read(held))]


async def sc_full_wait_nobody_reads(face: Face, rng: np.random.Generator) -> list[Any]:
    held = await _fill(face, rng)
    new = [FeatureSpec(f"n{i}", _item(rng, 900 * KiB)) for i in range(3)]
    out = await face.send(new, wait_for_space=0.2)  # one deadline for the whole call
    return [_shape(held), _shape(out), _content(await face.read(held))]


async def sc_full_wait_reader_acks(face: Face, rng: np.random.Generator) -> list[Any]:
    held = await _fill(face, rng)
    reader = threading.Thread(target=lambda: face.receiver.get_and_update_features(held[:1]))
    timer = threading.Timer(0.2, reader.start)
    timer.start()
    try:
        out = await face.send([FeatureSpec("w", _item(rng, 900 * KiB))], wait_for_space=30)
    finally:
        timer.join()
        await anyio.to_thread.run_sync(reader.join, 30)
    return [_shape(out), _content(await face.read(held[1:] + out))]


async def sc_stale_reference(face: Face, rng: np.random.Generator) -> list[Any]:
    out = await face.send([FeatureSpec("s", _item(rng, 300 * KiB)), FeatureSpec("t", {"x": 1})])
    face.sender.clear()
    fresh = await face.send([FeatureSpec("u", _item(rng, 100))])
    with pytest.raises(CacheMissError) as info:
        await face.read(out + fresh)
    with pytest.raises(Exception) as item_error:
        await face.read_item(out[0].data, "s")
    return [info.value.mm_hashes, type(item_error.value).__name__]


async def sc_forged_reference(face: Face, rng: np.random.Generator) -> list[Any]:
    out = await face.send([FeatureSpec("g", _item(rng, 300 * KiB)), FeatureSpec("h", {"x": 1})])
    ref = out[0].data
    forged = FeatureSpec("x", ref._replace(length=ref.length + 64))
    with pytest.raises(InvalidReferenceError):
        await face.read([*out, forged])  # fails at once; the valid ones are given back
    return [_shape(out)]


async def sc_failed_decode(face: Face, rng: np.random.Generator) -> list[Any]:
    sizes = (10, 600 * KiB)
    out = await face.send([FeatureSpec(f"e{i}", _item(rng, n)) for i, n in enumerate(sizes)])
    failing = ReceiverCache.attach(face.sender.handle(), serde=_FailingSerde())
    try:
        other = _faces(face.sender, failing, face.kind)
        with pytest.raises(SerdeError):
            await other.read(out)
        with pytest.raises(SerdeError):
            await other.read_item(out[1].data, "e1")
        failing.get_and_update_features([])  # flush: what it gave back reaches the writer
        result = [_shape(out), {r.slot: r.lag for r in face.sender.snapshot().readers}]
    finally:
        failing.close()
    await face.read(out)  # the healthy reader settles its own share
    return result


SCENARIOS: dict[str, Callable[[Face, np.random.Generator], Awaitable[list[Any]]]] = {
    "hits_and_misses": sc_hits_and_misses,
    "duplicate_hashes": sc_duplicate_hashes,
    "oversize": sc_oversize,
    "full_no_wait": sc_full_no_wait,
    "full_wait_nobody_reads": sc_full_wait_nobody_reads,
    "full_wait_reader_acks": sc_full_wait_reader_acks,
    "stale_reference": sc_stale_reference,
    "forged_reference": sc_forged_reference,
    "failed_decode": sc_failed_decode,
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_sync_async_and_vllm_faces_agree(make_config: Any, scenario: str) -> None:
    outcomes = {}
    for kind in ("sync", "async", "vllm"):
        cfg = make_config(4 * MiB, MiB, 2, name=f"{make_config().name}-{kind}")
        with SenderCache(cfg) as tx, ReceiverCache.attach(tx.handle()) as rx:
            face = _faces(tx, rx, kind)
            seen = await SCENARIOS[scenario](face, np.random.default_rng(7))
            outcomes[kind] = (seen, await _settle(face))
    assert outcomes["sync"] == outcomes["async"] == outcomes["vllm"]


@pytest.mark.parametrize("delay", [0, 0.0005, 0.003, 0.02])
async def test_cancelled_request_leaves_what_an_abandoned_sync_request_leaves(
    make_config: Any, delay: float
) -> None:
    """Cancellation (the async face's own case) ends like a sync request that failed: nothing
    owed, pinned or half-allocated, and the next request of the same items works."""
    rng = np.random.default_rng(1)
    feats = [FeatureSpec(f"c{i}", _item(rng, 2 * MiB)) for i in range(3)]
    ends = {}
    for kind in ("sync", "async"):
        cfg = make_config(16 * MiB, 4 * MiB, 1, name=f"{make_config().name}-{kind}")
        with SenderCache(cfg) as tx, ReceiverCache.attach(tx.handle()) as rx:
            if kind == "sync":
                req = tx._features_request(feats, copy_inline_below=64 * KiB)
                req.begin()
                req.abandon()  # what a failure before the copies does
            else:
                tx_async = AsyncSenderCache(tx, inline_threshold_bytes=64 * KiB)
                got: list[FeatureSpec] = []
                with anyio.move_on_after(delay):  # mid-copy, in the worker thread, or before
                    got = await tx_async.get_and_update_features(feats)
                await tx_async.aclose()  # waits for a thread that may still run
                await _read_all(rx, got)  # a call that finished first handed out: settle
            rx.get_and_update_features([])
            ends[kind] = (
                all(tx.is_freeable(h) for h in tx.cached_order()),
                tx.snapshot().readers[0].lag,
            )
            out = tx.get_and_update_features(feats)  # the cache still works
            back = await _read_all(rx, out)
            assert [_content([f]) for f in back] == [[(f.mm_hash, True)] for f in feats]
    assert ends == {"sync": (True, 0), "async": (True, 0)}


async def _read_all(rx: ReceiverCache, feats: list[FeatureSpec]) -> list[FeatureSpec]:
    return rx.get_and_update_features(feats)


def _public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        n: inspect.signature(m)
        for n, m in inspect.getmembers(cls, callable)
        if not n.startswith("_")
    }


@pytest.mark.parametrize(
    ("sync", "aio"), [(SenderCache, AsyncSenderCache), (ReceiverCache, AsyncReceiverCache)]
)
def test_twins_have_the_same_signatures(sync: type, aio: type) -> None:
    """Names, parameters (name, kind, default) match; the async twin may only add options."""
    ours, theirs = _public_methods(sync), _public_methods(aio)
    skip = {"close", "attach"}  # attach: see below
    for name, sig in ours.items():
        if name in skip:
            continue
        assert name in theirs, f"{aio.__name__} lacks {name}"
        a = theirs[name].parameters
        for pname, p in sig.parameters.items():
            assert pname in a, f"{aio.__name__}.{name} lacks parameter {pname}"
            q = a[pname]
            assert (q.kind, q.default) == (p.kind, p.default), f"{name}({pname})"
        extra = [q for q in a.values() if q.name not in sig.parameters]
        assert all(q.kind is q.KEYWORD_ONLY for q in extra), f"{name}: {extra}"
    assert "aclose" in theirs and "close" not in theirs
    if sync is ReceiverCache:  # attach(handle, ...) exists on both; the async one is not awaited
        attach = AsyncReceiverCache.attach
        assert next(iter(inspect.signature(attach).parameters)) == "handle"
        assert not inspect.iscoroutinefunction(attach)


# --- the sender's one-item call is a one-item request (one algorithm, issue 20) --------------


class _FailingWriteSerde(MsgpackSerde):
    """A writer's serde whose copy into the chunk fails (after the chunk was allocated)."""

    def write(self, plan: Any, buf: memoryview) -> None:
        raise SerdeError("copy failed (test)")


def _one_item_steps(tx: SenderCache, put: Callable[[Any, Any], Any]) -> list[Any]:
    """What a user sees of a sequence of one-item calls: each result or error, then counters."""
    rng = np.random.default_rng(3)
    items = {h: (random_item(rng, 60 * KiB), (f"upd-{h}",)) for h in "abcdef"}
    big = (random_item(rng, 150 * KiB), ("upd-big",))  # over max_object_bytes
    seen: list[Any] = []

    def step(mm_item: Any, h: Any) -> None:
        try:
            data, updates = put(mm_item, h)
        except Exception as exc:
            seen.append(("raised", type(exc).__name__))
            return
        if isinstance(data, ShmRef):
            seen.append(("ref", data.id, data.length, data.seq, updates))
        else:
            seen.append(("inline", data is (mm_item or (None,))[0], updates))

    step(items["a"], "a")  # a put
    step(items["a"], "a")  # a hit
    step(None, "a")  # a look-up: the updates stored with the put
    step(None, "zz")  # not cached: CacheMissError
    step(big, "big")  # too large: inline
    step(big, "big")  # known too large: inline, not serialised again
    putting = tx._request([items["b"]], ["b"], copy_inline_below=0)
    putting.begin()  # "b" is being put (a copy job not run yet)
    step(items["b"], "b")  # busy: inline
    putting.run_jobs()
    putting.finish()
    for h in "cdef":  # nobody reads: the owed items fill the ring, then the rest is inline
        step(items[h], h)
    step(items["a"], 7)  # a hash that is not a str
    step(["not", "a", "tuple"], "a")
    snap = tx.snapshot()
    counters = ("hits", "misses", "inline_too_large", "inline_full", "items", "evictions")
    seen.append([getattr(snap, c) for c in counters])
    seen.append((tx.inline_busy, dict(tx._prompt_updates)))
    return seen


def test_get_and_update_item_is_a_one_item_request(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SenderCache.get_and_update_item`` is ``get_and_update`` of one item: every outcome,
    counter and side table equals the request's. Its only other path is the core's compiled
    one-item miss (``_request.run_one``): with the pure core (which declines every call) every
    call, the usual cases included, runs exactly one ``SenderRequest``; with the C core the
    plain misses run none, and the outcomes are the same."""
    import aioshmcache.cache as cache_module
    from aioshmcache import _core_py, _request
    from aioshmcache._request import SenderRequest

    made: list[int] = []

    class Counting(SenderRequest):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cache_module, "SenderRequest", Counting)
    monkeypatch.setattr(_request, "SenderRequest", Counting)
    outcomes = {}
    calls = 0
    for kind in ("one_item", "one_item_pure", "request"):
        cfg = make_config(256 * KiB, 100 * KiB, 1, name=f"{make_config().name}-{kind}")
        with monkeypatch.context() as m:
            if kind == "one_item_pure":
                m.setattr(_request, "_put_item", _core_py.put_item)
            with SenderCache(cfg) as tx, ReceiverCache.attach(tx.handle()):
                if kind == "request":
                    outcomes[kind] = _one_item_steps(
                        tx, lambda it, h: tx.get_and_update([it], [h])[0]
                    )
                    continue
                made.clear()
                outcomes[kind] = _one_item_steps(tx, tx.get_and_update_item)
                if kind == "one_item_pure":
                    requests_made = len(made)
                    calls = len(outcomes[kind]) - 2  # the last two entries are the counters
    assert outcomes["one_item"] == outcomes["request"] == outcomes["one_item_pure"]
    assert outcomes["one_item"][0][0] == "ref" and outcomes["one_item"][1][0] == "ref"
    # one request per call, and the scenario's own (the request left putting "b")
    assert calls == 13 and requests_made == calls + 1


def test_a_failed_copy_on_the_one_item_path_leaves_nothing(make_config: Any) -> None:
    """The copy into the chunk fails: the error reaches the caller, the allocation is aborted
    (reclaimed in FIFO order), nothing is cached or owed, as for a request."""
    for kind in ("one_item", "request"):
        cfg = make_config(256 * KiB, 100 * KiB, 1, name=f"{make_config().name}-{kind}")
        with SenderCache(cfg, serde=_FailingWriteSerde()) as tx:
            item = ({"data": np.arange(100)}, ())
            with pytest.raises(SerdeError):
                if kind == "one_item":
                    tx.get_and_update_item(item, "a")
                else:
                    tx.get_and_update([item], ["a"])
            assert not tx.is_cached("a")
            tx.remove_dangling_items()
            snap = tx.snapshot()
            assert (snap.items, snap.bytes_used, snap.misses) == (0, 0, 1)


async def _one_spec_reads(
    tx: SenderCache, read: Callable[[list[FeatureSpec]], Awaitable[list[FeatureSpec]]]
) -> list[Any]:
    """What a reader's caller sees of one-spec ``get_and_update_features`` calls (each result
    or error, then the reader's counters and the writer's view of its acknowledgements)."""
    rng = np.random.default_rng(5)
    seen: list[Any] = []

    async def step(f: FeatureSpec) -> None:
        try:
            [out] = await read([f])
        except (CacheMissError, InvalidReferenceError, TypeError) as exc:
            features = getattr(exc, "features", None)
            seen.append(("raised", type(exc).__name__, str(exc), features))
            return
        data = out.data
        body = (checksum(data["data"]), data["crc"]) if isinstance(data, dict) else data
        seen.append(("ok", out.mm_hash, out.identifier, out.prompt_updates, body))

    def hand_out(h: str, nbytes: int) -> FeatureSpec:
        item = random_item(rng, nbytes)
        [f] = tx.get_and_update_features([FeatureSpec(h, item)])
        return f

    await step(hand_out("w", KiB))  # the first read probes the writer: the request's way
    a = hand_out("a", 2 * KiB)
    await step(FeatureSpec("a", a.data, identifier="img-a"))  # the usual read
    await step(FeatureSpec("inline", "x"))  # inline: unchanged
    await step(FeatureSpec("a", None))  # no data: unchanged
    big = hand_out("big", 40 * KiB)
    await step(big)  # over the async face's threshold below: a copy job there
    forged = a.data._replace(tag=a.data.tag ^ 1)
    await step(FeatureSpec("a", forged))  # InvalidReferenceError
    await step(FeatureSpec(7, a.data))  # type: ignore[arg-type]  # a hash that is not a str
    stale = hand_out("b", KiB)
    tx.clear()
    await step(stale)  # CacheMissError, its spec without data in ``features``
    c = hand_out("c", KiB)
    await step(c)
    seen.append(tx.store.reader_info())
    return seen


async def test_a_one_spec_read_is_a_one_spec_request(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``get_and_update_features`` of one spec by reference, sync and async, reads it in one core
    call (``_receiver_request.read_one_feature``, no ``ReceiverRequest``) where the core reads
    (the C core); the answers, errors, counters and acknowledgements equal the request's."""
    import aioshmcache
    import aioshmcache.cache as cache_module
    from aioshmcache._receiver_request import ReceiverRequest

    made: list[int] = []

    class Counting(ReceiverRequest):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cache_module, "ReceiverRequest", Counting)
    # which path a read takes must not depend on time: no yield falls due on the async face
    # (every ~0.5 ms otherwise), and the writer's liveness probe (every 0.25 s otherwise, the
    # core declining the read that is due to probe) is not due either
    monkeypatch.setattr(AsyncReceiverCache, "_due", lambda self: False)
    outcomes: dict[str, list[Any]] = {}
    requests: dict[str, int] = {}
    for face in ("sync", "async"):
        for path in ("one_spec", "request"):
            kind = f"{face}-{path}"
            cfg = make_config(512 * KiB, 100 * KiB, 1, name=f"{make_config().name}-{kind}")
            with monkeypatch.context() as m:
                if path == "request":
                    m.setattr(cache_module, "read_one_feature", lambda *a: None)
                with SenderCache(cfg) as tx, ReceiverCache.attach(tx.handle()) as rx:
                    rx.store.read_path.probe_interval = 3600.0
                    made.clear()
                    if face == "sync":

                        async def read(fs: list[FeatureSpec]) -> list[FeatureSpec]:
                            return rx.get_and_update_features(fs)

                        outcomes[kind] = await _one_spec_reads(tx, read)
                    else:
                        async with AsyncReceiverCache(rx, inline_threshold_bytes=32 * KiB) as arx:
                            outcomes[kind] = await _one_spec_reads(tx, arx.get_and_update_features)
                    outcomes[kind].append(rx.make_stats())
                    requests[kind] = len(made)
    assert outcomes["sync-one_spec"] == outcomes["sync-request"]
    assert outcomes["async-one_spec"] == outcomes["async-request"]
    assert outcomes["sync-request"][1][0] == "ok" and outcomes["sync-request"][7][0] == "raised"
    assert requests["sync-request"] == requests["async-request"] == 9  # one per read
    if aioshmcache.implementation() == "c":
        # the two usual reads and the sync face's big one take no request (the core declines
        # the stale and the forged reference: the request raises their errors)
        assert requests["sync-one_spec"] == 9 - 3
        assert requests["async-one_spec"] == 9 - 2

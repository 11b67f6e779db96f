"""Layer 5: the object store against a model, real reader processes, and hostile references."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, assert_type

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aioshmcache import (
    CacheConfig,
    CacheFullError,
    DuplicateKeyError,
    InvalidReferenceError,
    ObjectTooLargeError,
    ReceiverCache,
    RoleError,
    SenderCache,
    ShmObjectStore,
    ShmRef,
    StaleReferenceError,
    _core_py,
)
from aioshmcache import _layout as L
from aioshmcache._inspect import inspect_segment, read_snapshot
from aioshmcache._layout import H_SECRET, chunk_size
from aioshmcache._types import reference_tag
from aioshmcache.store import EncodePlan, MsgpackSerde, StoreReader, StoreWriter

from .helpers import SPAWN, HookAfterRead, checksum

KEYS = [f"k{i}" for i in range(6)]  # few: the ring fills, wraps and evicts often


class StoreModel(RuleBasedStateMachine):
    """Writer + 2 in-process readers vs a model of hand-outs, acknowledgements and second chance.

    A hit (``get_cached``) marks a key; a put may then move marked free keys from the head to the
    tail (at most ``BUDGET`` bytes of chunks per put) and evict free ones. The model checks that
    the store's new order is exactly that: a suffix of the old order, then the relocated keys in
    their old order; every evicted key was free, every relocated one free and marked; every
    reference to a relocated key's old chunk is stale (a typed error, never data).
    """

    SECOND_CHANCE = True
    BUDGET = 2048

    def __init__(self) -> None:
        super().__init__()
        self.store = ShmObjectStore.create(
            CacheConfig(4096, 4000, 2, ack_log_entries=64, second_chance=self.SECOND_CHANCE)
        )
        self.store.relocate_budget = self.BUDGET
        self.readers = [ShmObjectStore.from_handle(self.store.handle()) for _ in range(2)]
        self.order: list[str] = []  # model FIFO of cached keys
        self.data: dict[str, bytes] = {}
        # key -> every hand-out made: [reference, readers that still owe it]
        self.handouts: dict[str, list[tuple[ShmRef, set[int]]]] = {}
        self.refs: dict[str, ShmRef] = {}  # the current chunk's reference
        self.touched: set[str] = set()
        self.marked: set[str] = set()  # hit since put or relocated
        self.stale: list[ShmRef] = []  # references to chunks that were relocated away
        self.relocated: list[str] = []  # what the store relocated during the last put, in order
        ring = self.store.ring
        relocate_head = ring.relocate_head

        def spy() -> tuple[int, int, int] | None:  # the store moves its head chunk: which key?
            cid = ring.head_id
            key = None if cid is None else self.store.key_of(cid)
            assert key is not None
            self.relocated.append(key)
            return relocate_head()

        ring.relocate_head = spy  # type: ignore[method-assign]

    def teardown(self) -> None:
        for r in self.readers:
            r.close()
        self.store.close()

    def _free(self, k: str) -> bool:
        return not any(p for _r, p in self.handouts[k]) and k not in self.touched

    def _sync_evictions(self, before: list[str], new: str | None = None) -> None:
        fifo = self.store.keys()  # oldest first
        now = [k for k in fifo if k != new]
        ids = {k: ref.id for k in now if (ref := self.store.ref_of(k)) is not None}
        moved = [k for k in now if ids[k] != self.refs[k].id]  # relocated: a new chunk
        kept = [k for k in now if k not in moved]
        assert now == kept + moved, "relocated items are not at the tail"
        j = len(before) - len(kept)
        assert before[j:] == kept, "eviction is not FIFO"
        head = before[:j]
        relocated, self.relocated = self.relocated, []
        assert [k for k in head if k in moved] == moved, "not FIFO: moved out of order"
        assert [k for k in relocated if k in now] == moved
        assert self.SECOND_CHANCE or not relocated, "relocated although second chance is off"
        spent = 0
        for k in head:  # relocations in head order, each within the put's budget
            size = chunk_size(self.refs[k].length)
            if k in relocated:
                spent += size
            elif k in self.marked and self.SECOND_CHANCE and all(map(self._free, before)):
                # (with a blocked key ahead the pass may fall back to FIFO: see _reclaim)
                assert spent + size > self.BUDGET, f"{k} was hit, free and in budget: evicted"
        assert spent <= self.BUDGET
        for k in head:
            assert self._free(k), f"{k} evicted or relocated while owed / touched"
            for ref, _p in self.handouts[k]:
                self.stale.append(ref)
            if k in moved:
                assert k in self.marked, f"{k} relocated without a hit"
                self.marked.discard(k)
                ref = self.store.ref_of(k)
                assert ref is not None and ref.id > self.refs[k].id
                assert ref.position > self.refs[k].position
                self.refs[k] = ref
                self.handouts[k] = []
                continue
            del self.handouts[k], self.data[k], self.refs[k]
            self.touched.discard(k)
            self.marked.discard(k)
        self.order = list(now)

    @rule(key=st.sampled_from(KEYS), size=st.integers(500, 1800), read=st.booleans())
    def put(self, key: str, size: int, read: bool) -> None:
        blob = os.urandom(size)
        before = list(self.order)
        if key in self.order:
            with pytest.raises(DuplicateKeyError):
                self.store.put(key, {"b": blob})
            return
        try:
            ref = self.store.put(key, {"b": blob})
        except CacheFullError:
            self._sync_evictions(before)
            assert self.order and not self._free(self.order[0]), "full although the head is free"
            return
        self._sync_evictions(before, key)
        self.order.append(key)
        self.data[key] = blob
        self.handouts[key] = [(ref, {0, 1})]
        self.refs[key] = ref
        assert self.store.keys() == self.order
        if read:
            self.read_all(key)

    @rule(key=st.sampled_from(KEYS), read=st.booleans())
    def hand_out(self, key: str, read: bool) -> None:
        """A hit; with ``read``, both readers read it at once (a free, marked key)."""
        ref = self.store.get_cached(key)
        if key not in self.order:
            assert ref is None
            return
        assert ref is not None and (ref.id, ref.address) == (
            self.refs[key].id,
            self.refs[key].address,
        )
        assert all(ref.seq != r.seq for r, _p in self.handouts[key])
        self.handouts[key].append((ref, {0, 1}))
        self.touched.discard(key)
        self.marked.add(key)
        if read:
            self.read_all(key)

    @rule(which=st.integers(0, 1000), reader=st.integers(0, 1))
    def read_stale(self, which: int, reader: int) -> None:
        """A reference to a chunk relocated away is stale: a typed error, never data."""
        if not self.stale:
            return
        with pytest.raises(StaleReferenceError):
            self.readers[reader].get(self.stale[which % len(self.stale)])
        with pytest.raises(StaleReferenceError):
            self.store.get(self.stale[which % len(self.stale)])
        assert self.store.release(self.stale[which % len(self.stale)]) is False

    @rule(key=st.sampled_from(KEYS), reader=st.integers(0, 1), late=st.booleans())
    def read(self, key: str, reader: int, late: bool) -> None:
        if key not in self.order:
            return
        owed = [(r, p) for r, p in self.handouts[key] if reader in p]
        if not owed:
            if late and self.handouts[key]:  # reading a hand-out already read settles nothing
                ref = self.handouts[key][0][0]
                assert self.readers[reader].get(ref) == {"b": self.data[key]}
            return
        ref, pending = owed[-1] if late else owed[0]
        value = self.readers[reader].get(ref)
        assert value == {"b": self.data[key]}
        pending.discard(reader)

    @rule(key=st.sampled_from(KEYS))
    def read_all(self, key: str) -> None:
        """Both readers read every hand-out of ``key`` they owe (the key becomes free)."""
        for ref, pending in self.handouts.get(key, []):
            for reader in sorted(pending):
                assert self.readers[reader].get(ref) == {"b": self.data[key]}
            pending.clear()

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: str) -> None:
        assert self.store.touch(key) == (key in self.order)
        if key in self.order:
            self.touched.add(key)

    @rule(key=st.sampled_from(KEYS), which=st.integers(0, 50))
    def release(self, key: str, which: int) -> None:
        if key not in self.order or not self.handouts[key]:  # none since it was relocated
            return
        ref, pending = self.handouts[key][which % len(self.handouts[key])]
        ok = self.store.release(ref)
        assert ok == bool(pending)  # exactly that hand-out, if anyone still owes it
        pending.clear()

    @precondition(lambda self: len(self.stale) > 3)  # rarely: let the ring fill and wrap first
    @rule()
    def clear(self) -> None:
        old = dict(self.refs)
        self.store.clear()
        self.order.clear()
        self.data.clear()
        self.handouts.clear()
        self.refs.clear()
        self.touched.clear()
        self.marked.clear()
        for ref in old.values():
            with pytest.raises(StaleReferenceError):
                self.readers[0].get(ref)

    @invariant()
    def consistent(self) -> None:
        assert self.store.keys() == self.order
        for k in self.order:
            assert self.store.is_freeable(k) == self._free(k)
            assert self.store.get(self.refs[k]) == {"b": self.data[k]}  # every live key's bytes


class FifoStoreModel(StoreModel):
    """The same model with ``second_chance=False``: pure FIFO, hits or not."""

    SECOND_CHANCE = False


TestStoreModel = StoreModel.TestCase
TestStoreModel.settings = settings(  # ~30 relocations and ~120 evictions per run (measured)
    max_examples=120,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFifoStoreModel = FifoStoreModel.TestCase
TestFifoStoreModel.settings = settings(
    max_examples=40,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_put_checks_size_before_copy_and_keys(make_config: Any) -> None:
    with ShmObjectStore.create(make_config(1 << 16, 1 << 12, 1)) as store:
        with pytest.raises(ObjectTooLargeError) as ei:
            store.put("big", {"a": np.zeros(1 << 13, np.uint8)})
        assert isinstance(ei.value, ValueError)
        assert store.ring.n_chunks == 0  # nothing allocated
        store.put("a", {"x": 1})
        with pytest.raises(DuplicateKeyError):
            store.put("a", {"x": 2})
        with pytest.raises(TypeError):
            store.put(1, {"x": 1})  # type: ignore[arg-type]


def test_a_small_put_waits_for_space_as_the_config_says(make_config: Any) -> None:
    """``put`` without ``wait_for_space`` waits the config's default, small values too (they
    take the one-step put only when there is no wait to make), and waits nothing with 0."""
    import threading

    cfg = make_config(1 << 16, 1 << 14, 1, wait_for_space=10.0)
    with ShmObjectStore.create(cfg) as store:
        reader = ShmObjectStore.from_handle(store.handle())
        try:
            owed = [store.put(f"o{i}", {"b": b"x" * 12000}) for i in range(5)]  # the ring is full
            with pytest.raises(CacheFullError):
                store.put("now", {"b": b"y" * 12000}, wait_for_space=0)

            def ack_all() -> None:
                for r in owed:
                    reader.ack(r)

            acks = threading.Timer(0.3, ack_all)
            acks.start()
            try:
                ref = store.put("later", {"b": b"z" * 12000})  # waits until the reader acks
            finally:
                acks.join()
            assert store.is_cached("later") and store.wakeups >= 1
            assert reader.get(ref)["b"] == b"z" * 12000
        finally:
            reader.close()


def test_eviction_frees_until_contiguous_room(make_config: Any) -> None:
    with ShmObjectStore.create(make_config(1 << 16, 40000, 1)) as store:
        for i in range(30):  # small items, no readers attached: all free
            store.put(f"s{i}", {"b": b"x" * 1500})
        store.put("big", {"b": b"y" * 39000})  # needs many small ones gone, not a fixed count
        assert store.is_cached("big")
        assert store.evictions > 10


@pytest.mark.parametrize("wait", [None, 0.01])  # the one-step put, and reserve / abort
def test_a_failed_put_that_evicted_publishes_what_is_left(make_config: Any, wait: Any) -> None:
    """A put whose copy fails after its room was made: the items it evicted are gone from the
    header too, so what ``inspect`` and the collectors read equals the writer's own count."""

    class FailingWrite(MsgpackSerde):
        fail = False

        def write(self, plan: EncodePlan, buf: memoryview) -> None:
            if self.fail:
                raise RuntimeError("the copy failed")
            super().write(plan, buf)

    serde = FailingWrite()
    with ShmObjectStore.create(make_config(16384, 8000, 2), serde=serde) as store:
        store.evict_slack = 0
        for i in range(5):  # no reader attached: every item is free
            store.put(f"k{i}", {"b": b"x" * 3000})
        serde.fail = True
        with pytest.raises(RuntimeError, match="the copy failed"):
            store.put("new", {"b": b"y" * 3000}, wait_for_space=wait)
        assert store.evictions >= 1 and len(store) < 5
        outside, _alive = read_snapshot(store.name)
        assert (outside.items, outside.bytes_used, outside.evictions) == (
            len(store),
            store.ring.used_bytes,
            store.evictions,
        )


def test_a_put_abandoned_waiting_for_space_publishes_what_its_pass_evicted(
    make_config: Any,
) -> None:
    """A reservation whose pass evicted the free head, then waited on an owed item and was
    abandoned (``CacheFullError``): the header counts the items and bytes left, as the writer."""
    with ShmObjectStore.create(make_config(16384, 8000, 2)) as store:
        store.evict_slack = 0
        store.put("k0", {"b": b"x" * 3000})  # no reader yet: free
        with ShmObjectStore.from_handle(store.handle()):
            for i in range(1, 5):
                store.put(f"k{i}", {"b": b"x" * 3000})  # owed by the reader
            plan = store.plan({"b": b"y" * 6000})
            with pytest.raises(CacheFullError, match="abandoned"):
                store.reserve("new", plan, wait_for_space=5.0, abort=lambda: True)
            assert store.evictions == 1 and len(store) == 4
            outside, _alive = read_snapshot(store.name)
            assert (outside.items, outside.bytes_used) == (len(store), store.ring.used_bytes)


def test_pinned_unpins_the_entry_a_key_appended_named_not_a_newer_one(make_config: Any) -> None:
    """``pinned``: a key pinned with ``pin`` and appended in the block, then invalidated and put
    again (another request pinning the new entry): the exit unpins the entry its pin holds.
    Unpinning by key took the other request's pin of the new entry (freeable while pinned) and
    left the old one pinned for ever, blocking the ring's head."""
    with ShmObjectStore.create(make_config(16384, 8000, 2)) as store:
        store.put("a", {"b": b"x" * 100})
        old = store.ref_of("a")
        with store.pinned([]) as done:
            assert store.pin("a")
            done.append("a")
            assert store.invalidate("a")
            store.put("a", {"b": b"y" * 100})
            other = store.pin_entry("a")  # another request's pin of the new entry
            assert other is not None
        assert other.pins == 1 and not store.is_freeable("a")
        store.evict(0)  # the old entry is free now: freed, the new one stays
        assert old is not None and store.ring.head_id != old.id
        assert store.is_cached("a") and len(store.ring.chunk_ids()) == 1
        store.unpin_entry(other)
        assert store.is_freeable("a")


def test_create_makes_the_writer_and_from_handle_a_reader(make_config: Any) -> None:
    """Issue 20 item 5: one object per role, and the type checker knows which (``assert_type``
    is checked by mypy over the tests)."""
    with ShmObjectStore.create(make_config()) as store:
        assert_type(store, StoreWriter)
        with ShmObjectStore.from_handle(store.handle()) as reader:
            assert_type(reader, StoreReader)
            assert type(store) is StoreWriter and type(reader) is StoreReader
            assert isinstance(store, ShmObjectStore) and isinstance(reader, ShmObjectStore)
            assert not isinstance(store, StoreReader) and not isinstance(reader, StoreWriter)
            ref = store.put("k", {"x": np.arange(3)})
            assert reader.get(ref)["x"].tolist() == [0, 1, 2]  # read and acknowledged
            assert store.get(ref)["x"].tolist() == [0, 1, 2]  # the writer's own verified read
            store.drain()
            assert store.is_freeable("k")  # the reader's acknowledgement settled the hand-out


def _slots(cls: type) -> set[str]:
    return {n for c in cls.__mro__ for n in c.__dict__.get("__slots__", ())}


def test_each_role_holds_only_its_own_state(make_config: Any) -> None:
    """The writer has no reader slot; the reader has no index, rows, ledger or writer lock.

    Both are slotted all the way down (no ``__dict__``), so what each declares is all it can
    hold, and every declared field is set by its constructor.
    """
    base = _slots(ShmObjectStore)
    writer_only = _slots(StoreWriter) - base
    assert _slots(StoreReader) == base  # no field of its own: its slot is its read path's
    assert {"_index", "_rows", "_keys", "_ledger", "_lock", "_pending"} <= writer_only
    # the parts the writer is made of, each with its own state (and nothing of the reader's)
    assert {"_acks", "_pins", "_evict"} <= writer_only
    with (
        ShmObjectStore.create(make_config()) as store,
        ShmObjectStore.from_handle(store.handle()) as reader,
    ):
        for obj, cls in ((store, StoreWriter), (reader, StoreReader)):
            assert not hasattr(obj, "__dict__")
            assert all(hasattr(obj, n) for n in _slots(cls)), "a declared field left unset"
        # the writer claims no reader slot (it owes nothing): the one slot attached is the reader's
        assert reader.read_path.slot is not None
        attached = [s.slot for s in store.reader_info() if s.attached]
        assert attached == [reader.read_path.slot.slot]
        for name in writer_only:
            assert not hasattr(reader, name)


def test_a_method_of_the_other_role_is_a_role_error(make_config: Any) -> None:
    """A reader has no writer methods: asked for one (``put``), it raises a ``RoleError``
    naming the role that has it, also an ``AttributeError`` (``hasattr`` is False). A writer
    simply has no reader methods (a plain ``AttributeError``). Neither class has the other's
    names on it, injected or otherwise."""
    names = ShmObjectStore._role_names  # the roles' registry is what this test is about
    reader_names = {"ack", "check_writer", "close_when_idle", "group_word", "read_path", "release"}
    assert names["reader"] == reader_names
    assert {"put", "get_cached", "clear", "touch", "evict", "lock", "evictions"} <= names["writer"]
    # one name, each role's own: the writer undoes a hand-out, a reader settles one unread
    shared = names["reader"] & names["writer"]
    assert shared == {"release"}
    for name in names["writer"] - shared:
        assert name not in dir(StoreReader)
    for name in names["reader"] - shared:
        assert name not in dir(StoreWriter)
    with ShmObjectStore.create(make_config()) as store:
        ref = store.put("k", {})
        reader: Any = ShmObjectStore.from_handle(store.handle())
        writer: Any = store
        try:
            for name in names["writer"] - shared:
                assert not hasattr(reader, name)
                assert getattr(reader, name, None) is None
                with pytest.raises(RoleError, match=f"'{name}' is the writer's"):
                    getattr(reader, name)
            for name in names["reader"] - shared:
                assert not hasattr(writer, name)
                with pytest.raises(AttributeError):
                    getattr(writer, name)
            calls: list[Callable[[], object]] = [
                lambda: reader.put("k2", {}),
                lambda: reader.get_cached("k"),
                lambda: reader.clear(),
                lambda: reader.touch("k"),
            ]
            for call in calls:
                with pytest.raises(RoleError):
                    call()
            with pytest.raises(AttributeError):
                writer.ack(ref)
            with pytest.raises(AttributeError) as info:
                reader.no_such_name  # noqa: B018
            assert not isinstance(info.value, RoleError)
            assert store.get_cached("k") is not None  # nothing above touched the writer
            # the writer's attribute loads stay the interpreter's fast ones: no ``__getattr__``
            assert not any("__getattr__" in vars(c) for c in StoreWriter.__mro__)
        finally:
            reader.close()


_STORE: list[Any] = []  # the writer, then the reader


#: the read paths a reader may take: the compiled core's ``read_item`` (when it is built), its
#: pure-Python reference, and the general Python path alone
READ_PATHS = ["c", "reference", "python"]


def _fuzz_store(path: str = "python") -> tuple[StoreWriter, StoreReader, ShmRef]:
    """The shared writer, its reader on read path ``path`` and the one real reference."""
    if not _STORE:
        w = ShmObjectStore.create(CacheConfig(1 << 16, 1 << 14, 3))
        ref = w.put("real", {"a": np.arange(100)})
        _STORE.extend([w, ref])
        for p in READ_PATHS:
            # the writer probed once, not again: a due probe is the Python path's
            r = ShmObjectStore.from_handle(w.handle(), probe_interval=3600)
            r.check_writer()
            r.read_path._ctx = r.read_path._read_item = None
            if p == "reference":
                r.read_path.enable_core(_core_py)
            elif p == "c" and not r.read_path.enable_core():
                r = None  # type: ignore[assignment]
            _STORE.append(r)
    r = _STORE[2 + READ_PATHS.index(path)]
    if r is None:
        pytest.skip("the compiled core is not in use")
    return _STORE[0], r, _STORE[1]


@pytest.fixture(autouse=True, scope="module")
def _close_fuzz_store() -> Any:
    yield
    if _STORE:
        for r in _STORE[2:]:
            if r is not None:
                r.close()
        _STORE[0].close()
        _STORE.clear()


u64 = st.integers(0, (1 << 64) - 1)


@settings(max_examples=400, deadline=None)
@given(
    nonce_ok=st.booleans(),
    tag_ok=st.booleans(),
    epoch=st.one_of(st.just(1), u64),
    address=st.one_of(st.sampled_from([0, 64, 128, 4096]), u64),
    cid=st.one_of(st.integers(0, 3), u64),
    length=st.one_of(st.integers(0, 2000), u64),
)
@pytest.mark.parametrize("path", READ_PATHS)
def test_forged_references_only_raise_typed_errors(
    path: str, nonce_ok: bool, tag_ok: bool, epoch: int, address: int, cid: int, length: int
) -> None:
    """Even with a correct tag (a forger who read the secret), the ring checks hold, on every
    read path (the compiled one bounds-checks each read of segment bytes)."""
    w, r, real = _fuzz_store(path)
    pos = address  # first lap: position == address
    tag = reference_tag(int(w.words[H_SECRET]), epoch, address, cid, length, pos) if tag_ok else 0
    forged = ShmRef(
        real.nonce if nonce_ok else real.nonce ^ 5, epoch, address, cid, length, tag, pos
    )
    try:
        value = r.get(forged)
    except (InvalidReferenceError, StaleReferenceError):
        return
    assert forged == real
    assert np.array_equal(value["a"], np.arange(100))
    w.release(real)  # keep the accounting honest for the next example (every reader acked it)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.dictionaries(
            st.sampled_from(["nonce", "epoch", "address", "id", "length", "x"]),
            st.one_of(st.integers(-5, 1 << 65), st.text(max_size=3), st.none(), st.floats()),
            max_size=6,
        ),
        st.integers(),
        st.text(),
        st.lists(st.integers(), max_size=3),
    )
)
@pytest.mark.parametrize("path", READ_PATHS)
def test_malformed_reference_dicts(path: str, data: object) -> None:
    _w, r, _real = _fuzz_store(path)
    with pytest.raises(InvalidReferenceError):
        r.get(data)  # type: ignore[arg-type]


def _reader_proc(handle: dict[str, Any], conn: Any) -> None:
    from aioshmcache import ShmObjectStore, ShmRef

    store = ShmObjectStore.from_handle(handle)
    conn.send("ready")
    n = 0
    while True:
        msg = conn.recv()
        if msg is None:
            break
        ref = ShmRef.from_dict(msg["ref"])
        value = store.get(ref)
        ok = checksum(value["data"]) == msg["crc"] == value["crc"]
        conn.send((msg["key"], ok))
        n += 1
    store.close()
    conn.send(("done", n))


@pytest.mark.slow
def test_writer_and_two_reader_processes_move_1000_items(make_config: Any) -> None:
    cfg = make_config(4 << 20, 256 << 10, 2, ack_log_entries=256)
    rng = np.random.default_rng(7)
    with ShmObjectStore.create(cfg) as store:
        pipes, procs = [], []
        for _ in range(2):
            a, b = SPAWN.Pipe()
            p = SPAWN.Process(target=_reader_proc, args=(store.handle().to_dict(), b))
            p.start()
            pipes.append(a)
            procs.append(p)
        try:
            for a in pipes:
                assert a.poll(60) and a.recv() == "ready"
            results: list[list[tuple[str, bool]]] = [[], []]
            for i in range(1000):
                size = int(rng.integers(1, 200_000))
                data = rng.integers(0, 255, size, dtype=np.uint8)
                key = f"item{i}"
                try:
                    ref = store.put(key, {"data": data, "crc": checksum(data)}, wait_for_space=10.0)
                except CacheFullError:
                    pytest.fail("readers acknowledge: the put should find room in time")
                # nothing is freed before every reader acknowledged
                assert not store.is_freeable(key)
                for a in pipes:
                    a.send({"key": key, "ref": ref.to_dict(), "crc": checksum(data)})
                for a, res in zip(pipes, results):  # readers lag behind as they like
                    while a.poll(0):
                        res.append(a.recv())
            for a in pipes:
                a.send(None)
            counts = []
            for a, res in zip(pipes, results):
                while True:
                    assert a.poll(60)
                    msg = a.recv()
                    if msg[0] == "done":
                        counts.append(msg[1])
                        break
                    res.append(msg)
            assert counts == [1000, 1000]
            for res in results:
                assert [k for k, _ok in res] == [f"item{i}" for i in range(1000)]
                assert all(ok for _k, ok in res), "a reader got wrong data"
            store.drain()
            assert all(store.is_freeable(k) for k in list(store.keys()))
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)


def test_writer_own_get_verifies_like_a_reader(make_config: Any) -> None:
    """Evicted and reused mid-copy: the writer's get says stale instead of returning the copy."""
    serde = HookAfterRead()
    with ShmObjectStore.create(make_config(1 << 16, 1 << 12, 1), serde=serde) as store:
        ref = store.put("a", {"x": np.arange(100)})
        assert store.get(ref)["x"][7] == 7

        def evict_and_reuse() -> None:
            store.invalidate("a")
            assert store.evict() == ["a"]
            other = store.put("b", {"x": np.full(100, -1)})
            assert (other.address, other.length) == (ref.address, ref.length)

        serde.hook = evict_and_reuse
        with pytest.raises(StaleReferenceError):
            store.get(ref)


@pytest.mark.parametrize("copy", [True, False])
def test_reader_get_verifies_after_the_copy(make_config: Any, copy: bool) -> None:
    """Cleared and reused mid-copy: a reader's get says stale instead of returning the copy."""
    serde = HookAfterRead()
    with (
        ShmObjectStore.create(make_config(1 << 16, 1 << 12, 1)) as store,
        ShmObjectStore.from_handle(store.handle(), serde=serde) as reader,
    ):
        ref = store.put("a", {"x": np.arange(100)})
        assert reader.get(ref, copy=copy)["x"][7] == 7
        again = store.get_cached("a")
        assert again is not None
        ref = again

        def clear_and_reuse() -> None:
            store.clear()
            other = store.put("b", {"x": np.full(100, -1)})
            assert other.address == ref.address

        serde.hook = clear_and_reuse
        with pytest.raises(StaleReferenceError):
            reader.get(ref, copy=copy)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


def test_reader_get_reads_the_usual_reference_without_the_general_path(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid reference, a live writer, a slot with room: no detour through the general path
    (``ReadPath._get``), whose repeated checks cost a small read a quarter of its time. An
    unusual one (a dict, a forged tag, a stale chunk) still takes it, for its typed errors."""
    from aioshmcache._read_path import ReadPath

    detours: list[object] = []
    general = ReadPath._get

    def counting(self: ReadPath, ref: object, copy: bool) -> Any:
        detours.append(ref)
        return general(self, ref, copy)

    monkeypatch.setattr(ReadPath, "_get", counting)
    with (
        ShmObjectStore.create(make_config(1 << 16, 1 << 12, 1)) as store,
        ShmObjectStore.from_handle(store.handle()) as reader,
    ):
        reader.get(store.put("z", {"z": 0}))  # the first read probes the writer's lock
        detours.clear()
        items = {"a": {"x": np.arange(100)}, "b": {"x": np.ones((3, 4)), "s": "t"}, "c": [1, "2"]}
        for key, item in items.items():
            for copy in (True, False):
                ref = store.put(key, item) if copy else store.get_cached(key)
                assert ref is not None
                got = reader.get(ref, copy=copy)
                assert _same(got, item)
                if not copy:
                    del got
                    reader.ack(ref)
        assert detours == []
        ref = store.get_cached("a")
        assert ref is not None
        with pytest.raises(InvalidReferenceError):
            reader.get(ref._replace(tag=ref.tag ^ 1))
        assert reader.get(ref._asdict())["x"][5] == 5
        assert len(detours) == 2


def test_lag_counts_a_reader_that_never_acknowledged(make_config: Any) -> None:
    with (
        ShmObjectStore.create(make_config()) as store,
        ShmObjectStore.from_handle(store.handle()) as reader,
    ):
        refs = [store.put(f"k{i}", {"i": i}) for i in range(3)]
        assert [s.lag for s in store.reader_info() if s.attached] == [3]
        assert reader.read_path.slot is not None and reader.read_path.slot.slot == 0
        # inspect, from outside the writer: slot 0's row says acked 0, behind 3
        row = inspect_segment(store.name).splitlines()[-2].split()
        assert row[0] == "0" and row[4:6] == ["0", "3"]
        reader.get(refs[0])
        store.drain()
        assert [s.lag for s in store.reader_info() if s.attached] == [2]


def test_reader_info_counts_modulo_2_64_across_a_wrapped_log_head(make_config: Any) -> None:
    """The log head, the session's start and the writer's consumed mark are 64-bit counters (a
    hostile process may set them to the top; the slot's own ``acknowledged`` wraps).
    ``reader_info`` subtracted them as Python ints: past the wrap ``acknowledged`` went negative
    and the acknowledgements written since the last drain were not taken off ``lag``."""
    top = (1 << 64) - 1
    with (
        ShmObjectStore.create(make_config()) as store,
        ShmObjectStore.from_handle(store.handle()) as reader,
    ):
        slot = reader.read_path.slot
        assert slot is not None
        refs = [store.put(f"k{i}", {"i": i}) for i in range(3)]
        for word in (L.RS_START, L.RS_HEAD, L.WS_CONSUMED):
            slot.table.set_word(slot.slot, word, top)
        reader.get(refs[0])
        reader.get(refs[1])  # the head wraps to 1
        assert slot.acknowledged == 2
        for info in (store.reader_info(), reader.reader_info()):
            [row] = [s for s in info if s.attached]
            assert (row.acknowledged, row.lag) == (2, 1)


def test_handmade_refs_with_bad_fields_are_invalid(make_config: Any) -> None:
    with SenderCache(make_config()) as tx, ReceiverCache.attach(tx.handle()) as rx:
        ref, _ = tx.get_and_update_item(({"a": 1}, ()), "a")
        for bad in (
            ShmRef(ref.nonce, ref.epoch, "x", ref.id, ref.length),  # type: ignore[arg-type]
            ShmRef(ref.nonce, ref.epoch, ref.address, -1, ref.length),
            ShmRef(ref.nonce, ref.epoch, ref.address, ref.id, 1 << 70),
        ):
            with pytest.raises(InvalidReferenceError):
                rx.get_and_update_item(bad, "a")
            assert tx.release(bad) is False
        # a dict of arrays whose keys happen to be reference field names is inline data
        inline = {"id": np.arange(3)}
        assert rx.get_and_update_item(inline, "i") is inline


def test_each_handout_is_settled_by_exactly_its_own_acknowledgement(make_config: Any) -> None:
    """A late reader reading an older reference must not settle its debt for a newer hand-out;
    release() undoes exactly the sessions a hand-out was made to."""
    with SenderCache(make_config(1 << 20, 1 << 18, 2)) as tx:
        h1, _ = tx.get_and_update_item(({"a": np.ones(4)}, ()), "a")  # nobody attached yet
        with ReceiverCache.attach(tx.handle()) as late:
            h2, _ = tx.get_and_update_item(None, "a")  # owed by `late`
            assert late.get_and_update_item(h1, "a")["a"].sum() == 4  # not owed: settles nothing
            assert not tx.is_freeable("a")
            assert tx.release(h1) is False  # nobody owed h1
            assert tx.release(h2) is True and tx.release(h2) is False
            assert tx.is_freeable("a")
            h3, _ = tx.get_and_update_item(None, "a")
            assert late.release(h3) is True and late.release(h3) is False
            assert tx.is_freeable("a")


@pytest.mark.parametrize("with_reader", [True, False])
def test_settled_entries_leave_no_objects_for_the_garbage_collector(
    make_config: Any, with_reader: bool
) -> None:
    """The writer keeps no Python object per settled item (a full collection walks each one).

    Before: an entry object and its last ``ShmRef`` per item, 2 tracked objects each (~280 ms
    for a ``gc.collect()`` at 250,000 items). Counted, not timed.
    """
    import gc

    n = 2000
    item = {"x": np.arange(16, dtype=np.uint8)}
    with SenderCache(make_config(n * 2 * 1024 + (1 << 20), 1 << 16, 1)) as tx:
        rx = ReceiverCache.attach(tx.handle()) if with_reader else None
        try:

            def fill(prefix: str) -> None:
                for i in range(n):
                    ref, _ = tx.get_and_update_item((item, ()), f"{prefix}{i}")
                    hit, _ = tx.get_and_update_item(None, f"{prefix}{i}")
                    for r in (ref, hit):
                        if rx is not None:
                            rx.get_and_update_item(r, f"{prefix}{i}")

            fill("warm")  # first use: caches, interned names, lazily built tables
            tx.store.drain()
            gc.collect()
            before = len(gc.get_objects())
            fill("k")
            tx.store.drain()
            gc.collect()
            grown = len(gc.get_objects()) - before
            assert len(tx.store) == 2 * n
            assert grown < n // 20, f"{grown} more tracked objects for {n} settled items"
            # the private rows and ledger are what this test is about (their memory)
            assert not tx.store._ledger.entries  # settled: nothing owed, pinned or touched
            assert not any(gc.is_tracked(row) for row in tx.store._rows.values())
            # nor the maps that hold them: a full collection walks no row (issue 20)
            assert not any(gc.is_tracked(shard) for shard in tx.store._rows.shards)
            assert not any(gc.is_tracked(shard) for shard in tx.store.index.shards)
        finally:
            if rx is not None:
                rx.close()


# --- one lock rule (issue 20): every writer method takes the lock itself ----------------------


def test_a_caller_may_hold_the_lock_around_any_writer_call(make_config: Any) -> None:
    """``with store.lock: store.put(...)`` (and every other writer call) runs, never deadlocks:
    the lock is re-entrant and each method takes it itself. Run in a thread, joined with a
    deadline, so that a deadlock fails the test instead of hanging the suite."""
    import threading

    with ShmObjectStore.create(make_config(256 << 10, 64 << 10, 1, second_chance=False)) as st:
        done: list[object] = []

        def calls() -> None:
            try:
                with st.lock:
                    st.put("a", {"x": np.arange(10)})
                    ref = st.get_cached("a")
                    assert ref is not None and st.touch("a")
                    st.release(ref)  # nobody attached owes it: False, but no deadlock
                    with st.lock:  # nested: still one owner
                        st.put("b", {"x": np.arange(10)}, wait_for_space=0.5)
                    assert st.invalidate("a") and st.drain() >= 0
                    assert st.keys() == ["b"]
                    assert st.clear() == 1
                    st.put("c", {"x": np.arange(10)})
                    assert st.evict(0) == ["c"] and st.keys() == []  # nothing owed: all freed
                done.append(True)
            except BaseException as exc:  # reported by the test, not as a thread warning
                done.append(exc)

        t = threading.Thread(target=calls)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "a writer call deadlocked under the caller's lock"
        assert done == [True]


def test_writer_calls_of_another_thread_wait_for_the_lock_holder(make_config: Any) -> None:
    """The methods that once needed the caller to hold the lock take it themselves: another
    thread's ``get_cached`` (and ``evict``) waits while this thread holds the lock."""
    import threading

    with ShmObjectStore.create(make_config(256 << 10, 64 << 10, 1)) as st:
        st.put("a", {"x": np.arange(10)})
        started, out = threading.Event(), list[object]()

        def other() -> None:
            started.set()
            out.append(st.get_cached("a"))
            out.append(st.evict(0))

        with st.lock:
            t = threading.Thread(target=other)
            t.start()
            assert started.wait(30)
            t.join(timeout=0.3)
            assert t.is_alive() and out == []  # blocked on the lock we hold
        t.join(timeout=30)
        assert not t.is_alive() and isinstance(out[0], ShmRef) and out[1] == ["a"]  # owed by none


def test_release_all_lets_go_only_of_what_this_thread_holds() -> None:
    """``_evict.release_all`` (the wait for space lets go of the writer lock entirely): it
    releases this thread's holds, however many, and never another thread's — the lock taken by
    a waiting thread the moment it is free stays that thread's."""
    import threading

    from aioshmcache._evict import release_all

    lock = threading.RLock()
    taken, leave = threading.Event(), threading.Event()

    def other() -> None:
        with lock:  # blocks until the main thread lets go of every hold
            taken.set()
            leave.wait(30)

    for _ in range(3):
        lock.acquire()
    t = threading.Thread(target=other)
    t.start()
    try:
        assert release_all(lock) == 3
        assert taken.wait(30)
        assert release_all(lock) == 0  # held by the other thread: nothing released
        assert not lock.acquire(blocking=False)  # still the other thread's
    finally:
        leave.set()
        t.join(30)
    assert lock.acquire(blocking=False)
    lock.release()

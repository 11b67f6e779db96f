"""Plain value types: configuration, handles, references, features and statistics.

Everything here is small, immutable where it crosses a process boundary, and free of pickle-only
state: a ``CacheHandle`` and a ``ShmRef`` go through msgpack, JSON or pickle (``to_dict`` /
``from_dict``). ``from_dict`` validates types and ranges and raises ``InvalidReferenceError`` for
anything that is not a well-formed reference, so a dict read off a socket cannot smuggle in a
negative address or a string id.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, NamedTuple

import msgpack

from ._layout import SEGMENT_PREFIX as SEGMENT_PREFIX
from ._layout import check_group, segment_name
from .errors import InvalidReferenceError

__all__ = [
    "CacheConfig",
    "CacheHandle",
    "CacheInfo",
    "CacheSnapshot",
    "Delivery",
    "FeatureSpec",
    "PolicyView",
    "ReaderSlotInfo",
    "ShmRef",
    "TierSnapshot",
    "as_reference",
]

Delivery = Literal["broadcast", "one_of_n"]

_U64 = (1 << 64) - 1
_MiB = 1 << 20
_MAX_HANDLE_BYTES = 4096  # a handle is ~100 bytes; refuse to parse anything much larger


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """What a writer creates: ring size, object limit, reader slots and policies.

    ``capacity_bytes`` is the ring's payload capacity (chunk headers included, the segment header
    and the reader table come on top). ``max_object_bytes`` bounds one serialized object
    (structure header, array bytes and alignment padding). ``n_readers`` is the number of reader
    slots. ``delivery`` is ``"broadcast"`` (every attached reader reads every hand-out) or
    ``"one_of_n"`` (one reader of a pool reads each hand-out; an unread one expires
    ``handout_ttl`` seconds after it was handed out). In broadcast, a hand-out older than
    ``handout_ttl`` stops pinning for a reader that has acknowledged later ones (it was lost in
    transit). ``evict_stuck_readers_after`` revokes a live reader that owes a hand-out blocking
    eviction for that long and has acknowledged nothing since it was made (``None``: never).
    ``wait_for_space`` is the default number of seconds a put waits for readers to acknowledge
    when the ring is full (0: serve inline at once). ``ack_log_entries`` is the size of each
    reader's acknowledgement log. ``reclaim_dead``: a fixed ``name`` whose previous writer is
    provably dead (its kernel lock is free, the segment is this user's and has this layout) is
    reclaimed instead of raising ``SegmentExistsError``. ``group``: instead of one segment named
    ``name``, the writer opens its own *shard* of the cache group of that name when it opens (see
    ``_group``): each writer process of the group gets ``capacity_bytes`` of its own, so a group
    of N gateway processes holds up to N x ``capacity_bytes`` (size it per process). ``name``
    and ``group`` exclude each other; a group name is 1-180 letters, digits, ``_`` or ``-``.
    ``second_chance`` (default on): when a put needs room and the oldest item is free (nothing
    owed, pinned, leased or touched) and was hit since it was written, it is moved to the tail of
    the ring instead of evicted (a bounded number of bytes per put; see ``_store``); off, the
    ring evicts in pure allocation (FIFO) order. A moved item gets a new reference: older
    references to it become stale, exactly as if it had been evicted.
    """

    capacity_bytes: int
    max_object_bytes: int
    n_readers: int
    name: str | None = field(default=None, kw_only=True)
    delivery: Delivery = field(default="broadcast", kw_only=True)
    handout_ttl: float = field(default=30.0, kw_only=True)
    evict_stuck_readers_after: float | None = field(default=None, kw_only=True)
    wait_for_space: float = field(default=0.0, kw_only=True)
    ack_log_entries: int = field(default=16384, kw_only=True)
    reclaim_dead: bool = field(default=True, kw_only=True)
    prefault: bool = field(default=True, kw_only=True)
    group: str | None = field(default=None, kw_only=True)
    second_chance: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        def _int(name: str, value: object, low: int, high: int) -> None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, not {type(value).__name__}")
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}")

        def _secs(name: str, value: object, *, positive: bool) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number of seconds")
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                kind = "positive" if positive else "non-negative"
                raise ValueError(f"{name} must be a finite {kind} number, got {value}")

        _int("capacity_bytes", self.capacity_bytes, 4096, 1 << 46)
        _int("max_object_bytes", self.max_object_bytes, 1, 1 << 46)
        _int("n_readers", self.n_readers, 1, 256)
        _int("ack_log_entries", self.ack_log_entries, 64, 1 << 24)
        if self.max_object_bytes + 64 > self.capacity_bytes:
            raise ValueError(
                f"max_object_bytes ({self.max_object_bytes}) plus a 64-byte chunk header must fit "
                f"in capacity_bytes ({self.capacity_bytes})"
            )
        if self.delivery not in ("broadcast", "one_of_n"):
            raise ValueError(f"delivery must be 'broadcast' or 'one_of_n', got {self.delivery!r}")
        _secs("handout_ttl", self.handout_ttl, positive=True)
        _secs("wait_for_space", self.wait_for_space, positive=False)
        if not isinstance(self.reclaim_dead, bool):
            raise ValueError(f"reclaim_dead must be a bool, not {type(self.reclaim_dead).__name__}")
        if not isinstance(self.second_chance, bool):
            raise ValueError(
                f"second_chance must be a bool, not {type(self.second_chance).__name__}"
            )
        if self.evict_stuck_readers_after is not None:
            _secs("evict_stuck_readers_after", self.evict_stuck_readers_after, positive=True)
        if self.name is not None:
            segment_name(self.name)
        if self.group is not None:
            if self.name is not None:
                raise ValueError("give a cache either a name or a group, not both")
            if not isinstance(self.group, str):
                raise ValueError(f"group must be a str, not {type(self.group).__name__}")
            check_group(self.group)

    @classmethod
    def from_gb(
        cls, cache_gb: float, max_object_mb: float, n_readers: int, **kwargs: Any
    ) -> CacheConfig:
        """Mirror vLLM's ``mm_processor_cache_gb`` / ``mm_shm_cache_max_object_size_mb``."""
        if not isinstance(cache_gb, (int, float)) or not math.isfinite(cache_gb) or cache_gb <= 0:
            raise ValueError(f"cache_gb must be a positive number, got {cache_gb!r}")
        if (
            not isinstance(max_object_mb, (int, float))
            or not math.isfinite(max_object_mb)
            or max_object_mb <= 0
        ):
            raise ValueError(f"max_object_mb must be a positive number, got {max_object_mb!r}")
        return cls(int(cache_gb * (1 << 30)), int(max_object_mb * _MiB), n_readers, **kwargs)


def _check_u64(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _U64:
        raise InvalidReferenceError(f"reference field {name!r} must be an unsigned 64-bit int")
    return value


@dataclass(frozen=True, slots=True)
class CacheHandle:
    """All a reader needs to attach: segment name, its nonce and layout version.

    It travels in every form a worker might be given: pickle, a dict (``to_dict``, JSON- and
    msgpack-friendly), a JSON string (``to_json``, e.g. a command-line flag or an environment
    variable) and msgpack bytes (``to_msgpack``). The nonce names the segment instance, so a
    reader attaching by handle cannot end up on another segment that reused the name.
    """

    name: str
    nonce: int
    layout_version: int

    def to_dict(self) -> dict[str, Any]:
        """The handle as a plain dict of str and int (JSON and msgpack can carry it)."""
        return {"name": self.name, "nonce": self.nonce, "layout_version": self.layout_version}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheHandle:
        """Build a handle from ``to_dict``'s form, validating it (``InvalidReferenceError``)."""
        if not isinstance(data, Mapping):
            raise InvalidReferenceError("a cache handle must be a mapping")
        try:
            name, nonce, version = data["name"], data["nonce"], data["layout_version"]
        except KeyError as exc:
            raise InvalidReferenceError(f"cache handle is missing {exc.args[0]!r}") from None
        if not isinstance(name, str):
            raise InvalidReferenceError("cache handle name must be a str")
        try:
            full = segment_name(name)
        except ValueError as exc:
            raise InvalidReferenceError(f"cache handle name: {exc}") from None
        return cls(full, _check_u64("nonce", nonce), _check_u64("layout_version", version))

    def to_json(self) -> str:
        """The handle as a compact JSON object (the nonce is a 64-bit int: parse it exactly)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes | bytearray) -> CacheHandle:
        """Parse ``to_json``'s output; ``InvalidReferenceError`` if it is not a handle."""
        if len(text) > _MAX_HANDLE_BYTES:
            raise InvalidReferenceError(
                f"a cache handle's JSON is at most {_MAX_HANDLE_BYTES} bytes"
            )
        try:
            if not isinstance(text, str):
                text = text.decode(json.detect_encoding(text))
            _check_flat_json(text)  # before json.loads, which recurses once per level
            data = json.loads(text)
        except (ValueError, TypeError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise InvalidReferenceError(f"not a cache handle's JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidReferenceError(
                f"a cache handle's JSON must be an object, not {type(data).__name__}"
            )
        return cls.from_dict(data)

    def to_msgpack(self) -> bytes:
        """The handle as msgpack bytes (a map, the same fields as ``to_dict``)."""
        packed: bytes = msgpack.packb(self.to_dict(), use_bin_type=True)
        return packed

    @classmethod
    def from_msgpack(cls, data: bytes | bytearray | memoryview) -> CacheHandle:
        """Parse ``to_msgpack``'s output; ``InvalidReferenceError`` if it is not a handle."""
        if len(data) > _MAX_HANDLE_BYTES:
            raise InvalidReferenceError(
                f"a cache handle's msgpack is at most {_MAX_HANDLE_BYTES} bytes"
            )
        try:
            value = msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=True,
                max_ext_len=0,
                max_array_len=16,
                max_map_len=16,
            )
        except Exception as exc:  # msgpack raises ValueError, ExtraData, FormatError, ...
            raise InvalidReferenceError(f"not a cache handle's msgpack: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidReferenceError(
                f"a cache handle's msgpack must be a map, not {type(value).__name__}"
            )
        return cls.from_dict(value)


def _check_flat_json(text: str) -> None:
    """``ValueError`` if ``text`` nests arrays or objects: a handle is one flat object.

    ``json.loads`` recurses once per nesting level, so 4 KB of ``[`` is a ``RecursionError``
    (not a ``ValueError``); a handle never nests, so any nesting is refused before parsing.
    Brackets inside strings do not count (escapes are skipped).
    """
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{" or ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("a cache handle is one flat JSON object (no nesting)")
        elif ch == "}" or ch == "]":
            depth -= 1


def coerce_handle(obj: object) -> CacheHandle | str:
    """What ``attach`` was given, as a ``CacheHandle`` or a segment name.

    Accepts a ``CacheHandle``, its dict (``to_dict``), its JSON string (``to_json``: a str that
    starts with ``{``) or a bare segment name (returned normalised, ``aioshm-`` prefixed). The
    JSON form is what a command line or an environment variable carries; without this it would be
    taken for a (invalid) segment name. Anything else raises an error that says what it got:
    ``TypeError`` for another type (bytes included: decode them, or use ``from_msgpack``),
    ``InvalidReferenceError`` (a ``ValueError``) for a malformed dict or JSON, ``ValueError``
    for a str that is neither JSON nor a valid segment name.

    Not exported: ``ReceiverCache.attach`` and ``AsyncReceiverCache.attach`` take every one of
    these forms themselves, so a second public way in would only be a detour.
    """
    if isinstance(obj, CacheHandle):
        return obj
    if isinstance(obj, Mapping):
        return CacheHandle.from_dict(obj)
    if isinstance(obj, str):
        text = obj.strip()
        if text.startswith("{"):
            return CacheHandle.from_json(text)
        if not text:
            raise ValueError("expected a cache handle or a segment name, got an empty string")
        try:
            return segment_name(obj)
        except ValueError:
            shown = obj if len(obj) <= 60 else obj[:57] + "..."
            raise ValueError(
                f"expected a cache handle's JSON (starting with '{{') or a segment name "
                f"(letters, digits, '_', '.', '-'), got the string {shown!r}"
            ) from None
    kind = type(obj).__name__
    hint = (
        " (decode it, or use CacheHandle.from_msgpack)"
        if isinstance(obj, (bytes, bytearray, memoryview))
        else ""
    )
    raise TypeError(
        f"expected a CacheHandle, its dict, its JSON string or a segment name, got {kind}{hint}"
    )


REF_FIELDS = ("nonce", "epoch", "address", "id", "length", "tag", "position", "seq")
_M1, _M2, _M3, _M4 = (
    0x9E3779B97F4A7C15,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0xD6E8FEB86659FD93,
)


def tag_base(secret: int, epoch: int, address: int, cid: int, length: int, position: int) -> int:
    """The part of a reference's tag that does not depend on the hand-out (see ``finish_tag``)."""
    h = secret ^ (cid * _M1) ^ (address * _M2) ^ (length * _M3) ^ (epoch * _M4)
    return h ^ (position * _M2 >> 7)


def finish_tag(base: int, seq: int) -> int:
    """The tag of hand-out ``seq`` from its ``tag_base``."""
    h = (base ^ (seq * _M3 >> 11)) & _U64
    h ^= h >> 29
    return (h * _M1) & _U64


def reference_tag(
    secret: int, epoch: int, address: int, cid: int, length: int, position: int = 0, seq: int = 0
) -> int:
    """A 64-bit tag binding a reference's fields to its segment's secret.

    Not a cryptographic MAC (anyone who can map the segment can read the secret, and could write
    the segment anyway): it makes a reference with any field changed by accident or by a naive
    forger fail as ``InvalidReferenceError`` instead of looking merely stale.
    """
    return finish_tag(tag_base(secret, epoch, address, cid, length, position), seq)


class ShmRef(NamedTuple):
    """The reference a reader gets instead of the data (immutable, hashable, picklable).

    A ``NamedTuple`` rather than a frozen dataclass: one is made per hand-out, and a tuple is
    built three times faster (0.3 us against 1 us here).

    ``nonce`` names the segment instance, ``epoch`` the clear generation, ``address`` the chunk's
    offset in the ring, ``id`` its 64-bit generation and ``length`` the payload size. Every field
    is checked by the reader against the chunk header before and after the copy; ``position``
    is the chunk's place in the endless stream of allocations, checked against the writer's reuse
    fence; ``seq`` numbers the hand-out (each hand-out of an item is a distinct reference, and
    is acknowledged as such); ``tag`` binds the fields together (a reference with any field
    altered is invalid, not stale).
    """

    nonce: int
    epoch: int
    address: int
    id: int
    length: int
    tag: int = 0
    position: int = 0
    seq: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "nonce": self.nonce,
            "epoch": self.epoch,
            "address": self.address,
            "id": self.id,
            "length": self.length,
            "tag": self.tag,
            "position": self.position,
            "seq": self.seq,
        }

    @classmethod
    def from_dict(cls, data: object) -> ShmRef:
        """Build a reference from a mapping, validating every field (``InvalidReferenceError``)."""
        if isinstance(data, ShmRef):
            return data
        if not isinstance(data, Mapping):
            raise InvalidReferenceError(f"a reference must be a mapping, not {type(data).__name__}")
        missing = [f for f in REF_FIELDS if f not in data]
        if missing:
            raise InvalidReferenceError(f"reference is missing fields: {', '.join(missing)}")
        extra = set(data) - set(REF_FIELDS)
        if extra:
            raise InvalidReferenceError(
                f"reference has unknown fields: {', '.join(sorted(map(str, extra)))}"
            )
        return cls(*(_check_u64(f, data[f]) for f in REF_FIELDS))


_new_object = object.__new__
_set_field = object.__setattr__


_REF_KEYS = frozenset(REF_FIELDS)


def as_reference(data: object) -> ShmRef | None:
    """``data`` as a reference if it is one (a ``ShmRef``, or a mapping of reference fields).

    A mapping with a ``nonce`` whose keys are all reference field names is a reference, validated
    strictly (``InvalidReferenceError`` for missing fields or wrong types); any other mapping is
    an inline item.
    """
    if isinstance(data, ShmRef):
        return data
    if isinstance(data, Mapping) and "nonce" in data and all(k in _REF_KEYS for k in data):
        return ShmRef.from_dict(data)
    return None


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """One multimodal item of a request.

    ``data`` is the item (a mapping of field name to nested arrays), a ``ShmRef`` standing for it,
    or ``None`` (the sender believes the receiver side can resolve the hash). ``prompt_updates``
    given as an iterable that is not a sequence (an iterator, a generator) is kept as a tuple: a
    request reads them more than once.
    """

    mm_hash: str
    data: Any
    identifier: str | None = field(default=None, kw_only=True)
    prompt_updates: Sequence[Any] = field(default=(), kw_only=True)

    def __init__(
        self,
        mm_hash: str,
        data: Any,
        *,
        identifier: str | None = None,
        prompt_updates: Iterable[Any] = (),
    ) -> None:
        # the frozen dataclass's own __init__, field for field (its signature and defaults),
        # with each slot set through its member descriptor (``_SET_*``, bound below the class)
        # rather than ``object.__setattr__`` looked up per field: a caller builds one spec per
        # item of every request (measured ~470 -> ~300 ns a spec; ~1.7k instructions of the
        # channel's gateway round trip). A subclass's instance is set as the dataclass sets it
        # (through its class: a property there still refuses it).
        u = prompt_updates
        if type(u) is not tuple and type(u) is not list and not isinstance(u, Sequence):
            # an iterator, a generator, a set: the updates are read more than once (the
            # request's look-up, then its put), and in order, so the spec keeps them whole
            u = tuple(u)
        if type(self) is FeatureSpec:
            _SET_HASH(self, mm_hash)
            _SET_DATA(self, data)
            _SET_IDENTIFIER(self, identifier)
            _SET_UPDATES(self, u)
        else:
            _set_field(self, "mm_hash", mm_hash)
            _set_field(self, "data", data)
            _set_field(self, "identifier", identifier)
            _set_field(self, "prompt_updates", u)

    def with_data(self, data: Any) -> FeatureSpec:
        # this spec's fields with another data: nothing to check, so the frozen dataclass's
        # __init__ (one object.__setattr__ call per field, with keyword handling) is bypassed;
        # measured 1.6 -> 0.9 us, once per feature of every read
        new = _new_object(FeatureSpec)
        _set_field(new, "mm_hash", self.mm_hash)
        _set_field(new, "data", data)
        _set_field(new, "identifier", self.identifier)
        _set_field(new, "prompt_updates", self.prompt_updates)
        return new


# ``FeatureSpec.__init__``'s setters: the slots' member descriptors (``slots=True`` makes the
# class anew, so they are taken from the decorated class)
_SET_HASH, _SET_DATA, _SET_IDENTIFIER, _SET_UPDATES = (
    FeatureSpec.__dict__[name].__set__
    for name in ("mm_hash", "data", "identifier", "prompt_updates")
)
# as the generated __init__ says it returns (the module's annotations are strings)
FeatureSpec.__init__.__annotations__["return"] = None


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """Hit counters; subtraction gives the delta between two readings."""

    hits: int
    total: int

    @property
    def misses(self) -> int:
        return self.total - self.hits

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.total if self.total else 0.0

    def __sub__(self, other: CacheInfo) -> CacheInfo:
        return CacheInfo(self.hits - other.hits, self.total - other.total)


@dataclass(frozen=True, slots=True)
class ReaderSlotInfo:
    """One reader slot as the writer sees it."""

    slot: int
    attached: bool
    alive: bool
    pid: int
    acknowledged: int
    lag: int
    revoked: bool


@dataclass(frozen=True)
class PolicyView:
    """What a second tier's cost policy believes now (``aioshmcache.tier.TierPolicy``).

    A make costs ``make_fixed_s + make_per_byte_s * n``; a look-up's probe (one round trip)
    ``probe_s``; fetching a value of ``n`` bytes once the probe has answered
    ``fetch_fixed_s + fetch_per_byte_s * n``. ``budget_bytes``: the largest value it would fetch
    now (0: it skips the tier).
    """

    make_fixed_s: float
    make_per_byte_s: float
    probe_s: float
    fetch_fixed_s: float
    fetch_per_byte_s: float
    makes_seen: int
    probes_seen: int
    fetches_seen: int
    budget_bytes: int


@dataclass(frozen=True)
class TierSnapshot:
    """What a second tier (``aioshmcache.tier.RedisTier``) counted since it was created.

    The ``tier`` field of an ``AsyncSenderCache``'s ``CacheSnapshot`` (None without a tier),
    also ``tier_stats()`` and the ``aioshmcache_tier_*`` series of the Prometheus collector:
    one reading of the same counters. Process-local: a snapshot read from shared memory by
    another process (``inspect``, ``metrics.read_snapshot``) has none.
    """

    #: look-ups that asked Redis (a probe, and a GET if the value was worth fetching)
    lookups: int = 0
    #: values fetched, verified and served
    hits: int = 0
    #: look-ups that found no usable value (nothing there, a rejected value, a failure)
    misses: int = 0
    #: Redis operations that failed (connection refused, reset, server error)
    errors: int = 0
    #: Redis operations that got no answer within the client's socket timeout (a failure)
    timeouts: int = 0
    #: Redis operations answered after their request's deadline (the request went on without
    #: the answer; Redis is healthy, the host or Redis was slow: not a failure)
    late: int = 0
    #: values refused by a check (size, signature, decoding), by reason
    rejected: dict[str, int] = field(default_factory=dict, hash=False)
    #: look-ups skipped by the cost policy (a lookup or that value would cost more than a make)
    skipped: int = 0
    #: operations skipped because the circuit breaker was open
    bypassed: int = 0
    #: hashes claimed (this process ran ``make`` for the fleet)
    claims: int = 0
    #: look-ups that waited for another host's ``make``
    waits: int = 0
    #: waits that gave up after ``max_wait_s`` (then ``make`` ran here)
    wait_timeouts: int = 0
    #: claims taken over from a claimer whose lease had expired
    takeovers: int = 0
    #: ``make`` calls this tier ran
    makes: int = 0
    #: values written
    writes: int = 0
    #: writes dropped because the write queue was full
    dropped_writes: int = 0
    #: items not written because fetching them would not beat making them
    skipped_writes: int = 0
    #: bytes of values fetched and served / written
    bytes_read: int = 0
    bytes_written: int = 0
    #: look-up latency: total seconds of timed look-ups (probe and fetch), and their number
    lookup_seconds: float = 0.0
    lookup_samples: int = 0
    #: the circuit breaker: ``closed``, ``open`` or ``half_open``; times it opened
    breaker_state: str = "closed"
    breaker_opens: int = 0
    #: writes waiting in the queue now
    queued_writes: int = 0
    #: the cost policy's current beliefs (learned costs, fetch budget)
    policy: PolicyView | None = None

    @property
    def rejected_total(self) -> int:
        """Values refused, all reasons."""
        return sum(self.rejected.values())

    @property
    def mean_lookup_s(self) -> float:
        """Mean seconds of a timed look-up (0 before any)."""
        return self.lookup_seconds / self.lookup_samples if self.lookup_samples else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The counters as plain data (for JSON, a status page, a results table)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """What an operator watches."""

    name: str
    hits: int
    misses: int
    inline_too_large: int
    inline_full: int
    evictions: int
    bytes_used: int
    items: int
    capacity_bytes: int
    epoch: int
    readers: tuple[ReaderSlotInfo, ...]
    #: items served inline because another request was putting the same hash at that moment
    inline_busy: int = 0
    #: seconds requests spent waiting for space (``wait_for_space``), summed
    wait_for_space_seconds: float = 0.0
    #: group shards: items served from a sibling shard instead of preprocessed (counted as
    #: hits): copied into this shard, or inline when it had no room (then in ``inline_full``)
    sibling_hits: int = 0
    #: group shards: the group's name and this shard's index (None for a plain cache)
    group: str | None = None
    shard: int | None = None
    #: second chance: items moved to the tail of the ring instead of evicted, and their bytes
    relocations: int = 0
    bytes_relocated: int = 0
    #: an ``AsyncSenderCache`` with a second tier: the tier's counters (None without one)
    tier: TierSnapshot | None = None

    @property
    def total(self) -> int:
        """Items asked for (hits + misses)."""
        return self.hits + self.misses

    @property
    def hit_ratio(self) -> float:
        """Hits over items asked for (0 when nothing was asked)."""
        return self.hits / self.total if self.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON-able values; ``readers`` as a list of dicts, ``tier`` a dict.

        For a JSON status endpoint or a log line (``json.dumps(snapshot.to_dict())``).
        """
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "readers":
                value = [{g.name: getattr(r, g.name) for g in fields(r)} for r in value]
            elif f.name == "tier" and value is not None:
                value = value.to_dict()
            out[f.name] = value
        return out

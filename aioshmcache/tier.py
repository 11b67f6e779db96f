"""A second tier behind the shared-memory cache: Redis, shared by every host of a fleet.

Shared memory ends at the host. With ``AsyncSenderCache.from_config(config, tier=RedisTier(...))``
``get_or_put(mm_hash, make)`` looks in shared memory, then in Redis, and only then calls
``make``; a value found in Redis is put into shared memory and handed out as usual, and a value
made here is written to Redis behind the request. Needs the ``fleet`` extra (``redis>=5``;
``hiredis`` optional) and an asyncio event loop (``redis.asyncio``).

The rules (tests in ``tests/test_tier*.py``; the byte layout of a value in ``_tier_value``):

* **Values are untrusted input.** A value is the wire module's bytes of the item behind a
  64-byte header, signed with HMAC-SHA256 under ``secret`` over its key, header and payload.
  A value whose size, signature or decoding fails is a miss (counted in ``rejected``), never
  served, and is overwritten by the next write. No pickle anywhere.
* **Fleet-wide single flight.** Within a process, ``get_or_put`` already runs one ``make`` per
  hash. Across processes and hosts, the first to miss *claims* the hash (``SET lease token NX
  PX lease_s``, in the same Lua script as the look-up: one round trip) and renews its lease
  while ``make`` runs; the others find the lease and wait (polling, at most ``max_wait_s``) for
  the value. A claimer that dies stops renewing: its lease expires and the first waiter to
  look again claims the hash (a *takeover*) and makes it. A claimer whose ``make`` fails or is
  cancelled releases its lease at once (a compare-and-delete of its own token, not queued
  behind the writes), as does a request cancelled during its look-up whose probe had claimed
  (the probe goes on; its claim is given up when it answers).
* **Redis is never a single point of failure.** Every look-up has a deadline sized from what
  it is worth: the make of a typical item as learned (``TierPolicy.lookup_deadline``), never
  less than ``lookup_timeout_s``; the transfer of a value that plus twice its predicted cost.
  When the deadline passes, the request goes on without Redis (it makes the item) and the
  operation goes on in the background, bounded by the client's socket timeout
  (``write_timeout_s``): an answer that comes is counted ``late`` and is not a failure (on a
  busy host the event loop itself is late; Redis is fine), and a claim it took is adopted
  while the make runs (its item is written for the hosts that wait) or given up at once. A
  deadline's timer and the answer often become ready in the same late turn of the loop: the
  answer gets a few more turns to be read before the request gives up. Redis errors, and
  operations with no answer at all, are failures: repeated ones open a circuit breaker
  (``_tier_breaker``) that skips Redis for ``retry_after_s`` (doubling while Redis stays down,
  at most 0.8 s), then lets one probe through; the tier is used again as soon as Redis answers
  (a refusal — a key of another type under ours, Redis out of memory — is counted as an error
  but is an answer: it does not open the breaker). Writes run in one background task from a
  bounded queue (``write_queue_items`` items, ``write_queue_bytes`` bytes of arrays): a full
  queue drops the write (``dropped_writes``); a request never waits for a write.
* **Never slower than computing it.** The cost policy (``_tier_policy``) learns what a
  ``make`` costs and what a fetch costs per byte; a look-up never transfers a value larger
  than the size at which fetching stops paying (the server reports the size first), and an
  item that would not pay is not written at all: its lease becomes a ``skip`` marker for
  ``skip_ttl_s`` so that other hosts make it at once instead of waiting.

Counters: a :class:`TierSnapshot` from :meth:`RedisTier.stats`, which the cache shows as
``snapshot().tier`` (and ``tier_stats()``, also once closed) and
:class:`aioshmcache.metrics.CacheCollector` exports as the ``aioshmcache_tier_*`` series.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final

import anyio
import anyio.to_thread
from anyio.abc import AsyncResource

from ._tier_breaker import CircuitBreaker
from ._tier_policy import TierPolicy
from ._tier_value import (
    HEADER_SIZE,
    TierValueError,
    keyspace,
    lease_key,
    open_value,
    seal_value,
    value_key,
)
from ._types import PolicyView, TierSnapshot
from .errors import ClosedCacheError

__all__ = [
    "CircuitBreaker",
    "PolicyView",
    "RedisTier",
    "TierConfig",
    "TierPolicy",
    "TierSnapshot",
    "TierValueError",
]

MiB: Final = 1 << 20
#: values at least this large are signed / verified in a worker thread (hashing releases the GIL);
#: smaller ones on the loop (HMAC-SHA256 of 1 MiB: ~1-3 ms here): a thread hop costs a turn of
#: the loop, which on a busy host is tens of ms, and the policy would count it in every fetch
THREAD_THRESHOLD: Final = 1 << 20
#: the durations sent to Redis as expiries (in ms): at least 1 ms, at most ~31 years
_MIN_EXPIRY_S: Final = 0.001
_MAX_EXPIRY_S: Final = 1e9
_SKIP: Final = b"skip"  # a lease value that says "not worth storing: make it yourself"
_REJECT_REASONS: Final = ("truncated", "malformed", "oversized", "signature", "decoding")

# KEYS: value, lease. ARGV: our token, lease ms, the skip marker, the longest expiry we set (ms).
# -> {1, n} a value of n bytes | {2, 0} claimed by us | {3, 0} leased by another | {4, 0} skip
# A lease that holds our own token is ours (an earlier probe of this look-up answered late).
# Not ours to trust, deleted (then claimed): a key of another type at either key, a lease
# without an expiry or with a longer one than any we set (see ``_tier_value``).
_PROBE: Final = """
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'none' and t ~= 'string' then redis.call('DEL', KEYS[1]) end
local n = redis.call('STRLEN', KEYS[1])
if n > 0 then return {1, n} end
if redis.call('TYPE', KEYS[2]).ok ~= 'string' then redis.call('DEL', KEYS[2]) end
local l = redis.call('GET', KEYS[2])
if l then
  local ttl = redis.call('PTTL', KEYS[2])
  if ttl < 0 or ttl > tonumber(ARGV[4]) then l = false end
end
if l == ARGV[3] then return {4, 0} end
if l and l ~= ARGV[1] then return {3, 0} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {2, 0}
"""
# KEYS: lease. ARGV: token, ms. Extends our own lease only.
_RENEW: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# KEYS: lease. ARGV: token, replacement ('' deletes), ms. Touches our own lease only.
_RELEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[2] == '' then redis.call('DEL', KEYS[1])
  else redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
  return 1
end
return 0
"""
_VALUE, _CLAIMED, _LEASED, _SKIPPED = 1, 2, 3, 4
#: what ``_call`` returns when the request's deadline passed before Redis answered
_LATE: Final[Any] = object()
#: turns of the event loop an operation gets after its deadline (to read an arrived answer)
_LATE_TURNS: Final = 8


@dataclass
class _Write:
    """One entry of the write queue: a made item to store (or only a lease to release)."""

    vkey: str
    lkey: str
    mm_hash: str
    token: bytes | None  # our lease, if we claimed
    item: Any = None
    has_item: bool = False
    make_s: float = 0.0
    nbytes: int = 0  # the item's array bytes (the queue's byte bound)
    renewal: asyncio.Task[None] | None = None
    making: bool = False  # ``make`` runs now (a late probe's claim is adopted only then)
    done: bool = False  # ``make`` returned or raised
    adopted: bool = False  # our claim came from a late probe: store what ``make`` returns
    late_token: bytes | None = None  # a late probe claimed with it while the look-up went on


def _array_bytes(item: Any, depth: int = 0) -> int:
    """The bytes of the arrays and buffers in ``item`` (what a queued write keeps alive).

    Counts what the wire carries in bulk: numpy arrays, torch tensors and memoryviews (their
    ``nbytes``), bytes, bytearrays and strings; a tensor or a str counted as nothing would let
    ``write_queue_items`` items of any size through the byte bound.
    """
    if isinstance(item, (bytes, bytearray, str)):
        return len(item)
    if depth > 64:
        return 0
    if isinstance(item, dict):
        return sum(_array_bytes(v, depth + 1) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(_array_bytes(v, depth + 1) for v in item)
    nbytes = getattr(item, "nbytes", None)  # np.ndarray, np.generic, torch.Tensor, memoryview
    return nbytes if type(nbytes) is int and nbytes > 0 else 0


def _import_redis() -> Any:
    try:
        import redis.asyncio
        import redis.exceptions
    except ImportError as exc:
        raise ImportError(
            "aioshmcache.tier.RedisTier needs the redis client, which comes with the 'fleet' "
            "extra: pip install -e '.[fleet]' in a clone of aioshmcache"
        ) from exc
    return redis.asyncio


def _seconds(name: str, value: float, *, zero: bool = False) -> None:
    """``ValueError`` unless ``value`` is a finite number of seconds, > 0 (>= 0 with ``zero``)."""
    ok = isinstance(value, (int, float)) and value < float("inf")
    if not (ok and (value >= 0 if zero else value > 0)):
        least = ">= 0" if zero else "a positive number of"
        raise ValueError(f"{name} must be {least} seconds, got {value!r}")


def _expiry(name: str, value: float) -> None:
    """``ValueError`` for a duration Redis would refuse as an expiry: it is sent in whole
    milliseconds, and 0 ms, or more than Redis can add to its clock, is refused by the server
    on every command (a tier that never works)."""
    if not _MIN_EXPIRY_S <= value <= _MAX_EXPIRY_S:
        raise ValueError(
            f"{name} must be between {_MIN_EXPIRY_S} and {_MAX_EXPIRY_S:.0f} s, got {value!r}"
        )


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The tier's tuning, beyond ``RedisTier``'s own keywords; frozen, validated when made.

    ``lease_s``: the lease of a claim (renewed every third of it while ``make`` runs).
    ``max_wait_s``: how long a request waits for another host's ``make``. ``write_timeout_s``:
    the client's socket timeout (bounds every operation, a background one included).
    ``write_queue_items`` / ``write_queue_bytes``: the bounds of the queue of writes behind the
    requests (a full queue drops the write). ``skip_ttl_s``: how long an item not worth storing
    is marked so. ``flush_timeout_s``: how long ``aclose`` writes what is still queued.
    """

    lease_s: float = 2.0
    max_wait_s: float = 5.0
    write_timeout_s: float = 5.0
    write_queue_items: int = 32
    write_queue_bytes: int = 512 * MiB
    skip_ttl_s: float = 10.0
    flush_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("lease_s", "write_timeout_s", "skip_ttl_s"):
            _seconds(name, getattr(self, name))
        for name in ("max_wait_s", "flush_timeout_s"):
            _seconds(name, getattr(self, name), zero=True)
        for name in ("lease_s", "skip_ttl_s"):
            _expiry(name, getattr(self, name))
        for name in ("write_queue_items", "write_queue_bytes"):
            n = getattr(self, name)
            if type(n) is not int or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")


def _check_url(url: str) -> None:
    """``ValueError`` for a URL the client refuses, or one that makes it decode replies.

    Values are bytes: with ``decode_responses`` (which the URL's query overrides whatever the
    tier asks for) every GET of a value fails to decode, each counted as a Redis failure: the
    breaker stays open and the tier silently never serves anything.
    """
    from redis.asyncio.connection import parse_url, to_bool

    try:
        options = parse_url(url)
    except ValueError as exc:
        raise ValueError(f"url: {exc}") from None
    if to_bool(options.get("decode_responses")):
        raise ValueError("url must not set decode_responses: the tier's values are bytes")


class RedisTier(AsyncResource):
    """Redis as the fleet-wide second tier of an ``AsyncSenderCache`` (see the module docstring).

    Give it to the cache: ``AsyncSenderCache.from_config(config, tier=RedisTier(url,
    secret=...))``; the cache enters and closes it with itself (one tier per cache: a tier the
    cache closed raises ``ClosedCacheError``). On its own it is an anyio ``AsyncResource``:
    ``async with RedisTier(...) as tier``. Every host of a fleet uses the same ``url``,
    ``secret`` and ``prefix``.
    """

    def __init__(
        self,
        url: str,
        *,
        secret: bytes | str,
        ttl_s: float = 3600.0,
        max_item_bytes: int = 64 * MiB,
        lookup_timeout_s: float = 0.05,
        prefix: str = "aioshm:",
        cluster: bool = False,
        config: TierConfig | None = None,
        breaker: CircuitBreaker | None = None,
        policy: TierPolicy | None = None,
    ) -> None:
        """Configure; no connection is made here (nor on ``async with``: Redis may be down).

        ``secret`` (at least 16 bytes; a str is UTF-8 encoded) signs and verifies every value,
        and names the key namespace (``keyspace``: hosts with other secrets use other keys).
        ``ttl_s``: how long Redis keeps a value. ``max_item_bytes``: the largest payload
        written or read. ``lookup_timeout_s``: the least a look-up waits (its deadline is what
        a typical make costs, as learned: ``TierPolicy.lookup_deadline``). ``prefix``: of
        every key. ``cluster``: ``url`` names a node of a Redis Cluster. ``config``: the rest of
        the tuning (``TierConfig``: leases, waits, the write queue). ``breaker`` and ``policy``
        replace the default circuit breaker and cost policy (state machines: one per tier).
        """
        if not isinstance(url, str) or not url:
            raise TypeError("url must be a non-empty str (redis://host:port/db)")
        key = secret.encode("utf-8") if isinstance(secret, str) else secret
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("secret must be bytes (or str) of at least 16 bytes")
        _seconds("ttl_s", ttl_s)
        _expiry("ttl_s", ttl_s)
        _seconds("lookup_timeout_s", lookup_timeout_s)
        if type(max_item_bytes) is not int or max_item_bytes < 1:
            raise ValueError(f"max_item_bytes must be an int >= 1, got {max_item_bytes!r}")
        if config is None:
            config = TierConfig()
        elif not isinstance(config, TierConfig):
            raise TypeError(f"config must be a TierConfig, not {type(config).__name__}")
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ValueError("prefix must be a str without braces (they make the hash tag)")
        try:
            prefix.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("prefix must encode as UTF-8 (it starts every key)") from None
        self._redis_mod = _import_redis()
        _check_url(url)
        self.url = url
        self._secret = key
        self.ttl_s = float(ttl_s)
        self.max_item_bytes = max_item_bytes
        self.lookup_timeout_s = float(lookup_timeout_s)
        self.prefix = prefix
        #: the start of every key: ``prefix`` and a namespace derived from ``secret``
        self.keyspace = keyspace(prefix, key)
        self.cluster = bool(cluster)
        #: the tuning beyond the keywords above
        self.config = config
        self.lease_s = float(config.lease_s)
        self.max_wait_s = float(config.max_wait_s)
        self.write_timeout_s = float(config.write_timeout_s)
        self._queue_items = config.write_queue_items
        self._queue_bytes = config.write_queue_bytes
        self.skip_ttl_s = float(config.skip_ttl_s)
        self._longest_expiry_ms = int(max(self.lease_s, self.skip_ttl_s) * 1000)
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.policy = policy if policy is not None else TierPolicy()
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        # writes of made items only (a claim to give up is its own task): len() is the count,
        # which stats() reads from any thread (a metrics scrape) without iterating
        self._queue: collections.deque[_Write] = collections.deque()
        self._queued_bytes = 0
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._releasing: set[asyncio.Task[None]] = set()  # claims being given up (in _tasks)
        self._late: set[asyncio.Future[Any]] = set()  # operations past their deadline (in _tasks)
        self._closed = False
        self._n: collections.Counter[str] = collections.Counter()
        self._rejected: collections.Counter[str] = collections.Counter()
        self._lookup_seconds = 0.0

    # --- lifetime -----------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        """Whether it was entered (``async with``) and :meth:`aclose` did not run."""
        return self._client is not None and not self._closed

    async def __aenter__(self) -> RedisTier:
        """Enter ``async with``: make the client and start the writer task (no round trip:
        Redis may be down). Entering an entered tier again changes nothing."""
        if self._closed:
            raise ClosedCacheError("the tier is closed")
        if self._client is not None:
            return self
        r = self._redis_mod
        opts: dict[str, Any] = {
            "socket_connect_timeout": max(self.lookup_timeout_s, 0.5),
            "socket_timeout": self.write_timeout_s,
        }
        if self.cluster:
            self._client = r.RedisCluster.from_url(self.url, **opts)
        else:
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            # our own deadlines and breaker decide; a client-side retry would only add delay
            self._client = r.Redis.from_url(self.url, retry=Retry(NoBackoff(), 0), **opts)
        for name, body in (("probe", _PROBE), ("renew", _RENEW), ("release", _RELEASE)):
            self._scripts[name] = self._client.register_script(body)
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._writer = asyncio.create_task(self._write_loop(), name="aioshmcache-tier-writer")
        return self

    async def aclose(self) -> None:
        """Write what is queued (at most ``config.flush_timeout_s``), stop the tasks, close the
        client.

        Idempotent. Writes still queued after the timeout are dropped (and counted). A request
        still running on the tier then finishes without Redis: it claims nothing, renews
        nothing, queues nothing and opens no new connection (a lease it holds expires after
        ``lease_s``).
        """
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            if self._client is not None:
                await self.flush(self.config.flush_timeout_s)
            self._closed = True
            self._n["dropped_writes"] += len(self._queue)
            self._queue.clear()
            tasks = [t for t in (self._writer, *self._tasks) if t is not None]
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await self._client.aclose()

    async def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the write queue is empty, no claim is being given up and every operation
        that passed its deadline has settled (or ``timeout_s``); True if so.

        After it the counters are final: an operation past its deadline goes on in the
        background and is counted (``late``, ``timeouts``, ``errors``) only when it settles,
        and a claim its late answer took is given up then.
        """
        if self._idle is None:
            return True
        with anyio.move_on_after(timeout_s):
            await self._idle.wait()
            while self._releasing or self._late:
                await asyncio.wait(self._releasing | self._late)
        return self._idle.is_set() and not self._releasing and not self._late

    # --- the request path ---------------------------------------------------------------------

    async def fetch_or_make(self, mm_hash: str, make: Callable[[], Awaitable[Any]]) -> Any:
        """The item of ``mm_hash``: from Redis if it is there and worth it, else ``make()``.

        Never raises because of Redis; raises what ``make`` raises (after releasing a claim).
        """
        if not self.is_open:
            raise ClosedCacheError("the tier is not open (the cache opens it: 'async with')")
        vkey, lkey = value_key(self.keyspace, mm_hash), lease_key(self.keyspace, mm_hash)
        budget, exploring = self.policy.next_lookup(self.max_item_bytes)
        budget = min(budget, self.max_item_bytes)
        w = _Write(vkey, lkey, mm_hash, None)  # what ``make`` writes, if it comes to that
        if budget == 0:  # a round trip costs more than a make: nothing to look up or store
            self._n["skipped"] += 1
            return await self._make(w, make, store=False)
        if not self.breaker.allow():
            self._n["bypassed"] += 1
            return await self._make(w, make, store=False)
        self._n["lookups"] += 1
        token = b"c:" + secrets.token_hex(12).encode()
        deadline = self.policy.lookup_deadline(self.lookup_timeout_s)
        start = time.perf_counter()  # the look-up's latency: one sample, waits included
        try:
            return await self._look_up(w, make, token, budget, exploring, deadline, start)
        finally:
            # over: fetched, made, or left (cancelled). A claim a probe took that nobody fills
            # is given up at once, not left to expire under the hosts waiting on it: one taken
            # already (a late answer while the look-up went on) now, one still out (a probe
            # the request left, which goes on: ``_call``) when it answers (``_late_probe``)
            w.done = True
            if w.late_token is not None and w.token is None and not self._closed:
                self._give_up(_Write(w.vkey, w.lkey, w.mm_hash, w.late_token))

    async def _look_up(
        self,
        w: _Write,
        make: Callable[[], Awaitable[Any]],
        token: bytes,
        budget: int,
        exploring: bool,
        deadline: float,
        start: float,
    ) -> Any:
        """``fetch_or_make``'s probes (and waits): the item fetched, or ``make``'s."""
        vkey, lkey, mm_hash = w.vkey, w.lkey, w.mm_hash
        waited_since: float | None = None
        pause = 0.002
        while True:
            t0 = time.perf_counter()
            probe = await self._call(
                self._scripts["probe"],
                keys=[vkey, lkey],
                args=[token, int(self.lease_s * 1000), _SKIP, self._longest_expiry_ms],
                deadline_s=deadline,
                on_late=lambda out: self._late_probe(out, w, token),
            )
            if probe is _LATE and waited_since is not None:
                # a poll answered late (a busy host, or Redis): wait on (bounded below)
                reply: tuple[int, int] | None = (_LEASED, 0)
            else:
                reply = None if probe is None or probe is _LATE else self._probe_reply(probe)
            if reply is None:  # Redis failed, answered late or nonsense (counted): make it here
                if waited_since is not None:  # it answered the polls before: the wait is a sample
                    self._note_lookup(time.perf_counter() - start)
                self._n["misses"] += 1
                return await self._make(w, make, store=False)
            t1 = time.perf_counter()
            if probe is not _LATE:
                self.policy.observe_probe(t1 - t0)
            kind, n = reply
            if kind == _VALUE:
                if n > HEADER_SIZE + self.max_item_bytes:
                    self._n["misses"] += 1
                    self._rejected["oversized"] += 1
                    return await self._make(w, make, store=True)
                if n > HEADER_SIZE + budget or not (exploring or self.policy.worth_fetching(n)):
                    self._n["misses"] += 1
                    self._n["skipped"] += 1
                    return await self._make(w, make, store=False)
                item = await self._fetch(vkey, mm_hash, n, start, t1, deadline)
                if item is not None:
                    return item[0]
                self._n["misses"] += 1  # rejected (counted), vanished or failed: make it here
                return await self._make(w, make, store=True)
            if kind in (_CLAIMED, _SKIPPED):  # answered: the look-up ends (a poll does not)
                self._note_lookup(t1 - start)
            if kind == _CLAIMED:
                self._n["misses"] += 1
                self._n["claims"] += 1
                if waited_since is not None:
                    self._n["takeovers"] += 1
                w.token = token
                return await self._make(w, make, store=True)
            if kind == _SKIPPED:
                self._n["misses"] += 1
                self._n["skipped"] += 1
                return await self._make(w, make, store=False)
            # leased by another process or host: wait for its value (bounded)
            now = time.monotonic()
            if waited_since is None:
                waited_since = now
                self._n["waits"] += 1
            if now - waited_since >= self.max_wait_s:
                self._note_lookup(time.perf_counter() - start)
                self._n["misses"] += 1
                self._n["wait_timeouts"] += 1
                return await self._make(w, make, store=False)
            await anyio.sleep(min(pause, max(0.0, waited_since + self.max_wait_s - now)))
            pause = min(pause * 1.5, 0.05)
            if not self.breaker.allow():
                self._note_lookup(time.perf_counter() - start)
                self._n["misses"] += 1
                self._n["bypassed"] += 1
                return await self._make(w, make, store=False)

    def _late_probe(self, out: Any, w: _Write, token: bytes) -> None:
        """A probe of ``w``'s look-up answered after its deadline: if it claimed the hash, the
        claim is ours — adopted while ``make`` runs (its item is then written for the hosts
        that wait on the lease), else given up at once (not left to expire under waiters)."""
        if not (isinstance(out, (list, tuple)) and len(out) == 2 and out[0] == _CLAIMED):
            return
        if w.token is not None:
            return  # a later probe of this look-up claimed it: one claim, the same token
        if w.making:
            w.token, w.adopted = token, True
            self._n["claims"] += 1  # a claim all the same: its item is written
            if not self._closed:
                w.renewal = self._spawn(self._renew(w.lkey, w.token))
        elif w.done and not self._closed:  # made (or left) already: give the claim up
            self._give_up(_Write(w.vkey, w.lkey, w.mm_hash, token))
        else:  # the look-up goes on: its next probe finds the lease ours (``_PROBE``), else
            w.late_token = token  # ``_make`` adopts it, or the look-up's end gives it up

    def _probe_reply(self, probe: Any) -> tuple[int, int] | None:
        """``(kind, size)`` of the probe script's reply, or None (an error, counted) if it is
        not what the script returns.

        The server is not trusted to be a sane Redis (a wrong URL, a proxy, an incompatible
        server, an attacker on the network): a reply of another shape must not fail the
        request with an untyped error, nor pass for "leased by another" and hold it for
        ``max_wait_s``.
        """
        if (
            isinstance(probe, (list, tuple))
            and len(probe) == 2
            and type(probe[0]) is int
            and type(probe[1]) is int
            and probe[0] in (_VALUE, _CLAIMED, _LEASED, _SKIPPED)
            and probe[1] >= 0
        ):
            return probe[0], probe[1]
        self._n["errors"] += 1
        self.breaker.failure()
        return None

    async def _fetch(
        self, vkey: str, mm_hash: str, n: int, t0: float, t1: float, deadline_s: float
    ) -> tuple[Any] | None:
        """GET, verify and decode a value of ``n`` bytes; None if it failed (counted).

        ``t0``: when the look-up began (its latency, waits on another's lease included);
        ``t1``: when its last probe answered (the policy learns the fetch from there: the probe
        is paid whether the value is fetched or made).
        """
        deadline = deadline_s + 2 * self.policy.fetch_cost(n)
        data = await self._call(self._client.get, args=[vkey], deadline_s=deadline)
        if data is None or data is _LATE:
            return None  # failed, late, or expired between the probe and the GET
        if not isinstance(data, bytes):  # not a GET's reply (see _probe_reply): never served
            self._rejected["malformed"] += 1
            return None
        try:
            if len(data) >= THREAD_THRESHOLD:
                item, make_ns = await anyio.to_thread.run_sync(self._open, vkey, mm_hash, data)
            else:
                item, make_ns = self._open(vkey, mm_hash, data)
        except TierValueError as exc:
            self._rejected[exc.reason] += 1
            return None
        done = time.perf_counter()
        self.policy.observe_fetch(done - t1, len(data))
        self._note_lookup(done - t0)
        self._n["hits"] += 1
        self._n["bytes_read"] += len(data)
        if make_ns > 0:  # at the size a make here is seen at (not the value's, a bit more)
            self.policy.observe_make(make_ns * 1e-9, _array_bytes(item))
        return (item,)

    def _open(self, vkey: str, mm_hash: str, data: bytes) -> tuple[Any, int]:
        return open_value(self._secret, vkey, mm_hash, data, max_item_bytes=self.max_item_bytes)

    def _note_lookup(self, seconds: float) -> None:
        self._lookup_seconds += seconds
        self._n["lookup_samples"] += 1

    async def _make(self, w: _Write, make: Callable[[], Awaitable[Any]], *, store: bool) -> Any:
        """Run ``make`` (renewing our lease, if any), then queue the write or the release."""
        if w.token is None and w.late_token is not None and not self._closed:
            w.token, w.adopted = w.late_token, True  # a late probe's claim: ours to fill
            self._n["claims"] += 1
        if w.token is not None and not self._closed:
            w.renewal = self._spawn(self._renew(w.lkey, w.token))
        self._n["makes"] += 1
        t0 = time.perf_counter()
        w.making = True
        try:
            item = await make()
        except BaseException:
            w.making, w.done = False, True
            if w.token is not None:  # let a waiter take over now, not when the lease expires
                self._enqueue(w)
            elif w.renewal is not None:
                w.renewal.cancel()
            raise
        w.making, w.done = False, True
        w.make_s = time.perf_counter() - t0
        w.nbytes = _array_bytes(item)
        # every make teaches its cost, not only those stored: the ones the policy kept out of
        # the tier (too large to fetch, Redis down) are the ones whose cost it must re-learn
        self.policy.observe_make(w.make_s, w.nbytes)
        if store or w.adopted:
            w.item, w.has_item = item, True
        self._enqueue(w)
        return item

    # --- background: lease renewal, the write queue ------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _renew(self, lkey: str, token: bytes) -> None:
        """Extend our lease every third of it until cancelled (or the lease is not ours)."""
        while True:
            await anyio.sleep(self.lease_s / 3)
            if self._closed:
                return  # the lease expires by itself; nobody may keep it alive
            if not self.breaker.allow():
                continue
            out = await self._call(
                self._scripts["renew"],
                keys=[lkey],
                args=[token, int(self.lease_s * 1000)],
                deadline_s=max(self.lookup_timeout_s, self.lease_s / 6),
            )
            if out == 0:
                return  # expired or taken over: nothing left to keep

    def _enqueue(self, w: _Write) -> None:
        """Queue a write (dropped, and counted, if the queue is full) or a lease release."""
        if self._closed:  # nobody writes any more: drop it (the lease, if any, expires)
            if w.has_item:
                self._n["dropped_writes"] += 1
            w.item, w.has_item = None, False
            if w.renewal is not None:
                w.renewal.cancel()
            return
        if w.has_item and (
            len(self._queue) >= self._queue_items
            or self._queued_bytes + w.nbytes > self._queue_bytes
        ):
            self._n["dropped_writes"] += 1
            w.item, w.has_item = None, False  # still release the lease (below)
        if not w.has_item:
            if w.renewal is not None:
                w.renewal.cancel()
            if w.token is not None:
                # at once, not behind the queued writes: a stuck write would otherwise keep
                # every waiting host waiting for a make that failed (up to max_wait_s)
                self._give_up(w)
            return
        if w.has_item:
            self._queued_bytes += w.nbytes
        self._queue.append(w)
        if self._idle is not None and self._wake is not None:
            self._idle.clear()
            self._wake.set()

    async def _write_loop(self) -> None:
        if self._wake is None or self._idle is None:
            return
        while True:
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            w = self._queue.popleft()
            try:
                await self._write(w)
            except Exception:  # never let the writer die: count and go on
                self._n["errors"] += 1
            finally:
                if w.has_item:
                    self._queued_bytes -= w.nbytes
                if w.renewal is not None:
                    w.renewal.cancel()

    def _give_up(self, w: _Write) -> None:
        """Release ``w``'s claim in the background (``flush`` waits for it)."""
        task = self._spawn(self._release_claim(w))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_claim(self, w: _Write) -> None:
        """Give up a claim nobody will fill: its make failed or was cancelled, its write was
        dropped, or a late answer took it after the make."""
        if self.breaker.allow():
            await self._release(w, b"")

    async def _write(self, w: _Write) -> None:
        try:
            if w.nbytes >= THREAD_THRESHOLD:
                value = await anyio.to_thread.run_sync(self._seal, w)
            else:
                value = self._seal(w)
        except Exception:  # not something the wire carries: nobody can fetch it
            self._n["skipped_writes"] += 1
            await self._release(w, _SKIP)
            return
        n = len(value)
        if n > HEADER_SIZE + self.max_item_bytes or not self.policy.worth_storing(n, w.make_s):
            self._n["skipped_writes"] += 1
            await self._release(w, _SKIP)
            return
        if not self.breaker.allow():
            self._n["bypassed"] += 1
            return
        ok = await self._call(
            self._client.set,
            args=[w.vkey, value],
            kwargs={"px": int(self.ttl_s * 1000)},
            deadline_s=self.write_timeout_s,
        )
        if ok is _LATE:
            return  # it may still land: the lease (if any) expires by itself
        if ok is None:  # refused (Redis out of memory, ...) or failed: nothing was written
            if self.breaker.state == "closed":  # Redis answers: a waiter takes over now
                await self._release(w, b"")  # (a DEL: allowed out of memory too)
            return
        self._n["writes"] += 1
        self._n["bytes_written"] += n
        await self._release(w, b"")

    def _seal(self, w: _Write) -> bytes:
        return seal_value(self._secret, w.vkey, w.mm_hash, w.item, make_ns=int(w.make_s * 1e9))

    async def _release(self, w: _Write, replacement: bytes) -> None:
        if w.token is None:
            return
        await self._call(
            self._scripts["release"],
            keys=[w.lkey],
            args=[w.token, replacement, int(self.skip_ttl_s * 1000)],
            deadline_s=max(self.lookup_timeout_s, 0.5),
        )

    async def _call(
        self,
        fn: Callable[..., Awaitable[Any]],
        *,
        keys: list[str] | None = None,
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        deadline_s: float,
        on_late: Callable[[Any], None] | None = None,
    ) -> Any:
        """One Redis operation under a deadline: its reply; None on a failure (counted, the
        breaker told); ``_LATE`` when the deadline passed first.

        A late operation is not abandoned: it goes on in the background (bounded by the
        client's socket timeout, ``write_timeout_s``) and its outcome is counted when it comes:
        an answer is ``late`` and a success for the breaker (Redis is healthy; the host, or
        Redis, was slow), and is given to ``on_late``; no answer is a ``timeout``, an error an
        ``error``: failures. None at once once the tier is closed: the closed client would
        otherwise connect again.
        """
        if self._closed:
            return None
        started = self.breaker.now()
        op = asyncio.ensure_future(self._op(fn, keys, args, kwargs))
        try:
            await asyncio.wait({op}, timeout=deadline_s)
            # the deadline's timer and the answer may be ready in the same turn of a loop that
            # ran late (a busy host): let the loop read what has arrived before giving up
            for _ in range(_LATE_TURNS):
                if op.done():
                    break
                await asyncio.sleep(0)
        except BaseException:  # the request was cancelled: so is its operation, but a probe
            if on_late is None:  # (it may have claimed already: Redis ran it, the answer is
                op.cancel()  # on its way) goes on, and its answer is given to ``on_late``
                raise
            self._settle_later(op, started, on_late, late=False)
            raise
        if op.done():
            return self._settle(op, started)
        self._settle_later(op, started, on_late, late=True)
        return _LATE

    def _settle_later(
        self,
        op: asyncio.Future[Any],
        started: float,
        on_late: Callable[[Any], None] | None,
        *,
        late: bool,
    ) -> None:
        """Let ``op`` go on in the background; its outcome is counted when it comes (an answer
        counted ``late`` if ``late``) and an answer given to ``on_late``."""
        self._tasks.add(op)
        self._late.add(op)

        def settled(task: asyncio.Future[Any]) -> None:
            self._tasks.discard(task)
            self._late.discard(task)
            if task.cancelled():
                return  # the tier closed
            out = self._settle(task, started)
            if task.exception() is None:
                self._n["late"] += late
                if on_late is not None:
                    on_late(out)

        op.add_done_callback(settled)

    async def _op(
        self,
        fn: Callable[..., Awaitable[Any]],
        keys: list[str] | None,
        args: list[Any] | None,
        kwargs: dict[str, Any] | None,
    ) -> Any:
        with anyio.fail_after(self.write_timeout_s + 1.0):  # beyond the client's own timeout
            if keys is not None:
                return await fn(keys=keys, args=args)
            return await fn(*(args or []), **(kwargs or {}))

    def _settle(self, op: asyncio.Future[Any], started: float) -> Any:
        """The reply of a finished operation, or None (counted, the breaker told)."""
        exc = op.exception()
        if exc is None:
            self.breaker.success()
            return op.result()
        if isinstance(exc, self._redis_mod.ResponseError):
            # Redis answered, but refused (a key of another type under ours, out of memory):
            # an error to count, not a sign that Redis is down
            self._n["errors"] += 1
            self.breaker.success()
            return None
        # connection errors, OSError, no answer within the socket timeout: Redis is unavailable
        timed_out = isinstance(exc, (TimeoutError, self._redis_mod.TimeoutError))
        self._n["timeouts" if timed_out else "errors"] += 1
        self.breaker.failure(started)
        return None

    # --- counters -----------------------------------------------------------------------------

    def stats(self) -> TierSnapshot:
        """The counters, read together (also ``snapshot().tier`` of the cache)."""
        n = self._n
        return TierSnapshot(
            lookups=n["lookups"],
            hits=n["hits"],
            misses=n["misses"],
            errors=n["errors"],
            timeouts=n["timeouts"],
            late=n["late"],
            rejected={r: self._rejected[r] for r in _REJECT_REASONS},
            skipped=n["skipped"],
            bypassed=n["bypassed"],
            claims=n["claims"],
            waits=n["waits"],
            wait_timeouts=n["wait_timeouts"],
            takeovers=n["takeovers"],
            makes=n["makes"],
            writes=n["writes"],
            dropped_writes=n["dropped_writes"],
            skipped_writes=n["skipped_writes"],
            bytes_read=n["bytes_read"],
            bytes_written=n["bytes_written"],
            lookup_seconds=self._lookup_seconds,
            lookup_samples=n["lookup_samples"],
            breaker_state=self.breaker.state,
            breaker_opens=self.breaker.opened,
            queued_writes=len(self._queue),
            policy=self.policy.view(self.max_item_bytes),
        )

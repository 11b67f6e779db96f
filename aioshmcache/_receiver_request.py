"""Layer 6: a receiver's request (``ReceiverRequest``), the read side of ``_request``'s steps.

The same life cycle as the sender's request (``_request._Steps``: ``begin``, ``run_jobs``,
``finish`` or ``abandon``, exactly-once roll back), for reading a request's references: validate
all, read the small ones at once, the big ones as jobs, acknowledge each once verified, give
back whatever is not read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any, Final, cast

from ._core_api import core
from ._read_path import ReadPath
from ._reader_table import ReaderSlot
from ._request import (
    _NONE,
    DEFAULT_INLINE_THRESHOLD,
    RequestCounters,
    _new_object,
    _Steps,
    as_reference,
    check_hash,
)
from ._store_reader import StoreReader
from ._types import FeatureSpec, ShmRef
from .errors import CacheMissError, InvalidReferenceError, ShmCacheError, StaleReferenceError

__all__ = [
    "ReceiverRequest",
    "genuine",
    "new_spec",
    "read_one",
    "read_one_feature",
    "single_item",
]

_NO_OWED: Final = cast("dict[int, ShmRef]", MappingProxyType({}))
#: ``FeatureSpec.with_data`` in one core call, which may decline (the pure core's always does)
_spec_with = core.spec_with


class ReceiverRequest(_Steps):
    """One read of a request's features by a receiver, as steps (see the module docstring).

    ``begin`` validates every reference first (a forged or foreign one fails the request, which
    then owes nothing), sets the stale ones aside (a stale reference owes nothing: it is not
    acknowledged), and reads the small ones at once; the big reads are the jobs. A reference is
    owed until it is read and verified (then acknowledged) or given back; any failure gives back
    every reference not read yet. Stale references are read around and reported together by
    ``finish`` (``CacheMissError``, or ``StaleReferenceError`` for a single item). With
    ``copy=False`` (a lease) arrays are views and the hand-outs stay owed until
    ``settle_lease``.
    """

    # No __slots__ (as ``SenderRequest``): what only some requests need has a class-level
    # default, replaced on first use, so a one-item read that finds its reference sets none
    # of them. The shared empty defaults are immutable: a mistaken update fails loudly.
    _jobs: list[tuple[int, ShmRef, str]] = _NONE  # big reads: item, reference, hash
    _owed: dict[int, ShmRef] = _NO_OWED  # item -> reference handed out, not settled yet
    _held: list[ShmRef] = _NONE  # leased: read as views, acknowledged by settle_lease
    _stale: list[str] = _NONE  # hashes of the stale references
    _running = _abandoned = _settled = False
    _begun = False  # ``begin`` was called (``abandon`` before it gives every reference back)
    _copy = True
    _inline_below = DEFAULT_INLINE_THRESHOLD
    _pairs = False  # ``_features`` holds one ``(hash, data)`` pair (``for_item``), not specs

    def __init__(
        self,
        store: StoreReader,
        counters: RequestCounters,
        features: Sequence[FeatureSpec],
        *,
        copy: bool = True,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        self._lock = threading.Lock()
        self._counters = counters
        self._store = store
        self._features: list[Any] = list(features)
        self._results: list[Any] = [None] * len(self._features)
        if not copy:
            self._copy = False
        if copy_inline_below != DEFAULT_INLINE_THRESHOLD:
            self._inline_below = copy_inline_below

    @classmethod
    def for_item(
        cls,
        store: StoreReader,
        counters: RequestCounters,
        mm_item: Any,
        mm_hash: str,
        copy_inline_below: int,
    ) -> ReceiverRequest:
        """The request of ``get_and_update_item``: one feature, given as its hash and data.

        The same request as over ``[FeatureSpec(mm_hash, mm_item)]`` (the hash is checked by
        ``begin`` as a spec's is), without building the spec: ``finish_item`` returns only the
        data, so the spec would be thrown away (~1 us).
        """
        req = _new_object(cls)
        req._lock = threading.Lock()
        req._counters = counters
        req._store = store
        req._features = [(mm_hash, mm_item)]
        req._results = [None]
        req._pairs = True
        if copy_inline_below != DEFAULT_INLINE_THRESHOLD:
            req._inline_below = copy_inline_below
        return req

    @property
    def has_jobs(self) -> bool:
        """Whether ``run_jobs`` has reads to do (references of ``copy_inline_below`` or more)."""
        return bool(self._jobs)

    def begin(self) -> None:
        """Validate the whole request, then read what is small. Typed errors, nothing owed.

        The whole step is one read in flight of the store (``ReadPath.hold`` ... ``leave``): a
        close waits for it, so the view a validation made of a reference read in this step is
        the one read (the copy is verified after it: a chunk freed meanwhile is stale), and a
        second look-up of the chunk would add nothing. Jobs look their chunk up again when they
        run.
        """
        self._begun = True
        reading = self._store.read_path
        reading.hold()
        try:
            self._begin(reading)  # closed: ``lookup`` gives None, ``check_reader_held`` raises
        finally:
            reading.leave()

    def _begin(self, reading: ReadPath) -> None:
        # ``check_reader`` (a dead writer is raised first) is skipped while every reference
        # passes ``ReadPath.lookup``, which checks the same (open, writer live, not revoked)
        slot: ReaderSlot | None = None
        copy, inline_below, pairs = self._copy, self._inline_below, self._pairs
        results = self._results
        reads: list[tuple[int, ShmRef, memoryview, str]] = []  # read below, in this step
        # read, verified and acknowledged in one core call (``ReadPath.read_item``): counted
        # below with the other reads; on an error the face gives back the others, as before.
        # A lease's views are not acknowledged: held (given back on an error) as ``reads``'.
        core_read = reading.has_core
        core_hits = 0
        leased: list[tuple[int, ShmRef]] = []
        jobs: list[tuple[int, ShmRef, str]] = _NONE
        stale: list[str] = _NONE
        error: Exception | None = None
        i = 0  # the feature being read: on an error, it and every later one are not read
        try:
            for i, f in enumerate(self._features):
                try:
                    if pairs:
                        h, data = f
                    elif isinstance(f, FeatureSpec):
                        h, data = f.mm_hash, f.data
                    else:
                        raise TypeError(f"expected FeatureSpec, got {type(f).__name__}")
                    if type(h) is not str:
                        check_hash(h)
                    if (
                        core_read
                        and type(data) is ShmRef
                        and type(data.length) is int
                        and (not copy or data.length < inline_below)
                    ):
                        try:
                            value = reading.read_item(data, copy)
                        except StaleReferenceError:  # reclaimed during the copy: owes nothing
                            if stale is _NONE:
                                stale = self._stale = []
                            stale.append(h)
                            continue
                        if value is not None:
                            results[i] = value
                            core_hits += 1
                            if not copy:
                                leased.append((i, data))
                            continue
                    # the usual case in one call (``ReadPath.lookup``); else the typed checks
                    view = reading.lookup(data) if type(data) is ShmRef else None
                    if view is not None:
                        ref: ShmRef = data
                    else:
                        if slot is None:
                            slot = reading.check_reader_held()
                        given = as_reference(data)
                        if given is None:
                            results[i] = data
                            continue
                        try:
                            # forged or foreign: never given back (not ours)
                            ref, view = reading.resolve_held(given)
                        except StaleReferenceError:  # owes nothing: not acknowledged
                            if stale is _NONE:
                                stale = self._stale = []
                            stale.append(h)
                            continue
                    if not copy or ref.length < inline_below:
                        reads.append((i, ref, view, h))
                    else:
                        view.release()
                        if jobs is _NONE:
                            jobs = self._jobs = []
                        jobs.append((i, ref, h))
                except (InvalidReferenceError, TypeError) as exc:
                    error = error or exc
            i = len(results)  # every feature was looked at
            if error is not None:
                raise error  # the face abandons the request: every valid reference is given back
            if slot is None:
                busy = reads or jobs or core_hits
                slot = reading.check_reader_held() if not busy else reading.slot
        except BaseException:
            # owed (``abandon`` gives them back): what was set aside to read, what is leased,
            # and the genuine references not read yet (a read failing untyped in the core's
            # call, a check of the reader failing midway)
            self._owe(reads, 0, 0)
            for k, ref in leased:
                self._owed[k] = ref
            for k in range(i, len(results)):
                given = self._reference(k)
                if given is not None and genuine(self._store, given):
                    self._owed[k] = given
            raise
        if jobs:
            self._owed = {i: ref for i, ref, _h in jobs}
        if not copy:
            held = self._held = [ref for _i, ref in leased]
        hits, done = core_hits, 0
        try:
            for i, ref, view, h in reads:
                done += 1
                try:
                    results[i] = reading.finish_read_held(slot, ref, view, copy)
                except StaleReferenceError:
                    # stale after the copy: the chunk was freed (or cleared), and a freed chunk
                    # is owed by nobody, so there is nothing to acknowledge
                    if stale is _NONE:
                        stale = self._stale = []
                    stale.append(h)
                    continue
                hits += 1
                if not copy:
                    held.append(ref)
        except BaseException:
            # any other error: the face abandons, and the reference that failed and every one
            # not read yet are given back (the views not read are released, not leaked)
            self._owe(reads, done - 1, done)
            raise
        finally:
            # one lock round for the whole step (totals counted even if a read failed):
            # ``RequestCounters.add``, inlined
            counters = self._counters
            lock = counters.lock
            lock.acquire()
            try:
                counters.hits += hits
                counters.total += len(results)
            finally:
                lock.release()

    def abandon(self) -> None:
        """Roll the request back (``_Steps.abandon``). One abandoned before ``begin`` (its
        caller was cancelled at the face's turn to yield, before anything was read) gives back
        every genuine reference of the request: a read that never runs owes nothing."""
        if not self._begun:
            self._begun = True
            owed: dict[int, ShmRef] = {}
            for k in range(len(self._features)):
                given = self._reference(k)
                if given is not None and genuine(self._store, given):
                    owed[k] = given
            if owed:
                self._owed = owed
        super().abandon()

    def _reference(self, i: int) -> ShmRef | None:
        """Feature ``i``'s reference, if its data is one."""
        f = self._features[i]
        data = f[1] if self._pairs else getattr(f, "data", None)
        try:
            return as_reference(data)
        except Exception:  # not a reference a reader could have been handed
            return None

    def _owe(
        self, reads: list[tuple[int, ShmRef, memoryview, str]], owed_from: int, unread_from: int
    ) -> None:
        """``begin`` failed: ``reads[owed_from:]`` and every job are owed (``abandon`` gives them
        back); the views of ``reads[unread_from:]``, never read, are released."""
        owed = {i: ref for i, ref, _h in self._jobs}
        for k, (i, ref, view, _h) in enumerate(reads):
            if k >= owed_from:
                owed[i] = ref
            if k >= unread_from:
                view.release()
        self._owed = owed

    def _read(self, i: int, ref: ShmRef, h: str) -> int:
        """Read one job's reference; 1 if it was read (a hit), 0 if it was stale."""
        try:
            data = self._store.read_path.get_checked(ref, copy=self._copy)
        except StaleReferenceError:
            # stale before or after the copy: owed by nobody (see ``_begin``)
            with self._lock:
                self._owed.pop(i, None)
                if self._stale is _NONE:
                    self._stale = []
                self._stale.append(h)
            return 0
        # any other error propagates: the face abandons, and every owed reference is given back
        with self._lock:
            self._owed.pop(i, None)
            if not self._copy:
                self._held.append(ref)
        self._results[i] = data
        return 1

    def _run_jobs(self) -> None:
        hits = 0
        try:
            for i, ref, h in self._jobs:
                if self._abandoned:
                    return  # the roll back gives back what is left
                hits += self._read(i, ref, h)
        finally:
            if hits:
                self._counters.add(hits=hits)

    def _specs(self) -> list[FeatureSpec]:
        """The request's features as specs (a ``for_item`` request builds its one here)."""
        if self._pairs:
            return [FeatureSpec(h, data) for h, data in self._features]
        return self._features

    def finish(self) -> list[FeatureSpec]:
        """New specs with the items read; ``CacheMissError`` lists the stale ones, if any."""
        out = [new_spec(f, d) for f, d in zip(self._specs(), self._results)]
        with self._lock:
            if self._settled:
                raise RuntimeError("request already finished or rolled back")
            if self._stale:  # not settled: a lease's views are given back by ``abandon``
                raise CacheMissError(self._stale, features=out if self._copy else None)
            self._settled = True
        return out

    def finish_item(self) -> Any:
        """The single item of a one-feature request; ``StaleReferenceError`` if it was stale."""
        with self._lock:
            if self._settled or len(self._results) != 1:
                return single_item(self.finish, self._specs())  # its errors, unchanged
            if self._stale:
                # what ``single_item`` makes of ``finish``'s CacheMissError
                h = self._stale[0]
                raise StaleReferenceError(f"reference for {h!r} is stale") from None
            self._settled = True
        return self._results[0]  # no new spec: only its data is returned

    def settle_lease(self) -> None:
        """End a lease: re-verify and acknowledge every leased reference.

        Every one is settled even if some fail; the first failure (``StaleReferenceError``: the
        bytes may have been reused under the views) is raised after.
        """
        with self._lock:
            held, self._held = self._held, []
        errors: list[BaseException] = []
        for ref in held:
            try:
                self._store.ack(ref)
            except Exception as exc:  # keep settling the others
                self._store.release(ref)
                errors.append(exc)
        if errors:
            raise errors[0]

    def _undo_locked(self) -> None:
        owed, self._owed = self._owed, {}
        held, self._held = self._held, []
        for i in sorted(owed):
            self._store.release(owed[i])
        for ref in held:
            self._store.release(ref)


def read_one(store: StoreReader, counters: RequestCounters, mm_item: Any, mm_hash: Any) -> Any:
    """``get_and_update_item``'s usual case in one core call (``ReadPath.read_item``): the item,
    or ``None`` when the request path must run (nothing done, nothing counted then).

    A reference reclaimed during the copy is counted and raised as the request raises it.
    """
    if type(mm_item) is not ShmRef or type(mm_hash) is not str:
        return None
    try:
        value = store.read_path.read_item(mm_item)  # None without the core
    except BaseException as exc:
        _read_failed(store, counters, mm_item, exc)
        raise StaleReferenceError(f"reference for {mm_hash!r} is stale") from None
    if value is not None:
        counters.hit()
    return value


def read_one_feature(
    store: StoreReader,
    read_path: ReadPath,
    counters: RequestCounters,
    features: Sequence[object],
    inline_below: int,
) -> list[FeatureSpec] | None:
    """``get_and_update_features``'s usual one-spec case in one core call (as :func:`read_one`,
    whose steps it repeats rather than calls: it runs once per engine call): a single
    ``FeatureSpec`` whose data is a reference of fewer than ``inline_below`` bytes (the request
    reads it in ``begin``). Its new spec, as the request's ``finish`` makes it, or ``None`` when
    the request must run (nothing done, nothing counted then).

    A reference reclaimed during the copy is counted and raised as the request raises it (a
    ``CacheMissError`` whose ``features`` hold the spec without data); any other failure gives
    the reference back, as the request's roll back does. ``read_path`` is ``store.read_path``
    (a reader binds both once: ``ReceiverCache``).
    """
    if len(features) != 1:
        return None
    f = features[0]
    if type(f) is not FeatureSpec:
        return None
    ref = f.data
    if type(ref) is not ShmRef or type(ref.length) is not int or ref.length >= inline_below:
        return None
    if type(f.mm_hash) is not str:
        return None
    try:
        value = read_path.read_item(ref)  # None without the core
    except BaseException as exc:
        _read_failed(store, counters, ref, exc)
        raise CacheMissError([f.mm_hash], features=[f.with_data(None)]) from None
    if value is None:
        return None
    counters.hit()
    return [_spec_with(f, value) or f.with_data(value)]  # ``new_spec``, without its frame


def new_spec(f: FeatureSpec, data: Any) -> FeatureSpec:
    """``f.with_data(data)``: in one core call (``spec_with``, ~1k instructions less), else by
    ``FeatureSpec.with_data`` (a subclass, the pure core)."""
    return _spec_with(f, data) or f.with_data(data)


def _read_failed(
    store: StoreReader, counters: RequestCounters, ref: ShmRef, exc: BaseException
) -> None:
    """A one-item read raised ``exc``: a stale reference (reclaimed during the copy) is counted
    and returns, for the caller to raise as the request would; anything else gives a genuine
    reference back, as the request's roll back does, and propagates."""
    if isinstance(exc, StaleReferenceError):
        counters.add(total=1)
        return
    if genuine(store, ref):
        store.read_path.give_back(ref)
    raise exc


def genuine(store: StoreReader, ref: ShmRef) -> bool:
    """Whether ``ref`` is a live hand-out of ``store``'s segment now: a reference whose read
    failed otherwise than typed, or was never read, is given back only then (never a forged or
    stale one: see ``_read_path``)."""
    try:
        store.validate(ref)
    except (ShmCacheError, ValueError, TypeError):
        return False
    return True


def single_item(finish: Callable[[], list[FeatureSpec]], features: Sequence[FeatureSpec]) -> Any:
    """``finish()`` of a one-feature read as that feature's item; stale is ``StaleReferenceError``.

    (Both the single-segment and the group receiver requests end ``get_and_update_item`` so.)
    """
    try:
        [f] = finish()
    except CacheMissError:
        h = features[0].mm_hash
        raise StaleReferenceError(f"reference for {h!r} is stale") from None
    return f.data

"""Layer 6: a receiver's request (``ReceiverRequest``), the read side of ``_request``'s steps.

The same life cycle as the sender's request (``_request._Steps``: ``begin``, ``run_jobs``,
``finish`` or ``abandon``, exactly-once roll back), for reading a request's references: validate
all, read the small ones at once, the big ones as jobs, acknowledge each once verified, give
back whatever is not read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ._readers import ReaderSlot
from ._request import (
    DEFAULT_INLINE_THRESHOLD,
    RequestCounters,
    _Steps,
    as_reference,
    check_hash,
)
from ._store_reader import StoreReader
from ._types import FeatureSpec, ShmRef
from .errors import CacheMissError, InvalidReferenceError, StaleReferenceError

__all__ = ["ReceiverRequest", "single_item"]


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

    __slots__ = (
        "_copy",
        "_counters",
        "_features",
        "_held",
        "_inline_below",
        "_jobs",
        "_owed",
        "_refs",
        "_results",
        "_stale",
        "_store",
    )

    def __init__(
        self,
        store: StoreReader,
        counters: RequestCounters,
        features: Sequence[FeatureSpec],
        *,
        copy: bool = True,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        super().__init__(threading.Lock())
        self._counters = counters
        self._store = store
        self._features = list(features)
        self._copy = copy
        self._inline_below = copy_inline_below
        self._refs: list[ShmRef | None] = []
        self._results: list[Any] = [None] * len(self._features)
        self._owed: set[int] = set()  # references handed to this request, not settled yet
        self._held: list[ShmRef] = []  # leased: read as views, acknowledged by settle_lease
        self._stale: list[str] = []
        self._jobs: list[int] = []

    @property
    def has_jobs(self) -> bool:
        """Whether ``run_jobs`` has reads to do (references of ``copy_inline_below`` or more)."""
        return bool(self._jobs)

    def begin(self) -> None:
        """Validate the whole request, then read what is small. Typed errors, nothing owed.

        The view a validation made of a reference read in this step is the one read: the copy
        is verified after it (a chunk freed meanwhile is stale), so a second look-up of the
        chunk would add nothing. Jobs look their chunk up again when they run.
        """
        reading = self._store._reading
        # ``check_reader`` (a dead writer is raised first) is skipped while every reference
        # passes ``ReadPath.lookup``, which checks the same (open, writer live, not revoked)
        slot: ReaderSlot | None = None
        copy, inline_below = self._copy, self._inline_below
        features, results, owed = self._features, self._results, self._owed
        refs: list[ShmRef | None] = [None] * len(features)
        self._refs = refs
        views: dict[int, memoryview] = {}
        error: Exception | None = None
        try:
            for i, f in enumerate(features):
                try:
                    if not isinstance(f, FeatureSpec):
                        raise TypeError(f"expected FeatureSpec, got {type(f).__name__}")
                    h = f.mm_hash
                    if type(h) is not str:
                        check_hash(h)
                    data = f.data
                    # the usual case in one call (``ReadPath.lookup``); else the typed checks
                    view = reading.lookup(data) if type(data) is ShmRef else None
                    if view is not None:
                        ref: ShmRef = data
                    else:
                        if slot is None:
                            slot = reading.check_reader()
                        given = as_reference(data)
                        if given is None:
                            results[i] = data
                            continue
                        try:
                            # forged or foreign: never given back (not ours)
                            ref, view = reading.resolve(given)
                        except StaleReferenceError:  # owes nothing: not acknowledged
                            self._stale.append(h)
                            continue
                    owed.add(i)
                    refs[i] = ref
                    if not copy or ref.length < inline_below:
                        views[i] = view
                    else:
                        view.release()
                except (InvalidReferenceError, TypeError) as exc:
                    error = error or exc
            if error is not None:
                raise error  # the face abandons the request: every valid reference is given back
            if slot is None:
                slot = reading.check_reader() if not owed else reading.slot
        except BaseException:
            for view in views.values():
                view.release()
            raise
        hits = 0
        try:
            for i, r in enumerate(refs):
                if r is None:
                    continue
                if i in views:  # checked above, in this same step
                    hits += self._read(i, r, slot, views.pop(i))
                else:
                    self._jobs.append(i)
        finally:
            for unread in views.values():  # a read raised: the others are released, not leaked
                unread.release()
            # one lock round for the whole step (totals counted even if a read failed)
            self._counters.add(hits=hits, total=len(features))

    def _read(
        self, i: int, ref: ShmRef, slot: ReaderSlot | None = None, view: memoryview | None = None
    ) -> int:
        """Read one validated reference; 1 if it was read (a hit), 0 if it was stale.

        With ``view`` (what validating it returned, in the same step as ``slot``) the chunk is
        not looked up again.
        """
        reading = self._store._reading
        try:
            if view is None or slot is None:
                data = reading.get_checked(ref, copy=self._copy, slot=slot)
            else:
                data = reading.finish_read(slot, ref, view, self._copy)
        except StaleReferenceError:
            # stale before or after the copy: the chunk was freed (or cleared), and a freed
            # chunk is owed by nobody, so there is nothing to acknowledge
            with self._lock:
                self._owed.discard(i)
            self._stale.append(self._features[i].mm_hash)
            return 0
        # any other error propagates: the face abandons, and every owed reference is given back
        with self._lock:
            self._owed.discard(i)
            if not self._copy:
                self._held.append(ref)
        self._results[i] = data
        return 1

    def _give_back(self, i: int, ref: ShmRef) -> None:
        self._store.give_back(ref)
        with self._lock:
            self._owed.discard(i)

    def _run_jobs(self) -> None:
        hits = 0
        try:
            for i in self._jobs:
                if self._abandoned:
                    return  # the roll back gives back what is left
                ref = self._refs[i]
                if ref is not None:
                    hits += self._read(i, ref)
        finally:
            if hits:
                self._counters.add(hits=hits)

    def finish(self) -> list[FeatureSpec]:
        """New specs with the items read; ``CacheMissError`` lists the stale ones, if any."""
        out = [f.with_data(d) for f, d in zip(self._features, self._results)]
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
            if self._settled or len(self._features) != 1:
                return single_item(self.finish, self._features)  # its errors, unchanged
            if self._stale:
                # what ``single_item`` makes of ``finish``'s CacheMissError
                h = self._features[0].mm_hash
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
                self._store.give_back(ref)
                errors.append(exc)
        if errors:
            raise errors[0]

    def _undo_locked(self) -> None:
        owed, self._owed = self._owed, set()
        held, self._held = self._held, []
        for i in sorted(owed):
            ref = self._refs[i] if i < len(self._refs) else None
            if ref is not None:
                self._store.give_back(ref)
        for ref in held:
            self._store.give_back(ref)


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

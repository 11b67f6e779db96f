"""A reader of a whole cache group: one reader slot per live shard, references routed by nonce.

``GroupShards`` is the reader's directory of the group's shards: it attaches (claims a reader
slot) on every live shard it finds, attaches to a new shard when a reference names a nonce it
does not know (one rescan per request), and detaches from a shard whose writer is gone,
remembering that shard's nonce so that its late references are told apart from forged ones.

``GroupReceiverRequest`` is one read of a request's features, as the same steps as a
``ReceiverRequest`` (``begin``, ``run_jobs``, ``finish`` or ``abandon``, ``settle_lease``): it
routes each reference to the store of the shard that issued it and runs one ``ReceiverRequest``
per shard, so every check of a single cache holds per shard (validate first, acknowledge after
verifying, give back on any failure; broadcast or one-of-N as each shard was configured). What
it adds is the merge:

* a reference naming no known shard, even after a rescan: ``InvalidReferenceError`` for the
  request (owes nothing, as for a forged reference). A dead instance is known as long as a
  shard file names it: the file it lived in, or the file that reclaimed it (which remembers
  the last ``PAST_NONCES`` instances of its name); a shard closed cleanly and removed, then
  created afresh, forgets its past, so a reference of it is told apart from a forged one only
  by a reader that saw that instance. One look decides: a reclaimer renames its new shard
  file, complete, over the dead one (``_segment``), so the name always leads to a file that
  names the instance; a file still being created under a free name (no header yet) names no
  instance a reference can come from, and a plain cache named like a shard is no member. So
  a read never waits for a shard file, on an event loop or anywhere;
* a reference of a shard whose writer died or closed: ``WriterGoneError`` after the others were
  read, listing those hashes (``mm_hashes``) with the partial result (``features``);
* stale references of every shard are collected into one ``CacheMissError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ._group import shard_identity
from ._layout import LAYOUT_VERSION, SHM_DIR, group_word
from ._receiver_request import ReceiverRequest, genuine, new_spec, single_item
from ._request import (
    DEFAULT_INLINE_THRESHOLD,
    RequestCounters,
    as_reference,
    check_hash,
)
from ._segment import list_shards, writer_state
from ._serde import Serde
from ._store import ShmObjectStore
from ._store_reader import StoreReader
from ._types import CacheHandle, FeatureSpec, ShmRef
from .errors import (
    CacheMissError,
    ClosedCacheError,
    InvalidReferenceError,
    SegmentNotFoundError,
    ShmCacheError,
    WriterGoneError,
)

__all__ = ["GroupReceiverRequest", "GroupShards"]

_GONE_MEMORY = 1024  # nonces of departed shards remembered (their late references)
_MEMBER_POLL = 0.05  # how often ``wait_for_member`` looks for the group's first shard (s)


class GroupShards:
    """The shards of a group a reader is attached to (thread-safe)."""

    def __init__(self, group: str, *, serde: Serde | None = None, probe_interval: float = 0.25):
        self.group = group
        self._serde = serde
        self._probe = probe_interval
        self._by_nonce: dict[int, StoreReader] = {}
        self._gone: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()
        self.closed = False

    def rescan(self, *, strict: bool = True) -> None:
        """Detach from dead shards, attach to new live ones.

        ``strict``: a shard it cannot attach (every reader slot taken, say) raises why, as
        attaching the group does; else it is skipped (a request's look-up: one full shard must
        not keep the shards after it unattached, and only a reference of it fails, in ``find``).
        """
        with self._lock:
            if self.closed:
                raise ClosedCacheError("the group reader is closed")
            for nonce, store in list(self._by_nonce.items()):
                try:
                    store.check_writer()
                except WriterGoneError:
                    self._detach_locked(nonce)
            known = {s.name: nonce for nonce, s in self._by_nonce.items()}
            word = group_word(self.group)
            for _k, name in list_shards(self.group):
                ident = shard_identity(name)
                if ident is None or ident[1] != word:
                    continue  # not a member (a plain cache named like a shard), or not ready
                if name in known:
                    # the writer's lock is probed only every probe interval: a shard reclaimed
                    # by a new writer since (same name, new nonce) must not hide behind it
                    st = writer_state(os.path.join(SHM_DIR, name))
                    if st.alive and st.nonce == known[name]:
                        continue
                    self._detach_locked(known[name])
                try:
                    store = ShmObjectStore.from_handle(
                        name, serde=self._serde, probe_interval=self._probe
                    )
                except WriterGoneError:
                    # dead before we ever attached: remember its instance, so that references
                    # it handed out are "writer gone", not "no such shard". The instance of
                    # the header read above: the file found dead is that one or a later one,
                    # and a file is replaced only once its writer is gone. (A fresh look at
                    # the name may find the live writer that reclaimed it meanwhile.)
                    if ident[0] not in self._by_nonce:
                        self._remember_gone(ident[0], name)
                    continue
                except SegmentNotFoundError:
                    continue  # gone meanwhile
                except ShmCacheError:
                    if strict:
                        raise
                    continue  # not attachable now: ``find`` raises why for its references
                if not self._adopt_locked(store):
                    continue

    def has_member(self) -> bool:
        """Whether any shard file of the group (live or dead) proves its membership now."""
        word = group_word(self.group)
        return any(
            (ident := shard_identity(name)) is not None and ident[1] == word
            for _k, name in list_shards(self.group)
        )

    def wait_for_member(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the group's first shard, then attach what is there.

        ``SegmentNotFoundError`` if no shard of the group exists by then (a typo in the group
        name shows up here, not at the first request).
        """
        deadline = time.monotonic() + timeout
        while not self.has_member():
            left = deadline - time.monotonic()
            if left <= 0:
                raise SegmentNotFoundError(
                    errno.ENOENT,
                    f"cache group {self.group!r} has no shard in {SHM_DIR}"
                    + (f" after waiting {timeout:g} s" if timeout > 0 else "")
                    + ": is its name right, and has a writer opened it?",
                    self.group,
                )
            time.sleep(min(_MEMBER_POLL, left))
        self.rescan()

    def find(self, nonce: int) -> None:
        """Attach the shard whose file holds instance ``nonce`` now, or mark it gone.

        The last resort for a reference that a rescan did not resolve: unlike a rescan, which
        skips a shard it cannot attach, this lets the attach error through (a full reader table,
        say), so the caller learns the real cause instead of "no such shard". A shard file also
        names the dead instances it was reclaimed from (``WriterState.past``): a reference of
        one of those is "writer gone" even for a reader that started after the reclaim.
        """
        with self._lock:
            if self.closed or nonce in self._by_nonce or nonce in self._gone:
                return
            word = group_word(self.group)
            for _k, name in list_shards(self.group):
                ident = shard_identity(name)
                if ident is None or ident[1] not in (word, 0):
                    continue  # not a member of the group
                st = writer_state(os.path.join(SHM_DIR, name))
                if nonce in st.past:
                    # a dead instance whose shard a new writer reclaimed before we ever saw it
                    # (the reclaimer may not have written its group word yet: the file still
                    # names the instances it held, which is all this needs)
                    self._remember_gone(nonce, name)
                    return
                if ident[1] != word:
                    continue  # not a proven member (yet): never adopted
                if st.nonce != nonce:
                    continue
                if not st.alive:
                    self._remember_gone(nonce, name)
                    return
                try:
                    store = ShmObjectStore.from_handle(
                        CacheHandle(name, nonce, LAYOUT_VERSION),
                        serde=self._serde,
                        probe_interval=self._probe,
                    )
                except (WriterGoneError, SegmentNotFoundError):
                    # dead, or closed and removed since its state was read: this instance was
                    # seen alive in that file, so its references are "writer gone"
                    self._remember_gone(nonce, name)
                    return
                self._adopt_locked(store)
                return

    def resolved(self, nonce: int) -> bool:
        """Whether ``nonce`` is decided: attached, known gone, or this reader closed."""
        return self.closed or nonce in self._by_nonce or nonce in self._gone

    def _adopt_locked(self, store: StoreReader) -> bool:
        """Keep an attached shard if it proves membership (the name may have been reused
        since its header was read); else free its slot at once."""
        if store.group_word != group_word(self.group):
            store.close()
            return False
        self._by_nonce[store.nonce] = store
        return True

    def _detach_locked(self, nonce: int) -> None:
        store = self._by_nonce.pop(nonce, None)
        if store is None:
            return
        self._remember_gone(nonce, store.name)
        # another thread may be reading from it right now: released when its last read ends
        store.close_when_idle(wait=0.0)

    def _remember_gone(self, nonce: int, name: str) -> None:
        self._gone[nonce] = name
        if len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)

    def detach(self, nonce: int) -> None:
        """Forget a shard whose writer is gone (its slot is freed)."""
        with self._lock:
            self._detach_locked(nonce)

    def store(self, nonce: int) -> StoreReader | None:
        """The attached shard of ``nonce``, or None."""
        return self._by_nonce.get(nonce)

    def is_gone(self, nonce: int) -> bool:
        """Whether ``nonce`` names a shard this reader saw die or close."""
        return nonce in self._gone

    def stores(self) -> list[StoreReader]:
        """The attached shards."""
        with self._lock:
            return list(self._by_nonce.values())

    def route(self, ref: ShmRef) -> StoreReader:
        """The store of the shard that issued ``ref`` (typed errors; no rescan)."""
        store = self._by_nonce.get(ref.nonce)
        if store is not None:
            return store
        if ref.nonce in self._gone:
            raise WriterGoneError(f"the writer of shard {self._gone[ref.nonce]!r} is gone")
        raise InvalidReferenceError(
            f"reference names no live shard of cache group {self.group!r} (nonce mismatch)"
        )

    def close(self) -> None:
        """Free every reader slot; idempotent."""
        with self._lock:
            self.closed = True
            for store in self._by_nonce.values():
                store.close_when_idle()  # safe while other threads read
            self._by_nonce.clear()


class GroupReceiverRequest:
    """One read of a request's features over a group (see the module docstring)."""

    def __init__(
        self,
        shards: GroupShards,
        counters: RequestCounters,
        features: Sequence[FeatureSpec],
        *,
        copy: bool = True,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        self._shards = shards
        self._counters = counters
        self._features = list(features)
        self._copy = copy
        self._inline_below = copy_inline_below
        self._subs: list[tuple[int, list[int], ReceiverRequest]] = []  # (nonce, items, request)
        self._gone: list[int] = []  # items of shards whose writer is gone
        self._abandoned = False
        self._begun = False  # ``begin`` was called (``abandon`` before it gives references back)
        self._lock = threading.Lock()

    @property
    def has_jobs(self) -> bool:
        """Whether ``run_jobs`` has work (big reads)."""
        return any(sub.has_jobs for _n, _i, sub in self._subs)

    def begin(self) -> None:
        """Route every reference, then begin one read per shard (typed errors, nothing owed).

        A reference naming no attached shard is looked up once (a rescan, then the one shard
        file that names its instance): that decides it (see the module docstring).
        """
        self._begun = True
        shards = self._shards
        if shards.closed:
            raise ClosedCacheError("the group reader is closed")
        routes: dict[int, list[int]] = {}
        error: Exception | None = None
        for i, f in enumerate(self._features):
            try:
                if not isinstance(f, FeatureSpec):
                    raise TypeError(f"expected FeatureSpec, got {type(f).__name__}")
                check_hash(f.mm_hash)
                ref = as_reference(f.data)
            except (InvalidReferenceError, TypeError) as exc:
                error = error or exc  # as a single cache's request: every feature is looked at
                continue
            if ref is not None:
                routes.setdefault(ref.nonce, []).append(i)
        todo = list(routes.items())
        if error is not None:
            self._give_back(todo)  # the request fails owing nothing
            raise error
        try:
            if any(shards.store(n) is None and not shards.is_gone(n) for n in routes):
                shards.rescan(strict=False)  # a shard that appeared since (or a forged nonce)
            for nonce in routes:
                if not shards.resolved(nonce):
                    shards.find(nonce)  # the one shard file that holds this instance, if any
        except BaseException:
            # the look-up failed (a shard whose reader slots are all taken, say): the request
            # fails owing nothing to the shards it could read
            self._give_back(todo)
            raise
        for nonce in routes:
            if shards.store(nonce) is None and not shards.is_gone(nonce):
                self._give_back(todo)  # the request fails owing nothing
                if shards.closed:  # closed meanwhile (another thread): the look-up was skipped
                    raise ClosedCacheError("the group reader is closed")
                hint = "" if shards.has_member() else f" (it has no shard in {SHM_DIR} at all)"
                raise InvalidReferenceError(
                    f"reference names no live shard of cache group {shards.group!r}{hint}"
                )
        self._counters.add(total=len(self._features) - sum(map(len, routes.values())))
        for at, (nonce, items) in enumerate(todo):
            store = shards.store(nonce)
            if store is None:
                self._gone.extend(items)
                continue
            sub = ReceiverRequest(
                store,
                self._counters,
                [self._features[i] for i in items],
                copy=self._copy,
                copy_inline_below=self._inline_below,
            )
            try:
                sub.begin()
            except (WriterGoneError, ClosedCacheError) as exc:
                # closed: another request detached this shard (its writer is gone) meanwhile
                if isinstance(exc, ClosedCacheError) and not shards.is_gone(nonce):
                    sub.abandon()
                    self.abandon()
                    self._give_back(todo[at + 1 :])
                    raise
                sub.abandon()
                shards.detach(nonce)
                self._gone.extend(items)
                continue
            except BaseException:
                sub.abandon()
                self.abandon()
                self._give_back(todo[at + 1 :])
                raise
            with self._lock:
                if self._abandoned:  # the caller left while this ran in a worker thread
                    sub.abandon()
                    self._give_back(todo[at + 1 :])
                    return
                self._subs.append((nonce, items, sub))

    def _give_back(self, routes: Sequence[tuple[int, list[int]]]) -> None:
        """Give back the genuine references of ``routes``, whose shards' reads never began (a
        request that fails gives back every reference it did not read)."""
        for nonce, items in routes:
            store = self._shards.store(nonce)
            if store is None:
                continue
            for i in items:
                ref = as_reference(self._features[i].data)
                if ref is not None and genuine(store, ref):
                    store.release(ref)

    def run_jobs(self) -> None:
        """Each shard's big reads; a shard whose writer dies meanwhile only fails its items."""
        for nonce, items, sub in list(self._subs):
            if self._abandoned:
                return
            try:
                sub.run_jobs()
            except (WriterGoneError, ClosedCacheError) as exc:
                if isinstance(exc, ClosedCacheError) and not self._shards.is_gone(nonce):
                    raise
                sub.abandon()
                self._shards.detach(nonce)
                with self._lock:
                    self._subs.remove((nonce, items, sub))
                    self._gone.extend(items)

    def abandon(self) -> None:
        """Roll back every shard's read (each exactly once, as a ``ReceiverRequest`` does)."""
        with self._lock:
            self._abandoned = True
            subs = list(self._subs)
            begun, self._begun = self._begun, True
        if not begun:  # abandoned before ``begin`` (a cancelled caller): nothing was read
            self._give_back_unread()
        for _n, _i, sub in subs:
            sub.abandon()

    def _give_back_unread(self) -> None:
        """Give back the genuine references of a request abandoned before ``begin``, on the
        shards attached now (a read that never runs owes nothing)."""
        routes: dict[int, list[int]] = {}
        for i, f in enumerate(self._features):
            try:
                ref = as_reference(getattr(f, "data", None))
            except Exception:  # not a reference a reader could have been handed
                continue
            if ref is not None:
                routes.setdefault(ref.nonce, []).append(i)
        if not self._shards.closed:
            self._give_back(list(routes.items()))

    def finish(self) -> list[FeatureSpec]:
        """The merged result; ``WriterGoneError`` then ``CacheMissError`` (see the docstring)."""
        data: list[Any] = [
            None if as_reference(f.data) is not None else f.data for f in self._features
        ]
        stale: list[str] = []
        leased: list[ReceiverRequest] = []
        for _n, items, sub in self._subs:
            try:
                part: Any = sub.finish()
                leased.append(sub)
            except CacheMissError as exc:
                stale.extend(exc.mm_hashes)
                part = exc.features
            if isinstance(part, list):
                for j, i in enumerate(items):
                    data[i] = part[j].data
        out = [new_spec(f, d) for f, d in zip(self._features, data)]
        if (self._gone or stale) and not self._copy:
            for sub in leased:  # no lease will follow: settle the views read so far now
                with contextlib.suppress(Exception):
                    sub.settle_lease()
        if self._gone:
            hashes = [self._features[i].mm_hash for i in sorted(self._gone)]
            raise WriterGoneError(
                f"the shard writer of {len(hashes)} item(s) is gone: {', '.join(hashes[:8])}",
                mm_hashes=hashes,
                features=out if self._copy else None,
            )
        if stale:
            raise CacheMissError(stale, features=out if self._copy else None)
        return out

    def finish_item(self) -> Any:
        """The single item of a one-feature request; ``StaleReferenceError`` if it was stale."""
        return single_item(self.finish, self._features)

    def settle_lease(self) -> None:
        """End a lease on every shard (every one settled; the first failure raised after)."""
        errors: list[BaseException] = []
        for _n, _i, sub in self._subs:
            try:
                sub.settle_lease()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

"""The gateway <-> engine worker channel: requests of features over a Unix socket, answers back.

Gateway side::

    async with EngineClient.connect("/run/mm/engine.sock", cache=cache) as engine:
        result = await engine.call([feature], payload={"prompt": "..."}, timeout=30.0)

Worker side::

    async with AsyncReceiverCache.attach_group("mm") as rx:
        await serve_engine("/run/mm/engine.sock", handler, rx)  # handler(features, payload)

Why it exists: every multi-process user of the cache wrote this glue (a pool of sockets with
timeouts and reconnect, the worker's accept loop, the error mapping, giving hand-outs back when a
send fails, the resend after a drift signal), and each got some of it wrong.

**Frames.** Everything travels in ``aioshmcache.wire`` frames (8-byte length, payload): a call
is two frames (the usual call of references in one plain message and an empty frame; any other
an envelope with the payload, then the features), an answer one (the result, or
an error of a named kind raised on the gateway as a typed error). The messages are built and
parsed in one module, ``aioshmcache._channel_format``, whose docstring is the reference.

**One call per connection at a time.** A connection is lent to one call from its send to its
answer; the pool (``_channel_pool.PoolBook``: bounded, reuse first, reconnect with exponential
backoff and jitter, one probe at a time while the worker is down) bounds how many are open. A
call whose connection breaks or that is cancelled or times out after sending closes that
connection: the stream is out of step, and its late answer must never reach the next caller.

**Hand-outs.** A reference handed to a call is settled on every path:

* the call could not be encoded, or was never fully written (no connection within the deadline,
  the send failed, cancelled or timed out part-way): the client gives it back
  (``await cache.release(ref)``). The request's frames are written in one go; when a send is
  interrupted, the bytes still queued in the transport are dropped (``abort``), so the worker
  sees a cut frame and reads nothing; when nothing was still queued, the whole call reached the
  socket and counts as delivered;
* delivered: the worker reads it (and acknowledges it), or gives it back itself, or dies (a dead
  reader's debts are dropped). A call cancelled or timed out after delivery does not give back:
  the worker still reads it. A call delivered on a connection the worker closed unread in its
  own shutdown is the one lost hand-out the cache's lapse rule (``handout_ttl``) exists for;
* the worker answers ``unread``: the client gives it back;
* the worker went away before answering (died, or closed the connection) and the call is sent
  again (``retries``, once by default, on a fresh connection): the retry takes fresh hand-outs
  and gives the first ones back. The worker that went away acknowledged them already (giving
  back is then a no-op: the ledger settles a hand-out once) or never will (a dead reader's
  debts are dropped anyway).

**Drift recovery.** When the worker answers ``cache_miss`` (references gone stale: evicted,
cleared, a restarted writer), the client invalidates those hashes in its cache and, if the
caller passed ``items=`` (a mapping or a function from hash to item), resends the call once with
those items inline and fresh hand-outs for the request's other references (the worker
acknowledged the first ones). Without ``items``, or if the resend misses again, the
``CacheMissError`` reaches the caller, whose usual answer is to ask its client for the data.

Runs on asyncio (and uvloop): each connection is an ``asyncio.Protocol`` that cuts frames as the
bytes arrive, and whose transport tells how much of a send is still queued.

The parts, by role: ``_channel_client`` (``EngineClient``, the gateway's pool of connections),
``_channel_server`` (``serve_engine``, the worker's connections), ``_channel_keeper`` (the
path's lock: one worker per path, and keeping one alive for ``start=``), ``_channel_conn``
(one connection, both ends), ``_channel_format`` (the messages), ``_channel_pool`` (the pool's
rules, a pure state machine).
"""

from __future__ import annotations

from ._channel_client import ChannelStats, EngineClient
from ._channel_server import Handler, serve_engine

__all__ = [
    "ChannelStats",
    "EngineClient",
    "Handler",
    "serve_engine",
]

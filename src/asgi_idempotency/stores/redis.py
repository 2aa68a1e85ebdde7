"""Redis store (``asgi-idempotency[redis]``): one server, Redis under Sentinel, or Redis Cluster.

One hash per record, at ``idem:{<scoped key>}``. The scoped key is already the
sha256 hex digest of principal and client key, so the raw client key never reaches
Redis, and the braces (a hash tag) put every key of a record in one cluster slot, so
each script touches one slot and the slot is decided by the digest alone.

Every hot-path primitive is one Lua script (``EVALSHA``, reloaded on ``NOSCRIPT``), so
each is atomic on the server and one round trip:

==========  ===============================================================
insert      absent: write the claim, ``PEXPIRE`` its ttl; present: return it
replace     compare-and-swap on the row as read (token, status, lease)
complete    token owns an in-progress row: store the response, new ``PEXPIRE``
release     token owns an in-progress row: ``DEL``
renew       token owns an in-progress row: move ``locked_until`` (and
            ``expires_at`` and the TTL, to at least ``locked_until``)
==========  ===============================================================

Pipelining (``batching=True``, the default): while a command to a server (on a
cluster, to a slot's primary) is in flight, the claims, completions, releases and
renewals that arrive for it queue in that server's :class:`~.batching.Batcher` and
leave as one pipeline of the same scripts (no ``MULTI``: each script is atomic on its
own, and Redis runs them in the order sent). A request that finds its server idle is
sent at once from its own task, as without batching. ``NOSCRIPT`` and, on a cluster,
``MOVED``/``ASK``/``TRYAGAIN`` replies inside a pipeline are those commands not run,
and are sent again (see :meth:`RedisStore._send`).

Fields (``HGETALL idem:{…}`` in ``redis-cli``): ``h`` request hash, ``s`` status,
``t`` token, ``c``/``l``/``e`` created_at/locked_until/expires_at as integer
microseconds since the epoch (exact in Lua's doubles until the year 2255), ``rs``
``rh`` ``rb`` the stored response's status, headers (the SQL store's encoding) and
body bytes. Like the SQL store, this store decides nothing: what a row means is
:mod:`asgi_idempotency.core.lifecycle`'s.

Leases and retention are on the server's clock: the scripts take the lease and the
ttl as durations (microseconds) and read ``TIME`` themselves, so app hosts whose
clocks disagree agree on every lease; the row in an insert's way comes back with the
server time it was read at (:attr:`~.base.Record.read_at`), and the lifecycle judges
it at that time. ``TIME`` before a write is safe to replicate: Redis 5 and later
replicate a script's effects, not the script (Redis 7 knows no other way). Every
write sets the key's TTL to the same duration as ``expires_at``, so expired records
disappear with no prune job; :meth:`RedisStore.prune` deletes the few whose
``expires_at`` passed before their TTL (by less than a millisecond) for tools and tests.

Driver errors (unreachable, timed out, ``READONLY``, ``CLUSTERDOWN``, ``TRYAGAIN``,
``MOVED`` that would not settle, ``OOM``) become :class:`StoreError` at one boundary,
:data:`REDIS_ERRORS` (an :class:`~.errors.ErrorBoundary` of redis-py's types), so the
middleware's 503 fail-closed path applies unchanged; anything else (a bug of ours, a
record we cannot decode) propagates as itself, a logged 500, never passing for an outage.

redis-py's connections belong to the event loop that opened them: on another loop
the store builds a new client (from its URL) and closes the old one on its own loop
as that loop shuts down (:class:`~.base.StoreBase`, :mod:`.loops`).

The store is in parts: :mod:`.redis_client` (redis-py, its boundary, the client a URL
names), :mod:`.redis_scripts` (the Lua scripts and the rows they return),
:mod:`.redis_pipeline` (calls to the servers: pipelines, ``WAIT``, a cluster's
redirects), :mod:`.redis_admin` (reads off the hot path); this module has the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.base import Capabilities, NewClaim, Record, StoredResponse
from asgi_idempotency.stores.batching import Batcher
from asgi_idempotency.stores.codec import encode_headers
from asgi_idempotency.stores.redis_admin import RedisAdmin
from asgi_idempotency.stores.redis_client import (
    DRIVER_ERRORS,
    REDIS_ERRORS,
    AsyncScript,
    RedisCluster,
    _call,
    _Client,
    _close_clients,
    _escape_glob,
    _make_client,
    _slot_tag,
    _store_options,
    aioredis,
    key_slot,
    rexc,
    translate,
)
from asgi_idempotency.stores.redis_client import (
    SENTINEL_PORT as SENTINEL_PORT,  # its home before the split
)
from asgi_idempotency.stores.redis_pipeline import MAX_BATCH as MAX_BATCH
from asgi_idempotency.stores.redis_pipeline import _Op
from asgi_idempotency.stores.redis_scripts import (
    _COMPLETE,
    _INSERT,
    _PRUNE,
    _RELEASE,
    _RENEW,
    _REPLACE,
    _US,
    _claimed,
    _us,
)

__all__ = ["DRIVER_ERRORS", "REDIS_ERRORS", "RedisStore", "translate"]


# The timed-out claims the store still means to release (see RedisStore._orphaned): at
# most this many wait at once, so an outage under load holds a bounded set; the claims
# past it keep their key until their lease ends, as every timed-out claim did before.
_ORPHANS_MAX = 1000
# How many answered releases that found nothing to delete settle a timed-out claim: the
# first may reach the resumed server before the claim that was queued on the closed
# connection (both wait in the kernel; the server reads them in one pass, in an order
# of its own); a second round trip comes after that pass.
_ORPHAN_MISSES = 2

logger = logging.getLogger("asgi_idempotency")


class RedisStore(RedisAdmin):
    """Records as Redis hashes, each primitive one Lua script call (one round trip).

    Args:
        url_or_client: ``redis://[user:password@]host:port/db``, ``rediss://…`` (TLS),
            ``redis+sentinel://[user:password@]host:port,host:port/service/db`` or
            ``rediss+sentinel://…`` (the Sentinels, then the name of the master they
            watch; the credentials are the master's, ``?sentinel_password=`` the
            Sentinels' own), ``redis+cluster://host:port`` or ``rediss+cluster://…``
            (any node of a Redis Cluster), or an existing ``redis.asyncio.Redis``
            (``Sentinel(...).master_for(...)`` included) / ``RedisCluster`` that the
            caller owns (and closes: :meth:`close` leaves it open). A passed client
            must not decode responses (bodies are bytes). A URL may carry
            ``?wait_replicas=`` and ``?wait_timeout=`` (below) for a store built from
            it alone, as the CLI's.
        command_timeout: seconds to connect, and to wait for any one command, before
            the store gives up and the request gets 503 (default 5). Applies when the
            store builds the client.
        key_prefix: the records' key prefix (default ``"idem"``: keys ``idem:{digest}``).
        wait_replicas: after every write (claim, take-over, completion, release,
            renewal), ``WAIT`` until this many replicas have it (default: the URL's
            ``?wait_replicas=``, else 0: no wait).
            Sent in one pipeline with the script, on its connection, so still one round
            trip, plus the replication delay. If fewer acknowledge within
            ``wait_timeout`` the operation raises :class:`StoreError`: a claim gets 503
            (its key stays claimed until the lease ends), a completion still sends the
            response (the middleware logs the error). A replica promoted after a
            failover then has every acknowledged claim and completion; see the
            README's Redis and Redis Cluster section.
        wait_timeout: seconds ``WAIT`` may block (default: the URL's ``?wait_timeout=``,
            else 1); with ``wait_replicas``,
            less than ``command_timeout``, which bounds the write and its ``WAIT`` together.
        batching: pipeline the hot path (default ``True``): while a command to a server
            (on a cluster, to a slot's primary) is in flight, the claims, completions,
            releases and renewals that arrive for it queue, and leave together as one
            pipeline of the same scripts, each request answered when the pipeline
            returns. A request that arrives alone is sent at once. ``False``: one
            command per request. Not with ``wait_replicas``: each write and its
            ``WAIT`` stay one pipeline of their own.
        max_batch: script calls per pipeline, at most (default 256).

    A claim (``insert`` or ``replace``) whose call timed out is withdrawn: it may still
    run on the server, and the store then releases it by its token in the background,
    so that token must not be used again (the middleware draws a new one per request).

    Successive event loops (a ``TestClient`` without ``with``, ``asyncio.run`` twice)
    are fine with a URL: on a new loop the store builds a new client, and the old one
    is closed on its loop as it shuts down. A client you pass is yours, on one loop.

    Raises:
        ValueError: an unsupported URL scheme, a client that decodes responses, a
            timeout that is not positive, a ``wait_timeout`` not below
            ``command_timeout`` with ``wait_replicas``, a ``max_batch`` below 1, or a
            ``wait_replicas``/``wait_timeout`` given both in the URL and as an argument,
            with different values.
    """

    errors = REDIS_ERRORS  # redis-py's boundary, declared above

    def __init__(
        self,
        url_or_client: str | _Client,
        *,
        command_timeout: float = 5.0,
        key_prefix: str = "idem",
        wait_replicas: int | None = None,
        wait_timeout: float | None = None,
        batching: bool = True,
        max_batch: int = MAX_BATCH,
    ) -> None:
        given = {"wait_replicas": wait_replicas, "wait_timeout": wait_timeout}
        if isinstance(url_or_client, str):
            for name, value in _store_options(url_or_client).items():
                if given[name] is not None and given[name] != value:
                    raise ValueError(
                        f"{name} is {given[name]} as an argument and {value} in the URL"
                    )
                given[name] = value
        wait_replicas = 0 if given["wait_replicas"] is None else int(given["wait_replicas"])
        wait_timeout = 1.0 if given["wait_timeout"] is None else float(given["wait_timeout"])
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if command_timeout is None or command_timeout <= 0:
            raise ValueError("command_timeout must be a positive number of seconds")
        if wait_replicas < 0:
            raise ValueError("wait_replicas must be >= 0")
        # WAIT runs inside the write's call, which command_timeout bounds: a WAIT allowed
        # as long as the whole call would be cut off by the deadline, and a write whose
        # replicas lag would read as a hung server instead of a WAIT shortfall.
        if (
            not wait_timeout > 0  # NaN included
            or (wait_replicas and wait_timeout >= command_timeout)
        ):
            raise ValueError(
                f"wait_timeout ({wait_timeout}) must be positive and, with wait_replicas, "
                f"shorter than command_timeout ({command_timeout}): WAIT runs within the "
                "command's deadline"
            )
        # The deadline of every whole call on a client we built, one server or a cluster
        # (see _make_client for why it is ours and not redis-py's socket_timeout); None:
        # a passed client's own timeouts apply.
        self._timeout: float | None = None
        self._url = url_or_client if isinstance(url_or_client, str) else None
        self._command_timeout = command_timeout
        if isinstance(url_or_client, str):
            self.client: _Client = _make_client(url_or_client, command_timeout)
            self._owns_client = True
            self._timeout = command_timeout
        else:
            self.client, self._owns_client = url_or_client, False
        if self._encoder().decode_responses:
            raise ValueError("RedisStore needs a client with decode_responses=False")
        # WAIT counts the replicas that have one connection's writes: each write keeps
        # its own script + WAIT pipeline (_run_and_wait), so WAIT means what it meant.
        self.batching: bool = batching and not wait_replicas
        self._max_batch = max_batch
        # One batcher per server (per primary, by node name, on a cluster): at most one
        # pipeline in flight to each, what arrives meanwhile queued for the next.
        self._batchers: dict[str, Batcher[_Op, Any]] = {}
        # No transactions (a handler's writes cannot join a Lua script); stats and
        # prune by SCAN over every primary.
        self.capabilities = Capabilities(
            transactions=False, batching=self.batching, prune=False, audit=True, own_clock=True
        )
        self._prefix = f"{key_prefix}:{{"
        # The audit's sorted sets (_audit_key): outside the records' SCAN pattern.
        self._audit_prefix = f"{key_prefix}-audit:{{"
        self._cluster = isinstance(self.client, RedisCluster)
        if self._cluster:
            _slot_tag(0)  # the tags, built here rather than in the first claim
        self._match = _escape_glob(self._prefix)  # SCAN MATCH: the prefix as text
        self._wait = wait_replicas
        self._wait_ms = max(1, round(wait_timeout * 1000))
        self._node_clients: dict[str, aioredis.Redis] = {}
        self._refreshing = asyncio.Lock()
        # A cluster client learns the slot map on first use. Learnt while requests
        # already pour in, redis-py (7.4 and 8.1 alike) recycled connections that
        # other commands were using ("Connection closed", a closed transport), so
        # the first command waits for the map, under this lock, before any other runs.
        self._cold = isinstance(self.client, RedisCluster)
        self._warming = asyncio.Lock()
        # Timed-out claims to release, (key, token) -> [loop-time deadline, misses], and
        # the one task that releases them (see _orphaned).
        self._orphans: dict[tuple[str, str], list[float]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        # Scripts are called by their sha through whichever client is current; the
        # client they were registered with only lends them its encoder.
        register = self.client.register_script
        self._insert = register(_INSERT)
        self._replace = register(_REPLACE)
        self._complete = register(_COMPLETE)
        self._release = register(_RELEASE)
        self._renew = register(_RENEW)
        self._prune = register(_PRUNE)

    def _connect(self, *, moved: bool) -> Callable[[], Awaitable[None]]:
        """This loop's client (:meth:`StoreBase._bound`), and what closes it on this loop.

        Every entry point calls :meth:`_bound`, which calls this on a loop other than
        the one the connections belong to. Our own client is rebuilt for this loop (a
        passed client is the caller's to manage), with fresh node clients and locks;
        the old ones are closed on their loop by its tenure.
        """
        if moved:
            if self._url is not None:
                self.client = _make_client(self._url, self._command_timeout)
            self._node_clients = {}
            self._refreshing, self._warming = asyncio.Lock(), asyncio.Lock()
            # The old loop's sweeper ends with its loop; its claims' leases are theirs.
            self._orphans, self._sweeper = {}, None
            self._cold = isinstance(self.client, RedisCluster)
        # A batcher's task and futures belong to the loop it first ran on.
        self._batchers = {}
        own = self.client if self._owns_client else None
        return functools.partial(_close_clients, own, self._node_clients)

    async def _run(self, script: AsyncScript, key: str, args: Sequence[Any], size: int = 0) -> Any:
        self._bound()
        if self._cold:
            await self._warm()
        try:
            if self._wait:
                return await _call(self._run_and_wait(script, key, args), self._timeout)
            rkey = self._key(key)
            if not self.batching:
                return await _call(self._evalsha(script, rkey, args), self._timeout)
            # The deadline covers the wait in the queue too, so a request is answered
            # within command_timeout as without batching; a waiter that gives up is dropped
            # from the queue, or, if its pipeline was sent, its reply is (see _orphaned).
            op = (script, rkey, args, size)
            reply = await _call(self._batcher(rkey).submit(op), self._timeout)
            if isinstance(reply, Exception):  # this command's own error reply in the pipeline
                raise translate(reply) from reply
            return reply
        except StoreError as exc:
            if isinstance(exc.__cause__, rexc.ReadOnlyError):
                await self._demoted()
            raise

    # The hot path: one script call each.

    def _claim_args(self, new: NewClaim) -> list[Any]:
        h = new.request_hash
        # len(h) in characters is its length in bytes only for ASCII (our hashes are hex
        # digests); anything else is measured as the bytes Lua will count.
        n = len(h) if h.isascii() else len(h.encode())
        claim = f"{new.lease // _US} {new.ttl // _US} {n} {h}{new.token}"
        if new.scope_digest is None:
            return [claim]
        # The audit's index entry rides in the same script (_AUDIT): no round trip.
        member = f"{new.key} {new.scope_digest} {h} {new.route or ''}"
        return [claim, self._audit_key(new.key), member]

    def _audit_key(self, key: str) -> str:
        """The audit index that ``key``'s claims write: one sorted set per cluster slot,
        in the record's own slot so that the claim script touches one slot; one set on
        a single server."""
        if not self._cluster:
            return f"{self._audit_prefix}audit}}"
        return f"{self._audit_prefix}{_slot_tag(key_slot(self._key(key).encode()))}}}"

    async def insert(self, new: NewClaim) -> Record | None:
        try:
            row = await self._run(self._insert, new.key, self._claim_args(new))
        except StoreError as exc:
            self._orphaned(new, exc)
            raise
        return None if row == 0 else _claimed(new.key, row)

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        old = [expected.token, expected.status.value, _us(expected.locked_until)]
        try:
            return bool(await self._run(self._replace, expected.key, old + self._claim_args(new)))
        except StoreError as exc:
            self._orphaned(new, exc)
            raise

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        headers = encode_headers(response.headers)
        args = [f"{response.status} {ttl // _US} {token}", headers, response.body]
        size = len(headers) + len(response.body)
        return bool(await self._run(self._complete, key, args, size))

    async def release(self, key: str, token: str) -> bool:
        return bool(await self._run(self._release, key, [token]))

    async def renew(self, key: str, token: str, *, now: datetime, lease: timedelta) -> bool:
        return bool(await self._run(self._renew, key, [token, lease // _US]))

    # Timed-out claims.

    def _orphaned(self, new: NewClaim, exc: StoreError) -> None:
        """Release ``new``'s claim in the background if its call timed out.

        A timed-out claim was sent: a paused or overloaded server runs it when it gets
        to it, after the request got its 503. The key would then hold a claim that no
        handler owns and answer 409 until the lease ends. The token is this claim's
        alone, so releasing by it (the fenced release script) deletes nothing but that
        claim: not a row taken over since, nor one completed. The releases are retried
        until the server answers, for at most the claim's lease (after it the claim
        is abandoned and taken over anyway), and at most _ORPHANS_MAX wait at once.
        Other failures are not ambiguous in the same way (refused, READONLY, MOVED: the
        claim did not run) and keep the old behaviour.
        """
        if not isinstance(exc.__cause__, TimeoutError | rexc.TimeoutError):
            return
        lease = new.lease.total_seconds()
        if lease <= 0 or len(self._orphans) >= _ORPHANS_MAX:
            return
        loop = asyncio.get_running_loop()
        self._orphans[(new.key, new.token)] = [loop.time() + lease, 0]
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep(), name="RedisStore._sweep")

    async def _sweep(self) -> None:
        """Release the timed-out claims until each is settled, backing off while the
        server does not answer. Each release is one bounded store call."""
        loop, pause = asyncio.get_running_loop(), 0.05
        while self._orphans and loop is self._loop:
            for (key, token), entry in list(self._orphans.items()):
                if entry[0] <= loop.time():
                    del self._orphans[(key, token)]  # its lease is over: taken over now
                    _log_orphan(logging.INFO, "idempotency.timed_out_claim_unreleased", key,
                                "the store did not answer within the claim's lease")  # fmt: skip
                    continue
                try:
                    released = await self._run(self._release, key, [token])
                except StoreError:
                    break  # still down or paused: wait, then try every one again
                if released:
                    del self._orphans[(key, token)]
                    _log_orphan(logging.WARNING, "idempotency.timed_out_claim_released", key,
                                "a claim whose store call timed out (the request got 503) "
                                "ran once the store answered again; released, so a retry "
                                "of the key runs at once rather than after the lease")  # fmt: skip
                else:
                    entry[1] += 1
                    if entry[1] >= _ORPHAN_MISSES:  # never ran, or no longer ours
                        del self._orphans[(key, token)]
            else:
                pause = 0.05  # the server answered every release of this pass
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    async def close(self) -> None:
        batchers, self._batchers = list(self._batchers.values()), {}
        if self._loop is asyncio.get_running_loop():
            for batcher in batchers:  # answer what is queued and in flight first
                await batcher.close()
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None and not sweeper.done():
            # Closing drops the releases still pending: those keys keep their claim
            # until the lease ends, as they would have without the sweeper.
            sweeper.cancel()
            if sweeper.get_loop() is asyncio.get_running_loop():
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
        self._orphans = {}
        if await self._end_loop() is None:  # never used: nothing is open, but close what was built
            await _close_clients(self.client if self._owns_client else None, self._node_clients)


def _log_orphan(level: int, event: str, key: str, hint: str) -> None:
    """One line as the middleware's events are (docs/operations.md, Log events): the
    event, the key's digest (never the key), then `` -- `` and what happened."""
    digest = key[:16]
    logger.log(level, "%s key_digest=%s -- %s", event, digest, hint,
               extra={"event": event, "key_digest": digest})  # fmt: skip

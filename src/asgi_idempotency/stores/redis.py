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
as that loop shuts down (:mod:`.loops`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.base import (
    STATUS_OF,
    Bucket,
    Capabilities,
    NewClaim,
    Record,
    RecordStatus,
    StoreBase,
    StoredResponse,
)
from asgi_idempotency.stores.batching import Batcher, BatchStats
from asgi_idempotency.stores.codec import decode_headers, encode_headers
from asgi_idempotency.stores.duplicates import Sighting, SuspectedDuplicate, group_sightings
from asgi_idempotency.stores.errors import ErrorBoundary
from asgi_idempotency.stores.urls import (
    ACCEPTED,
    REDIS_CLUSTER_SCHEMES,
    REDIS_SCHEMES,
    REDIS_SENTINEL_SCHEMES,
    host_list,
)

try:
    import redis.asyncio as aioredis
    from redis import exceptions as rexc
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.retry import Retry
    from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.commands.core import AsyncScript
    from redis.crc import key_slot
except ImportError as exc:  # pragma: no cover - exercised by test_public_api in a subprocess
    raise ImportError("RedisStore needs redis-py: pip install 'asgi-idempotency[redis]'") from exc

__all__ = ["DRIVER_ERRORS", "REDIS_ERRORS", "RedisStore", "translate"]

# Everything redis-py and the network raise for a failed command. RedisError covers
# ConnectionError, TimeoutError and every ResponseError (READONLY, CLUSTERDOWN,
# TRYAGAIN, MOVED/ASK past the client's redirects, NOSCRIPT after a failed reload,
# OOM); RedisClusterException (no slot coverage, cross-slot) derives from Exception.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    rexc.RedisError,
    rexc.RedisClusterException,
    OSError,
    TimeoutError,  # also the store's own deadline (asyncio.timeout, command_timeout)
)


def _left_to_the_driver(exc: BaseException) -> bool:
    # redis-py drops a connection that failed mid-command itself (on any exception,
    # cancellation included): the store never has one to discard.
    return False


# The one place where redis-py's failures become StoreError: every call to the driver
# (the hot path's scripts and pipelines, SCAN, the admin reads) is inside it.
REDIS_ERRORS = ErrorBoundary(DRIVER_ERRORS, _left_to_the_driver)


def translate(exc: BaseException) -> StoreError:
    """The store error for a redis-py exception (raise it ``from exc``)."""
    return REDIS_ERRORS.translate(exc)


_T = TypeVar("_T")


async def _call(op: Awaitable[_T], within: float | None = None) -> _T:
    """Await a redis-py call, for at most ``within`` seconds; a driver failure (a
    timeout included) becomes :class:`StoreError` (:data:`REDIS_ERRORS`).

    Anything else raised inside ``op`` is not the store being unavailable but a bug (a
    client of the wrong kind, a reply we misread) and propagates unchanged: a 500 in
    the log says what it is, where a 503 would send operators after an outage.
    """
    # try/except with the boundary's tuple rather than ``with REDIS_ERRORS``: the same
    # mapping, without two Python-level calls on every request's path.
    try:
        async with asyncio.timeout(within):
            return await op
    except REDIS_ERRORS.errors as exc:
        raise REDIS_ERRORS.translate(exc) from exc


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def _us(value: datetime) -> int:
    """Integer microseconds since the epoch (exact both ways)."""
    if value.tzinfo is None:
        raise StoreError("ValueError: naive datetime: pass an aware UTC datetime")
    return (value - _EPOCH) // _US


def _time(raw: bytes) -> datetime:
    return _EPOCH + timedelta(0, 0, int(raw))  # positional: half the cost of microseconds=…


_IN_PROGRESS = RecordStatus.IN_PROGRESS.value
_COMPLETED = RecordStatus.COMPLETED.value
_FIELDS = ("h", "s", "t", "c", "l", "e", "rs", "rh", "rb")

# A uuid token is unique to one request's claim, so meeting our own token means that
# an earlier attempt of this very call landed and only its answer was lost (redis-py
# retries a command after a dropped connection): report the write as ours rather
# than as somebody else's row. This is transport idempotency, not a lifecycle rule.
# So does a completion: only an in-progress row owned by the token completes, and a
# stored response is never overwritten; a row already completed under our own token
# with the very response we send is our first attempt's, and answers 1 (as the SQL
# stores answer a completion sent again whose first attempt landed), never a lost
# claim. A completed row with another response answers 0.

# The audit's index (suspected_duplicates), written by a claim that carries a scope
# digest, in the same script: ARGV[first] is the index's key (a sorted set in the
# record's own cluster slot: RedisStore._audit_key), ARGV[first + 1] the member
# "<scoped key> <scope digest> <request hash> <route>". Scored by the claim's
# expires_at plus its lease: members past it are trimmed here, and the set's TTL is at
# least the record's plus the lease. A completion restarts the record's retention from
# its own time (within the lease, unless renewed), so an index kept only as long as the
# claim's retention would end before the record it points to.
_AUDIT = """local a, m = ARGV[{first}], ARGV[{first} + 1]
  local ae = string.format('%d', tonumber(e) + tonumber(lease))
  local attl = math.ceil((tonumber(ttl_us) + tonumber(lease)) / 1000)
  redis.call('ZREMRANGEBYSCORE', a, '-inf', '(' .. c)
  redis.call('ZADD', a, ae, m)
  if redis.call('PTTL', a) < attl then redis.call('PEXPIRE', a, string.format('%d', attl)) end"""

# A claim travels as ONE argument, "lease_us ttl_us #h h token"
# (_claim_args): each argument is a round of redis-py's encoding and packing (several
# isinstance checks and a length header each), and Lua splits the string for next to
# nothing. The request hash and the token are any text: the length of h says where it
# ends, and the token is the rest.
# KEYS[1] record; ARGV the claim.
# Returns 0 when written, else the row in the way packed into ONE bulk string:
#   "s c l e rs #h #t #rh now\n" h t rh rb
# a line of the fields that are ours and never hold a space (rs empty while in
# progress), the byte lengths of h, t and rh and the server's time (TIME, in
# microseconds) when it read the row, then the four values back to back
# (binary-safe: the lengths say where each ends, the body is the rest). Every bulk
# reply is a few rounds of redis-py's pure-Python parser (a readline, a read, a
# decode), so one reply instead of an array of five is most of what a replay costs on
# our side of the socket, and _claimed takes it apart with one split and slices.
_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
"""


def _claim_script(arg: int) -> str:
    """The claim in ``ARGV[arg]`` taken apart, and its deadlines from the server's time:
    created, locked_until, expires_at (integers as text: Lua's own number formatting
    would round them) and the key's TTL in whole milliseconds, rounded up, at least 1
    (0 would delete it)."""
    return (
        _NOW
        + f"local lease, ttl_us, n, rest = string.match(ARGV[{arg}], '^(%d+) (%d+) (%d+) (.*)$')"
        + """
n = tonumber(n)
local h, t = string.sub(rest, 1, n), string.sub(rest, n + 1)
local c = string.format('%d', now)
local l = string.format('%d', now + tonumber(lease))
local e = string.format('%d', now + tonumber(ttl_us))
local ttl = math.ceil(tonumber(ttl_us) / 1000)
if ttl < 1 then ttl = 1 end
ttl = string.format('%d', ttl)
"""
    )


_INSERT = (
    _claim_script(1)
    + """
local row = redis.call('HMGET', KEYS[1], 'h', 's', 't', 'c', 'l', 'e', 'rs', 'rh', 'rb')
if row[1] then
  if row[3] == t then return 0 end
  local rh = row[8] or ''
  return row[2] .. ' ' .. row[4] .. ' ' .. row[5] .. ' ' .. row[6] .. ' ' .. (row[7] or '')
    .. ' ' .. #row[1] .. ' ' .. #row[3] .. ' ' .. #rh .. ' ' .. c .. '\\n'
    .. row[1] .. row[3] .. rh .. (row[9] or '')
end
redis.call('HSET', KEYS[1], 'h', h, 's', 'in_progress', 't', t, 'c', c, 'l', l, 'e', e)
redis.call('PEXPIRE', KEYS[1], ttl)
if ARGV[2] then
"""
    + "  "
    + _AUDIT.format(first=2)
    + """
end
return 0
"""
)

# KEYS[1]; ARGV old token, old status, old locked_until, the claim (as _INSERT's).
# Compare-and-swap on the row as read: 1 if swapped.
_REPLACE = (
    _claim_script(4)
    + """
local row = redis.call('HMGET', KEYS[1], 't', 's', 'l')
if row[1] == t then return 1 end
if row[1] ~= ARGV[1] or row[2] ~= ARGV[2] or row[3] ~= ARGV[3] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'h', h, 's', 'in_progress', 't', t, 'c', c, 'l', l, 'e', e)
redis.call('PEXPIRE', KEYS[1], ttl)
if ARGV[5] then
"""
    + "  "
    + _AUDIT.format(first=5)
    + """
end
return 1
"""
)

# KEYS[1]; ARGV "status ttl_us token" (one argument, as a claim's; the token is the
# rest), headers, body. Retention runs from the server's time, as the key's TTL does.
_COMPLETE = (
    _NOW
    + """
local rs, ttl_us, t = string.match(ARGV[1], '^(%d+) (%d+) (.*)$')
local row = redis.call('HMGET', KEYS[1], 't', 's')
if row[1] ~= t then return 0 end
if row[2] == 'completed' then
  local done = redis.call('HMGET', KEYS[1], 'rs', 'rh', 'rb')
  if done[1] == rs and done[2] == ARGV[2] and done[3] == ARGV[3] then
    return 1
  end
  return 0
end
if row[2] ~= 'in_progress' then return 0 end
local e = string.format('%d', now + tonumber(ttl_us))
redis.call('HSET', KEYS[1], 's', 'completed', 'rs', rs, 'rh', ARGV[2], 'rb', ARGV[3], 'e', e)
local ttl = math.ceil(tonumber(ttl_us) / 1000)
if ttl < 1 then ttl = 1 end
redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl))
return 1
"""
)

# KEYS[1]; ARGV token.
_RELEASE = """
local row = redis.call('HMGET', KEYS[1], 't', 's')
if row[1] ~= ARGV[1] or row[2] ~= 'in_progress' then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS[1]; ARGV token, lease_us. The lease runs from the server's time. Retention
# never ends before the lease (Store.renew): past expires_at, the field moves to
# locked_until and the key's TTL to at least the lease, or Redis would delete a live
# claim.
_RENEW = (
    _NOW
    + """
local row = redis.call('HMGET', KEYS[1], 't', 's', 'e')
if row[1] ~= ARGV[1] or row[2] ~= 'in_progress' then return 0 end
local deadline = now + tonumber(ARGV[2])
local l = string.format('%d', deadline)
if deadline > tonumber(row[3]) then
  redis.call('HSET', KEYS[1], 'l', l, 'e', l)
  local ttl = math.ceil(tonumber(ARGV[2]) / 1000)
  if ttl > redis.call('PTTL', KEYS[1]) then
    redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl))
  end
else
  redis.call('HSET', KEYS[1], 'l', l)
end
return 1
"""
)

# KEYS[1]; ARGV the cut-off, or "" for the server's time. Deletes the row only if its
# expires_at has passed (a racing claim may have replaced it since it was scanned).
_PRUNE = (
    _NOW
    + """
local at = now
if ARGV[1] ~= '' then at = tonumber(ARGV[1]) end
local e = redis.call('HGET', KEYS[1], 'e')
if e and tonumber(e) <= at then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
)

_SCAN_COUNT = 1000
# Requests per pipeline, at most, by default (as SQLStore's MAX_BATCH).
MAX_BATCH = 256
_BATCH = 500

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

_Client = aioredis.Redis | RedisCluster


# One script call for a pipeline: (script, record key, arguments, payload bytes for the
# batcher's max_bytes). A plain tuple: built on every request, where a NamedTuple's
# __new__ is a Python call.
_Op = tuple[AsyncScript, str, Sequence[Any], int]


def _op_key(op: _Op) -> str:
    return op[1]


def _op_size(op: _Op) -> int:
    return op[3]


# Replies a cluster node gives for a command it did not run because the slot is not
# (or not yet, or no longer) its own: each is sent again through the cluster client,
# which follows the redirect.
_REDIRECTED = (rexc.MovedError, rexc.AskError, rexc.TryAgainError)


def _escape_glob(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


# A hash tag for each cluster slot (index = slot), built on first use: the audit's set
# of a slot is named with its slot's tag (RedisStore._audit_key).
_SLOT_TAGS: list[str] = []


def _slot_tag(slot: int) -> str:
    if not _SLOT_TAGS:
        tags: dict[int, str] = {}
        i = 0
        while len(tags) < 16384:
            tag = f"audit-{i}"
            tags.setdefault(key_slot(tag.encode()), tag)
            i += 1
        _SLOT_TAGS.extend(tags[n] for n in range(16384))
    return _SLOT_TAGS[slot]


def _split_url(url: str) -> tuple[str, bool]:
    """(the URL redis-py reads, whether it names a cluster); the store's own query
    parameters (:func:`_store_options`) left out."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in REDIS_SCHEMES:
        raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r}: use {ACCEPTED}")
    cluster = scheme in REDIS_CLUSTER_SCHEMES
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k not in _STORE_OPTIONS])
    return urlunsplit(parts._replace(scheme=scheme.partition("+")[0], query=query)), cluster


# Query parameters of a Redis URL that are the store's, not redis-py's: the CLI and
# open_store() build a store from its URL alone.
_STORE_OPTIONS = {"wait_replicas": int, "wait_timeout": float}


def _store_options(url: str) -> dict[str, Any]:
    """``wait_replicas`` and ``wait_timeout`` as the URL's query gives them."""
    options: dict[str, Any] = {}
    for name, value in parse_qsl(urlsplit(url).query):
        if name in _STORE_OPTIONS:
            try:
                options[name] = _STORE_OPTIONS[name](value)
            except ValueError:
                raise ValueError(f"{name}={value!r} in the Redis URL is not a number") from None
    return options


# The Sentinels' own clients of each Sentinel manager we built.
_SENTINELS: weakref.WeakKeyDictionary[Sentinel, list[aioredis.Redis]] = weakref.WeakKeyDictionary()

#: Sentinel's port, where a Sentinel of a ``redis+sentinel://`` URL names none.
SENTINEL_PORT = 26379


def _sentinel_client(url: str, options: dict[str, Any]) -> aioredis.Redis:
    """The master's client, as Sentinel names it, for
    ``redis+sentinel://[user:password@]h1:26379,h2:26379/service[/db]``.

    The credentials and ``ssl`` (``rediss+sentinel``) are the master's and the
    replicas'; ``?sentinel_username=``/``?sentinel_password=`` are the Sentinels' own,
    where they require one. redis-py's Sentinel client asks the Sentinels for the
    master on every new connection, and drops a connection that meets ``READONLY``
    (a demoted master), so a failover costs requests 503 only until the Sentinels
    have promoted a replica.
    """
    parts = urlsplit(url)
    hosts = host_list(url, SENTINEL_PORT)
    if hosts is None:
        host, port = parts.hostname, parts.port
        if not host:
            raise ValueError(f"a Sentinel URL names its Sentinels as host:port: use {ACCEPTED}")
        hosts = [(host, port or SENTINEL_PORT)]
    service, _, db = parts.path.strip("/").partition("/")
    if not service or (db and not db.isdigit()):
        raise ValueError(
            "a Sentinel URL names the master's service and, optionally, the database "
            f"after the Sentinels (redis+sentinel://h1:26379,h2:26379/mymaster/0): use {ACCEPTED}"
        )
    userinfo = parts.netloc.rpartition("@")[0]
    user, colon, password = userinfo.partition(":")
    query = dict(parse_qsl(parts.query))
    unknown = sorted(set(query) - {*_STORE_OPTIONS, "sentinel_username", "sentinel_password"})
    if unknown:  # refused rather than ignored: none of them would reach redis-py
        raise ValueError(
            f"a Sentinel URL takes ?wait_replicas=, ?wait_timeout=, ?sentinel_username= and "
            f"?sentinel_password=, not {', '.join(unknown)}"
        )
    # Each Sentinel answers within its share of a call's deadline, so that master
    # discovery can move past a hung one and still ask the others.
    share = options["socket_connect_timeout"] / (len(hosts) + 1)
    sentinel_options: dict[str, Any] = {
        "socket_timeout": share,
        "socket_connect_timeout": share,
        "protocol": options["protocol"],
    }
    for name in ("username", "password"):
        if f"sentinel_{name}" in query:
            sentinel_options[name] = query[f"sentinel_{name}"]
    tls = parts.scheme.lower().startswith("rediss")
    if tls:
        sentinel_options["ssl"] = True
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_options)
    # Closed with the master's client (_close_clients). A copy of the list, not the
    # list: redis-py (8.2) moves the Sentinel that answered to its front with a swap
    # across an await, and concurrent discoveries can leave one Sentinel's client
    # twice in the list and another's not at all (then never closed by Sentinel.aclose).
    _SENTINELS[sentinel] = list(sentinel.sentinels)
    client: aioredis.Redis = sentinel.master_for(
        service,
        redis_class=aioredis.Redis,
        db=int(db or 0),
        username=unquote(user) or None,
        password=unquote(password) if colon else None,
        ssl=tls,
        **options,
    )
    return client


class RedisStore(StoreBase):
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

    def _encoder(self) -> Any:
        if isinstance(self.client, RedisCluster):
            return self.client.get_encoder()
        return self.client.connection_pool.get_encoder()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    def _key(self, key: str) -> str:
        return f"{self._prefix}{key}}}"

    def _scoped(self, name: bytes) -> str:
        return name.decode()[len(self._prefix) : -1]

    async def _warm(self) -> None:
        async with self._warming:
            if self._cold:
                assert isinstance(self.client, RedisCluster)
                await _call(self.client.initialize(), self._timeout)
                self._cold = False

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

    async def _demoted(self) -> None:
        """``READONLY``: the server this client reached is a replica now (a failover
        demoted it, and a DNS name or virtual IP may already lead to the new primary).
        To the store that is a broken connection: the pool's idle connections, the one
        that met it among them, are dropped, so the next command connects afresh. The
        request still gets 503: its command did not run. (A client from
        ``Sentinel.master_for`` does this itself, asking the Sentinels again.)"""
        client = self.client
        if isinstance(client, RedisCluster):
            return  # the cluster client follows the slot map: MOVED, not READONLY
        with contextlib.suppress(*DRIVER_ERRORS):
            await client.connection_pool.disconnect(inuse_connections=False)

    def _batcher(self, rkey: str) -> Batcher[_Op, Any]:
        """The batcher of ``rkey``'s server: the one server's, or its slot's primary's."""
        client = self.client
        name = ""
        if isinstance(client, RedisCluster):
            # No node for the slot (a map mid-change): such a batch goes by the cluster
            # client, command by command (_send).
            node = client.get_node_from_key(rkey)
            name = "?" if node is None else node.name
        batcher = self._batchers.get(name)
        if batcher is None:
            batcher = self._batchers[name] = Batcher(
                functools.partial(self._pipeline, name),
                key=_op_key,
                # Redis runs a pipeline's scripts one after another, each atomic, in the
                # order sent (arrival order): a second operation on a key in the same
                # pipeline sees what the first did, as in a command of its own just after.
                distinct=False,
                max_size=self._max_batch,
                size=_op_size,
                # A request that finds the server idle is sent from its own task, as
                # without batching: no task, future and loop pass of the batcher's, so
                # a lone request costs what it did. Cancelling it is then what it was
                # without batching (a claim's is the lifecycle's orphaned callback's).
                inline=self._alone,
            )
        return batcher

    @property
    def batch_stats(self) -> BatchStats:
        """Pipelines sent and script calls they carried, over every server (this loop's)."""
        total = BatchStats()
        for batcher in self._batchers.values():
            total.statements += batcher.stats.statements
            total.operations += batcher.stats.operations
            total.largest = max(total.largest, batcher.stats.largest)
        return total

    def _alone(self, op: _Op) -> Awaitable[Any]:
        # Within the caller's own deadline (_run); no loop pass before the send: the
        # request found nothing to wait for.
        return self._evalsha(op[0], op[1], op[2], pause=False)

    async def _pipeline(self, node: str, batch: list[_Op]) -> list[Any]:
        """Send ``batch`` to its server: alone, as the one command; else one pipeline.

        Returns each command's reply, or the error reply it got (a ``ResponseError``),
        for its waiter to raise. Raises :class:`StoreError` when the pipeline as a whole
        failed (unreachable, timed out): every request in it then fails.
        """
        if len(batch) == 1:
            # Alone: what an unbatched request sends, through the client that follows
            # redirects; no loop pass first (the batcher's task was one).
            script, rkey, args, _ = batch[0]
            return [await _call(self._evalsha(script, rkey, args, pause=False), self._timeout)]
        client = self.client
        target: aioredis.Redis | None
        if isinstance(client, RedisCluster):
            # A plain pipeline on the primary's own connection: the batch is one node's
            # by construction, and a redirected command is re-sent on its own below.
            found = client.get_node(node_name=node)
            target = None if found is None else self._node_client(found)
        else:
            target = client
        return await _call(self._send(target, batch), self._timeout)

    async def _send(self, target: aioredis.Redis | None, batch: list[_Op]) -> list[Any]:
        cluster = self.client if isinstance(self.client, RedisCluster) else None
        if target is None:  # the node left the map since the batch was queued
            replies: list[Any] = [rexc.MovedError("0 node-left:0")] * len(batch)
        else:
            try:
                replies = await _pipe(target, batch)
                lost = [i for i, r in enumerate(replies) if isinstance(r, rexc.NoScriptError)]
                if lost:
                    # A flushed or restarted server: load what it lost, send those again
                    # (they did not run).
                    for script in {id(batch[i][0]): batch[i][0] for i in lost}.values():
                        script.sha = await target.script_load(script.script)
                    again = await _pipe(target, [batch[i] for i in lost])
                    for i, reply in zip(lost, again, strict=True):
                        replies[i] = reply
            except (rexc.ConnectionError, rexc.TimeoutError, OSError):
                if cluster is not None:
                    await self._refresh_slots(cluster)  # a dead or demoted node
                raise
        if cluster is not None:
            moved = [i for i, reply in enumerate(replies) if isinstance(reply, _REDIRECTED)]
            if moved:
                await self._refresh_slots(cluster, wait=True)
                for i in moved:  # in the order sent, so one key's operations stay in order
                    script, rkey, args, _ = batch[i]
                    try:
                        replies[i] = await self._evalsha(script, rkey, args, pause=False)
                    except StoreError as exc:
                        replies[i] = exc.__cause__ or exc
        return replies

    async def _evalsha(
        self, script: AsyncScript, rkey: str, args: Sequence[Any], *, pause: bool = True
    ) -> Any:
        # What AsyncScript.__call__ does, without its three layers of calls (evalsha,
        # _evalsha), tuple copies and per-call import: EVALSHA, and on NOSCRIPT (a
        # flushed or restarted server) SCRIPT LOAD and once more.
        execute = self.client.execute_command
        # One loop pass before the send: the requests that became ready in this pass
        # send their commands together, so redis-server wakes once for several and the
        # replies come back in one poll. Without it each send woke the server on its own
        # (measured in docs/performance.md). Cancelled here, nothing has been sent.
        if pause:
            await asyncio.sleep(0)
        try:
            try:
                return await execute("EVALSHA", script.sha, 1, rkey, *args)
            except rexc.NoScriptError:
                script.sha = await self.client.script_load(script.script)
                return await execute("EVALSHA", script.sha, 1, rkey, *args)
        except REDIS_ERRORS.errors as exc:
            # Here as well as in _call: a lone batched request is sent from here with no
            # _call of its own around it (its caller's deadline is the bound).
            raise REDIS_ERRORS.translate(exc) from exc

    async def _run_and_wait(self, script: AsyncScript, key: str, args: Sequence[Any]) -> Any:
        # WAIT counts the replicas that have *this connection's* writes, so it must go on
        # the connection that ran the script: both in one pipeline, one round trip. On a
        # cluster that is a plain pipeline to the key's primary: a cluster pipeline
        # re-sends a redirected or failed command on its own, and the WAIT would then
        # count another connection's writes.
        rkey, cluster = self._key(key), self.client
        target: aioredis.Redis
        if isinstance(cluster, RedisCluster):
            await cluster.initialize()  # fills the slot map on first use; else a no-op
            target = self._node_client(cluster.get_node_from_key(rkey))
        else:
            target = cluster
        followed = False
        try:
            while True:
                pipe = target.pipeline(transaction=False)
                # EVAL with the script's text, never EVALSHA: a server that lacks the
                # script (a replica just promoted by a failover, a restart) would answer
                # NOSCRIPT, and the WAIT pipelined behind it would still block for its
                # whole timeout when no replica is attached, before the reload and the
                # second try; every write that meets a fresh primary paid it. The text
                # costs bytes on a path that already waits for replication.
                pipe.execute_command("EVAL", script.script, 1, rkey, *args)
                pipe.execute_command("WAIT", self._wait, self._wait_ms)
                try:
                    result, acked = await pipe.execute()
                except rexc.MovedError as moved:
                    # The slot has another primary now (a failover, a resharding) and
                    # this node ran nothing: send it once more, to the primary a fresh
                    # map names, as the cluster client does for its own commands. Still
                    # inside the call's deadline (_run); a second MOVED is a 503.
                    if followed or not isinstance(cluster, RedisCluster):
                        raise
                    followed = True
                    target = await self._moved_to(cluster, rkey, moved)
                    continue
                if int(acked) < self._wait:
                    raise StoreError(
                        f"WAIT: {acked} of {self._wait} replicas acknowledged the write "
                        f"within {self._wait_ms} ms"
                    )
                return result
        except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError, OSError):
            if isinstance(cluster, RedisCluster):
                await self._refresh_slots(cluster)  # MOVED, a dead node: the map is stale
            raise

    async def _moved_to(
        self, cluster: RedisCluster, rkey: str, moved: rexc.MovedError
    ) -> aioredis.Redis:
        """The client of ``rkey``'s primary after ``moved``, with the slot map refreshed.

        The address the MOVED names is the server's own answer, so it wins over a map
        read from a node that may not have learnt the change yet; the map's node serves
        when the MOVED names a node the map does not know.
        """
        await self._refresh_slots(cluster, wait=True)
        node = cluster.get_node(host=moved.host, port=moved.port)
        if node is None:
            # A node the map did not have: the refresh waited for may have begun before
            # the slot moved, so ask once more.
            await self._refresh_slots(cluster, wait=True)
            node = cluster.get_node(host=moved.host, port=moved.port)
        if node is None:
            node = cluster.get_node_from_key(rkey)
        if node is None:
            raise moved
        return self._node_client(node)

    def _node_client(self, node: Any) -> aioredis.Redis:
        """A plain client of one cluster node, built from that node's own settings."""
        client = self._node_clients.get(node.name)
        if client is None:
            pool = aioredis.ConnectionPool(
                connection_class=node.connection_class, **node.connection_kwargs
            )
            client = self._node_clients[node.name] = aioredis.Redis(connection_pool=pool)
        return client

    async def _refresh_slots(self, cluster: RedisCluster, *, wait: bool = False) -> None:
        """Ask a node for the slot map again; ``wait``: return only once a refresh has
        ended (the one already in flight, if any), for a caller about to use the map."""
        if self._refreshing.locked():
            if wait:
                async with self._refreshing:
                    pass  # the refresh in flight has ended: its map is the one to read
            return  # another request is already asking
        # Mid-failover it may fail too: the next request asks again.
        async with self._refreshing:
            with contextlib.suppress(*DRIVER_ERRORS):
                await cluster.nodes_manager.initialize()

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

    # Off the hot path: SCAN over every primary (admin tools and tests).

    async def get(self, key: str) -> Record | None:
        self._bound()
        if self._cold:
            await self._warm()
        row = await _call(self.client.hmget(self._key(key), _FIELDS), self._timeout)
        return None if row[0] is None else _record(key, row)

    async def _scan(self, match: str) -> AsyncIterator[bytes]:
        # On a cluster redis-py's scan_iter walks every primary.
        self._bound()
        if self._cold:
            await self._warm()
        names = aiter(self.client.scan_iter(match=match, count=_SCAN_COUNT))
        while True:
            try:  # each step within the deadline and the boundary, as in _call
                with REDIS_ERRORS:
                    async with asyncio.timeout(self._timeout):
                        name = await anext(names)
            except StopAsyncIteration:
                return
            yield name

    async def _batches(self, match: str) -> AsyncIterator[list[bytes]]:
        batch: list[bytes] = []
        async for name in self._scan(match):
            batch.append(name)
            if len(batch) >= _BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    async def _fields(self, names: Sequence[bytes], *fields: str) -> list[list[Any]]:
        """HMGET ``fields`` of each key in one pipeline (per node, on a cluster)."""
        self._bound()
        pipe: Any = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, fields)
        return cast(list[list[Any]], await _call(pipe.execute(), self._timeout))

    async def find(self, prefix: str, *, limit: int = 2) -> list[Record]:
        names: list[bytes] = []
        async for name in self._scan(f"{self._match}{_escape_glob(prefix)}*"):
            names.append(name)
        chosen = heapq.nsmallest(limit, names)
        rows = await self._fields(chosen, *_FIELDS) if chosen else []
        return [
            _record(self._scoped(name), row)
            for name, row in zip(chosen, rows, strict=True)
            if row[0] is not None
        ]

    async def _server_us(self, now: datetime | None) -> int:
        """``now`` in microseconds, or the server's time (one server's, on a cluster)."""
        if now is not None:
            return _us(now)
        self._bound()
        seconds, micros = await _call(self.client.time(), self._timeout)
        return int(seconds) * 1_000_000 + int(micros)

    async def buckets(self, *, now: datetime | None = None) -> list[Bucket]:
        at = await self._server_us(now)
        groups: dict[tuple[str, bool, bool], tuple[int, int | None]] = {}
        async for batch in self._batches(f"{self._match}*"):
            for status, created, locked, expires in await self._fields(batch, "s", "c", "l", "e"):
                if status is None:
                    continue  # expired or deleted since the scan
                group = (status.decode(), int(expires) <= at, int(locked) <= at)
                count, oldest = groups.get(group, (0, None))
                c = int(created)
                groups[group] = (count + 1, c if oldest is None else min(oldest, c))
        return [
            Bucket(
                STATUS_OF[status],
                expired,
                lease_over,
                count,
                None if oldest is None else _EPOCH + timedelta(microseconds=oldest),
            )
            for (status, expired, lease_over), (count, oldest) in groups.items()
        ]

    async def count_expired(self, *, now: datetime | None = None) -> int:
        at, total = await self._server_us(now), 0
        async for batch in self._batches(f"{self._match}*"):
            rows = await self._fields(batch, "e")
            total += sum(1 for (e,) in rows if e is not None and int(e) <= at)
        return total

    async def suspected_duplicates(
        self, *, since: datetime, window: timedelta, route: str | None = None
    ) -> list[SuspectedDuplicate]:
        """From the audit's sorted sets (every primary's, by SCAN): the entries of one
        scope and fingerprint under several keys, each checked against its record (a
        released record, or one claimed again for another request, is not a sighting)."""
        names = [name async for name in self._scan(f"{_escape_glob(self._audit_prefix)}*")]
        groups: dict[tuple[str, str], dict[str, str]] = {}
        for start in range(0, len(names), _BATCH):
            pipe: Any = self.client.pipeline(transaction=False)
            for name in names[start : start + _BATCH]:
                pipe.zrange(name, 0, -1)
            for members in await _call(pipe.execute(), self._timeout):
                for member in members:
                    key, scope, h, path = member.decode().split(" ", 3)
                    if route is None or path == route:
                        groups.setdefault((scope, h), {})[key] = path
        candidates = [(scope, h, key, path) for (scope, h), keys in groups.items()
                      if len(keys) > 1 for key, path in keys.items()]  # fmt: skip
        sightings: list[Sighting] = []
        at = _us(since)
        for start in range(0, len(candidates), _BATCH):
            chunk = candidates[start : start + _BATCH]
            rows = await self._fields([self._key(c[2]).encode() for c in chunk], "h", "c")
            for (scope, h, key, path), (stored_h, created) in zip(chunk, rows, strict=True):
                if stored_h is not None and stored_h.decode() == h and int(created) >= at:
                    sightings.append(Sighting(scope, path, h, key, _time(created)))
        return group_sightings(sightings, window)

    async def prune(self, *, now: datetime | None = None, batch_size: int = 1000) -> int:
        """Delete up to ``batch_size`` records whose ``expires_at <= now`` that remain.

        Redis deletes every record itself when its TTL runs out, so production needs
        no prune job; this removes records whose ``expires_at`` has passed before their
        TTL (``now`` ``None``: at each server's own time, checked in the script).
        """
        at, deleted = await self._server_us(now), 0
        cutoff = "" if now is None else at
        self._bound()
        # Pipelined EVALSHA does not reload a missing script: load it first (every
        # primary, on a cluster).
        script = self._prune
        script.sha = await _call(self.client.script_load(script.script), self._timeout)
        async for batch in self._batches(f"{self._match}*"):
            rows = await self._fields(batch, "e")
            due = [n for n, (e,) in zip(batch, rows, strict=True) if e is not None and int(e) <= at]
            due = due[: batch_size - deleted]
            if due:
                pipe: Any = self.client.pipeline(transaction=False)
                for name in due:
                    pipe.execute_command("EVALSHA", script.sha, 1, name, cutoff)
                deleted += sum(await _call(pipe.execute(), self._timeout))
            if deleted >= batch_size:
                break
        return deleted

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
        # False: the connections are another loop's, closed as that loop shuts down.


async def _pipe(target: aioredis.Redis, batch: Sequence[_Op]) -> list[Any]:
    """One pipeline (no MULTI) of ``batch``'s script calls; a command's error reply is
    its entry in the result rather than raised, so it fails that request alone."""
    pipe = target.pipeline(transaction=False)
    for op in batch:
        pipe.execute_command("EVALSHA", op[0].sha, 1, op[1], *op[2])
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


def _log_orphan(level: int, event: str, key: str, hint: str) -> None:
    """One line as the middleware's events are (docs/operations.md, Log events): the
    event, the key's digest (never the key), then `` -- `` and what happened."""
    digest = key[:16]
    logger.log(level, "%s key_digest=%s -- %s", event, digest, hint,
               extra={"event": event, "key_digest": digest})  # fmt: skip


async def _close_clients(client: _Client | None, node_clients: dict[str, aioredis.Redis]) -> None:
    """Close one loop's node clients and, if it is the store's own, its client."""
    for node_client in node_clients.values():
        await node_client.aclose(close_connection_pool=True)
    node_clients.clear()
    if client is not None:
        await client.aclose()
        pool = getattr(client, "connection_pool", None)
        if isinstance(pool, SentinelConnectionPool):  # a redis+sentinel:// URL's
            for sentinel in _SENTINELS.get(pool.sentinel_manager, []):
                await sentinel.aclose()


def _record(key: str, row: Sequence[Any]) -> Record:
    h, s, t, c, lu, e, rs, rh, rb = row
    response = None if rs is None else StoredResponse(int(rs), decode_headers(rh), bytes(rb))
    return Record(
        key, h.decode(), STATUS_OF[s.decode()], t.decode(), _time(c), _time(lu), _time(e), response
    )


# A row's status field to its member, from the bytes Redis returns (no decode).
_STATUS_OF_BYTES = {status.value.encode(): status for status in RecordStatus}


def _claimed(key: str, packed: bytes) -> Record:
    """The row in an insert's way, from ``_INSERT``'s one packed string."""
    line = packed.index(b"\n")
    s, c, lu, e, rs, nh, nt, nrh, read_at = packed[:line].split(b" ")
    h_end = line + 1 + int(nh)
    t_end = h_end + int(nt)
    response = None
    if rs:
        rh_end = t_end + int(nrh)
        headers = decode_headers(packed[t_end:rh_end])
        response = StoredResponse(int(rs), headers, packed[rh_end:])
    h, t = packed[line + 1 : h_end].decode(), packed[h_end:t_end].decode()
    return Record(
        key, h, _STATUS_OF_BYTES[s], t, _time(c), _time(lu), _time(e), response, _time(read_at)
    )


def _make_client(url: str, command_timeout: float) -> _Client:
    redis_url, cluster = _split_url(url)
    sentinel = urlsplit(url).scheme.lower() in REDIS_SENTINEL_SCHEMES
    # A few quick retries of a dropped connection (the scripts recognise their own
    # landed write, above); past them the request gets 503 rather than a long wait.
    retry = Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.25), retries=2)
    options: dict[str, Any] = {
        # RESP2, as redis-py 5-7 speak by default: the same replies on every supported
        # redis-py, and none of 8.x's RESP3-only connection handshakes (one of which
        # raced under concurrent connects to a cluster).
        "protocol": 2,
        "socket_timeout": command_timeout,
        "socket_connect_timeout": command_timeout,
        "retry": retry,
    }
    if cluster:
        # The cluster client redirects, refreshes its slot map and retries inside one
        # call, each attempt with its own socket timeout, so a hung node took a multiple
        # of command_timeout to fail. The store bounds each whole call as on one server
        # (_run, _call, _scan); the socket timeout stays as a backstop for anything the
        # client reads outside a store call. A cancelled call is safe on the cluster
        # client too: a ClusterNode sends and reads on a Connection whose send_packed_command
        # and read_response disconnect it on any BaseException, CancelledError included,
        # before the node puts it back in its free queue (so it reconnects on next use),
        # and a slot-map refresh swaps the new map in only once it is complete.
        # tests/stores/test_redis.py::test_a_hung_cluster_node_is_a_503_within_the_command_timeout
        # reads every reply after such cancellations.
        return RedisCluster.from_url(redis_url, **options)
    # One server: no socket_timeout (redis-py's default is 5 s). With one, redis-py
    # wraps every send in asyncio.wait_for, a Task and a loop pass of its own, and every
    # read in a timeout: a large share of a first request's own cost. The
    # store bounds each whole call with asyncio.timeout(command_timeout) instead (_run,
    # _call), so a hung server is still a StoreError, and sooner: the bound covers the
    # retries, where a socket timeout applied to each attempt. Cancelled mid-send or
    # mid-read, redis-py disconnects the connection, so no reply is left in flight.
    options["socket_timeout"] = None
    if sentinel:
        return _sentinel_client(url, options)
    return aioredis.Redis.from_url(redis_url, **options)

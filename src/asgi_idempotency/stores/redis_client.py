"""The Redis store's driver and connections: redis-py's failures as :class:`StoreError`
(:data:`REDIS_ERRORS`), the client a URL names (one server, Sentinel's master, a
Cluster) and how one loop's clients close.

Part of :mod:`asgi_idempotency.stores.redis` (the store); no import of SQLAlchemy or
any other driver.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.errors import ErrorBoundary
from asgi_idempotency.stores.registry import (
    REDIS_CLUSTER_SCHEMES,
    REDIS_SCHEMES,
    REDIS_SENTINEL_SCHEMES,
    accepted,
)
from asgi_idempotency.stores.urls import host_list

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

# The redis-py names the store's other modules use, imported here once, behind the
# message that names the extra.
__all__ = [
    "DRIVER_ERRORS",
    "REDIS_ERRORS",
    "SENTINEL_PORT",
    "AsyncScript",
    "RedisCluster",
    "aioredis",
    "key_slot",
    "rexc",
    "translate",
]

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


_Client = aioredis.Redis | RedisCluster


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
        raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r}: use {accepted()}")
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
            raise ValueError(f"a Sentinel URL names its Sentinels as host:port: use {accepted()}")
        hosts = [(host, port or SENTINEL_PORT)]
    service, _, db = parts.path.strip("/").partition("/")
    if not service or (db and not db.isdigit()):
        raise ValueError(
            "a Sentinel URL names the master's service and, optionally, the database "
            f"after the Sentinels (redis+sentinel://h1:26379,h2:26379/mymaster/0): use {accepted()}"
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

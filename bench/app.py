"""The benchmark's refund app, in every variant, served by uvicorn: ``--factory bench.app:create``.

``BENCH_VARIANT`` picks the guard in front of the same handler:

- ``none``: no guard (the ceiling);
- ``sqlite`` / ``memory`` / ``mariadb``: :class:`IdempotencyMiddleware` on that store
  (``mariadb``: ``SQLStore`` on ``mariadb+asyncmy``);
- ``postgres_batched`` / ``postgres_unbatched``: the same on ``SQLStore(batching=True)``
  / ``SQLStore(batching=False)``, named by configuration rather than by the default;
- ``floor_pg``: the least a Postgres guard can do (:class:`FloorGuard` on raw asyncpg):
  one statement for a replay, 409 or 422, two for a first request, nothing else;
- ``floor_sqlite``: the same guard on one raw aiosqlite connection;
- ``floor_mariadb``: the same guard on raw asyncmy: a pool of autocommit connections,
  the statements a ``mysql+asyncmy://`` store sends (``INSERT IGNORE``, the ``SELECT`` of
  the row in the way only when it did not insert, the fenced ``UPDATE``) as server-side
  prepared statements;
- ``floor_mariadb_returning``: the same with the claim a ``mariadb+asyncmy://`` store
  sends, one ``INSERT ... ON DUPLICATE KEY UPDATE ... RETURNING`` (the token, to tell
  its own row, and the five columns the floor reads);
- ``floor_memory``: the same guard on a dict: what any guard that buffers and
  captures costs in front of this handler, with no store I/O at all;
- ``redis``: :class:`IdempotencyMiddleware` on :class:`RedisStore` (``BENCH_REDIS_URL``);
- ``floor_redis``: the same guard on raw redis-py doing the same two commands (a claim
  script and a complete script, ``EVALSHA`` each);
- ``peer_*``: another library's guard on the same route (``bench/peers.py``): Redis-backed
  ones, and idemkit on Postgres and on Redis (``peer_idemkit_pg``, ``peer_idemkit_redis``).

The floors on a networked store (asyncpg, asyncmy, redis-py) hold one open connection
per load connection, ``BENCH_FLOOR_POOL_SIZE`` (the harness sets it to wrk's ``-c``;
unset, they refuse to start), handed back with no reset: each request's statements
never wait for a connection and never pay a round trip that is not theirs. Ours
keeps the store's default configuration. The SQLite floor keeps one connection:
SQLite admits one writer at a time, so more connections would only wait for each
other in ``busy_timeout`` sleeps (as ``SQLStore`` on SQLite, one connection too).

The handler does no I/O of its own, so the guard's cost is what the numbers show.
``BENCH_PG_URL`` (``postgresql://…``), ``BENCH_MARIADB_URL`` (``mariadb+asyncmy://…``) and
``BENCH_SQLITE_PATH`` say where the stores live.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asgi_idempotency.http.principals import ANONYMOUS

if TYPE_CHECKING:  # imported where used, as the other variants do not need it
    import asyncpg

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=24)


async def refund(request: Request) -> Response:
    payload = orjson.loads(await request.body())
    if "delay" in payload:  # only the round-trip count uses it, to hold a request in flight
        await asyncio.sleep(float(payload["delay"]))
    body = orjson.dumps(
        {
            "refund_id": str(uuid.uuid4()),
            "order_id": request.path_params["order_id"],
            "amount": payload["amount"],
        }
    )
    return Response(body, status_code=201, media_type="application/json")


async def health(request: Request) -> Response:
    return Response(b'{"ok":true}', media_type="application/json")


ROUTES = [
    Route("/orders/{order_id}/refunds", refund, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
]

# ---------------------------------------------------------------------------------------
# The floor: a pure-ASGI guard with nothing but the statements, on the raw driver.

PG_CLAIM = """
WITH ins AS (
    INSERT INTO idempotency_records
        (key, request_hash, status, token, created_at, locked_until, expires_at)
    VALUES ($1, $2, 'in_progress', $3, $4, $5, $6)
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins), r.request_hash, r.status, r.response_status,
       r.response_headers, r.response_body
FROM (SELECT 1) AS one
LEFT JOIN idempotency_records AS r ON r.key = $1 AND NOT EXISTS (SELECT 1 FROM ins)
"""
PG_COMPLETE = """
UPDATE idempotency_records SET status = 'completed', expires_at = $3, response_status = $4,
       response_headers = $5, response_body = $6
WHERE key = $1 AND token = $2 AND status = 'in_progress'
"""
SQLITE_INSERT = """
INSERT INTO idempotency_records
    (key, request_hash, status, token, created_at, locked_until, expires_at)
VALUES (?, ?, 'in_progress', ?, ?, ?, ?)
ON CONFLICT (key) DO NOTHING
RETURNING 1
"""
SQLITE_SELECT = """
SELECT 0, request_hash, status, response_status, response_headers, response_body
FROM idempotency_records WHERE key = ?
"""
SQLITE_COMPLETE = """
UPDATE idempotency_records SET status = 'completed', expires_at = ?, response_status = ?,
       response_headers = ?, response_body = ?
WHERE key = ? AND token = ? AND status = 'in_progress'
"""


def _sqlite_time(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def floor_pool_size() -> int:
    """Connections a floor holds: ``BENCH_FLOOR_POOL_SIZE``, one per load connection.

    Required: a default would be a guess at the load, and a floor with fewer
    connections than the load has requests in flight makes requests queue for one.
    """
    size = os.environ.get("BENCH_FLOOR_POOL_SIZE")
    if size is None or not size.isdigit() or int(size) < 1:
        raise RuntimeError(
            f"BENCH_FLOOR_POOL_SIZE={size!r}: set it to the load's connection count "
            "(bench.run and bench.batching set it to wrk's -c)"
        )
    return int(size)


async def _no_reset(conn: asyncpg.Connection) -> None:
    pass


async def floor_pool(url: str, size: int) -> asyncpg.Pool:
    """The floor's asyncpg pool: ``size`` connections, no reset on release.

    asyncpg's default reset (advisory unlock, CLOSE ALL, UNLISTEN, RESET ALL) is a round
    trip of its own per release; single autocommit statements leave no session state.
    """
    import asyncpg

    return await asyncpg.create_pool(url, min_size=size, max_size=size, reset=_no_reset)


class _PgBackend:
    def __init__(self, url: str) -> None:
        self.url = url
        self.pool: Any = None

    async def start(self) -> None:
        self.pool = await floor_pool(self.url, floor_pool_size())

    async def stop(self) -> None:
        await self.pool.close()

    async def claim(self, key: str, h: str, token: str, now: datetime) -> Any:
        async with self.pool.acquire() as c:
            return await c.fetchrow(PG_CLAIM, key, h, token, now, now + LEASE, now + TTL)

    async def complete(
        self, key: str, token: str, status: int, headers: bytes, body: bytes
    ) -> None:
        expires = datetime.now(UTC) + TTL
        async with self.pool.acquire() as c:
            await c.execute(PG_COMPLETE, key, token, expires, status, headers, body)


class _SQLiteBackend:
    def __init__(self, path: str) -> None:
        self.path = path
        self.conn: Any = None

    async def start(self) -> None:
        import aiosqlite

        self.conn = await aiosqlite.connect(self.path, isolation_level=None)
        for pragma in ("journal_mode=WAL", "busy_timeout=10000", "synchronous=NORMAL"):
            await self.conn.execute(f"PRAGMA {pragma}")

    async def stop(self) -> None:
        await self.conn.close()

    async def claim(self, key: str, h: str, token: str, now: datetime) -> Any:
        args = (
            key,
            h,
            token,
            _sqlite_time(now),
            _sqlite_time(now + LEASE),
            _sqlite_time(now + TTL),
        )
        if await self.conn.execute_fetchall(SQLITE_INSERT, args):
            return (True,)
        rows = list(await self.conn.execute_fetchall(SQLITE_SELECT, (key,)))
        return rows[0] if rows else (False, None, None)

    async def complete(
        self, key: str, token: str, status: int, headers: bytes, body: bytes
    ) -> None:
        expires = _sqlite_time(datetime.now(UTC) + TTL)
        await self.conn.execute_fetchall(
            SQLITE_COMPLETE, (expires, status, headers, body, key, token)
        )


# MariaDB: the statements of SQLStore's hot path (stores/statements.py, MYSQL), the
# SELECT reading only what the floor answers from. No RETURNING on an insert that was
# ignored, so a replay, 409 or 422 is two statements here, as it is for the store.
MARIADB_CLAIM = """
INSERT IGNORE INTO idempotency_records
    (`key`, request_hash, status, token, created_at, locked_until, expires_at)
VALUES (?, ?, 'in_progress', ?, ?, ?, ?)
"""
MARIADB_SELECT = """
SELECT request_hash, status, response_status, response_headers, response_body
FROM idempotency_records WHERE `key` = ?
"""
MARIADB_CLAIM_RETURNING = """
INSERT INTO idempotency_records
    (`key`, request_hash, status, token, created_at, locked_until, expires_at)
VALUES (?, ?, 'in_progress', ?, ?, ?, ?)
ON DUPLICATE KEY UPDATE `key` = `key`
RETURNING token, request_hash, status, response_status, response_headers, response_body
"""
MARIADB_COMPLETE = """
UPDATE idempotency_records SET status = 'completed', expires_at = ?, response_status = ?,
       response_headers = ?, response_body = ?
WHERE `key` = ? AND token = ? AND status = 'in_progress'
"""


def _naive_utc(t: datetime) -> datetime:
    return t.astimezone(UTC).replace(tzinfo=None)


class _MariaDBBackend:
    """Raw asyncmy at its fairest: :func:`floor_pool_size` autocommit connections handed
    out by a queue (nothing to reset: the statements leave no session state),
    each with the three statements prepared once (server-side prepared statements:
    ``python -m bench.mariadb_store`` compares them with the text protocol, and they
    are the faster), and no ``read_timeout`` (with one, asyncmy waits for every read
    through ``asyncio.wait_for`` and skips its fast path for prepared statements)."""

    def __init__(self, url: str, *, returning: bool = False) -> None:
        self.url = url
        self.returning = returning
        self.free: asyncio.Queue[tuple[Any, Any, Any, Any]] = asyncio.Queue()
        self.conns: list[Any] = []

    async def start(self) -> None:
        import asyncmy
        from sqlalchemy.engine import make_url

        u = make_url(self.url)
        for _ in range(floor_pool_size()):
            conn = await asyncmy.connect(
                host=u.host, port=u.port or 3306, user=u.username, password=u.password or "",
                database=u.database, autocommit=True,
            )  # fmt: skip
            self.conns.append(conn)
            claim = MARIADB_CLAIM_RETURNING if self.returning else MARIADB_CLAIM
            sqls = (claim, MARIADB_SELECT, MARIADB_COMPLETE)
            stmts = [await conn.prepare(sql) for sql in sqls]  # type: ignore[no-untyped-call]
            self.free.put_nowait((conn, *stmts))

    async def stop(self) -> None:
        for conn in self.conns:
            await conn.ensure_closed()

    async def claim(self, key: str, h: str, token: str, now: datetime) -> Any:
        args = (key, h, token, _naive_utc(now), _naive_utc(now + LEASE), _naive_utc(now + TTL))
        held = await self.free.get()
        try:
            if self.returning:
                row = (await held[1].execute(args)).rows[0]
                return (True,) if row[0] == token else (False, *row[1:])
            if (await held[1].execute(args)).affected_rows == 1:
                return (True,)
            rows = (await held[2].execute((key,))).rows
        finally:
            self.free.put_nowait(held)
        return (False, *rows[0]) if rows else (False, None, None)

    async def complete(
        self, key: str, token: str, status: int, headers: bytes, body: bytes
    ) -> None:
        expires = _naive_utc(datetime.now(UTC) + TTL)
        held = await self.free.get()
        try:
            await held[3].execute((expires, status, headers, body, key, token))
        finally:
            self.free.put_nowait(held)


# The floor's two Redis commands: as little as an atomic claim and a fenced completion can
# do on a hash per key (the store's scripts do the same work, plus the take-over fields).
REDIS_CLAIM = """
local row = redis.call('HMGET', KEYS[1], 'h', 's', 'rs', 'rh', 'rb')
if row[1] then return row end
redis.call('HSET', KEYS[1], 'h', ARGV[1], 's', 'in_progress', 't', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 0
"""
REDIS_COMPLETE = """
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 's', 'completed', 'rs', ARGV[2], 'rh', ARGV[3], 'rb', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""
_TTL_MS = int(TTL.total_seconds() * 1000)


class _RedisBackend:
    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        # At its fairest (as RedisStore does, see its _evalsha): no socket_timeout (its
        # asyncio.wait_for per send is a Task each), and one loop pass before each command
        # so that concurrent requests' sends leave together (faster than redis-py's
        # defaults: docs/performance.md). redis-py's pool hands a connection back as it
        # is, with no command on release.
        self.size = floor_pool_size()
        self.client = aioredis.Redis.from_url(url, socket_timeout=None, max_connections=self.size)
        self._claim = self.client.register_script(REDIS_CLAIM)
        self._complete = self.client.register_script(REDIS_COMPLETE)

    async def start(self) -> None:
        # Open every connection now, as the SQL floors do, rather than on the first
        # requests that find the pool short.
        pool = self.client.connection_pool
        held = [await pool.get_connection() for _ in range(self.size)]  # type: ignore[no-untyped-call]
        for conn in held:
            await pool.release(conn)

    async def stop(self) -> None:
        await self.client.aclose()

    async def claim(self, key: str, h: str, token: str, now: datetime) -> Any:
        await asyncio.sleep(0)
        row = await self._claim(keys=[f"floor:{{{key}}}"], args=[h, token, _TTL_MS])
        if row == 0:
            return (True,)
        h_, s_, rs, rh, rb = row
        return (False, h_.decode(), s_.decode(), None if rs is None else int(rs), rh, rb)

    async def complete(
        self, key: str, token: str, status: int, headers: bytes, body: bytes
    ) -> None:
        args: list[str | int | bytes] = [token, status, headers, body, _TTL_MS]
        await asyncio.sleep(0)
        await self._complete(keys=[f"floor:{{{key}}}"], args=args)


class _DictBackend:
    def __init__(self) -> None:
        self.rows: dict[str, tuple[Any, ...]] = {}

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def claim(self, key: str, h: str, token: str, now: datetime) -> Any:
        row = self.rows.get(key)
        if row is not None:
            return (False, *row)
        self.rows[key] = (h, "in_progress", None, None, None)
        return (True,)

    async def complete(
        self, key: str, token: str, status: int, headers: bytes, body: bytes
    ) -> None:
        self.rows[key] = (self.rows[key][0], "completed", status, headers, body)


Backend = _PgBackend | _SQLiteBackend | _DictBackend | _RedisBackend | _MariaDBBackend


def _problem(status: int) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return status, [(b"content-type", b"application/problem+json")], b'{"status":%d}' % status


class FloorGuard:
    """Claim, run, complete; replay, 409 or 422 from the claim's row. Nothing else."""

    def __init__(self, app: ASGIApp, backend: Backend) -> None:
        self.app, self.backend = app, backend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        raw_key = next((v for n, v in scope["headers"] if n == b"idempotency-key"), None)
        if raw_key is None:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        key = hashlib.sha256(raw_key).hexdigest()
        h = hashlib.sha256(scope["path"].encode() + b"\x00" + body).hexdigest()
        token = uuid.uuid4().hex
        row = await self.backend.claim(key, h, token, datetime.now(UTC))
        if not row[0]:
            if row[1] is None:
                status, headers, content = _problem(409)  # vanished meanwhile: let it retry
            elif row[1] != h:
                status, headers, content = _problem(422)
            elif row[2] != "completed":
                status, headers, content = _problem(409)
            else:
                status, content = row[3], bytes(row[5])
                headers = [(k.encode(), v.encode()) for k, v in orjson.loads(row[4])]
                headers.append((b"idempotent-replayed", b"true"))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content})
            return
        start: Message = {}
        parts: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                parts.append(message.get("body", b""))

        async def replay_body() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay_body, capture)
        content = b"".join(parts)
        stored = orjson.dumps([[k.decode(), v.decode()] for k, v in start.get("headers", [])])
        await self.backend.complete(key, token, start["status"], stored, content)
        await send(start)
        await send({"type": "http.response.body", "body": content})


# ---------------------------------------------------------------------------------------


def create() -> Starlette:
    variant = os.environ.get("BENCH_VARIANT", "none")
    pg_url = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/bench_idem")
    sqlite_path = os.environ.get("BENCH_SQLITE_PATH", "/tmp/bench_idem.db")
    redis_url = os.environ.get("BENCH_REDIS_URL", "")
    middleware: list[Middleware] = []
    closers: list[Callable[[], Awaitable[None]]] = []
    starters: list[Callable[[], Awaitable[None]]] = []

    mariadb_url = os.environ.get(
        "BENCH_MARIADB_URL", "mariadb+asyncmy://root@127.0.0.1:3306/bench_idem"
    )
    stores = ("postgres_batched", "postgres_unbatched", "sqlite", "memory", "redis", "mariadb")
    if variant in stores:
        from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy, SQLStore
        from asgi_idempotency.stores.base import Store

        store: Store
        if variant == "memory":
            store = MemoryStore()
        elif variant == "redis":
            from asgi_idempotency.stores.redis import RedisStore

            store = RedisStore(redis_url)
        elif variant in ("postgres_batched", "postgres_unbatched"):
            # The store's default configuration but for batching, which names the variant.
            url = pg_url.replace("postgresql://", "postgresql+asyncpg://", 1)
            store = SQLStore(url, batching=variant == "postgres_batched")
        elif variant == "mariadb":
            store = SQLStore(mariadb_url)
        else:
            store = SQLStore(f"sqlite+aiosqlite:///{sqlite_path}")
        closers.append(store.close)
        policy = Policy(required=True)
        middleware.append(
            Middleware(
                IdempotencyMiddleware,
                store=store,
                principal=ANONYMOUS,
                policies={"POST /orders/{order_id}/refunds": policy},
            )
        )
    elif variant in (
        "floor_pg", "floor_sqlite", "floor_memory", "floor_redis", "floor_mariadb",
        "floor_mariadb_returning",
    ):  # fmt: skip
        backend: Backend
        if variant == "floor_redis":
            backend = _RedisBackend(redis_url)
        elif variant == "floor_pg":
            backend = _PgBackend(pg_url.replace("ssl=disable", "sslmode=disable"))
        elif variant == "floor_sqlite":
            backend = _SQLiteBackend(sqlite_path)
        elif variant in ("floor_mariadb", "floor_mariadb_returning"):
            backend = _MariaDBBackend(mariadb_url, returning=variant.endswith("_returning"))
        else:
            backend = _DictBackend()
        starters.append(backend.start)
        closers.append(backend.stop)
        middleware.append(Middleware(FloorGuard, backend=backend))
    elif variant != "none" and not variant.startswith("peer_"):
        raise ValueError(f"unknown BENCH_VARIANT {variant!r}")

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        for start in starters:
            await start()
        if os.environ.get("BENCH_GC_FREEZE") == "1":
            gc.collect()
            gc.freeze()  # start-up objects leave the collector's scans, in every variant alike
        if os.environ.get("BENCH_GC_DISABLE") == "1":  # diagnosis only: is a tail the GC?
            gc.disable()
        yield
        for close in closers:
            await close()

    if variant.startswith("peer_"):  # another library's guard (bench/peers.py)
        from bench import peers

        return peers.create(
            variant, redis_url, lifespan, ROUTES, health,
            pg_url.replace("ssl=disable", "sslmode=disable"),
        )  # fmt: skip
    return Starlette(routes=ROUTES, middleware=middleware, lifespan=lifespan)

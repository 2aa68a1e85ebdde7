"""SQL store: ``postgresql+asyncpg`` in production, ``sqlite+aiosqlite`` embedded.

SQLAlchemy owns the schema, the engine and its pool, dialect selection and
migrations. The hot path (claim, complete, release, renew) runs on the driver
connection taken from that pool: each statement is written once as SQLAlchemy
Core, compiled for both dialects at import, and executed by the driver as one
prepared statement, in autocommit, so one statement is one round trip and no
BEGIN/COMMIT is ever sent around it.

Why not Core's execution layer: measured on a 2-core machine with loopback
Postgres 15 (``bench/``, ``DESIGN.md``), Core on an AUTOCOMMIT connection costs
about twice the driver for the same statements, and on SQLite the adapter's
isolation-level and cursor hops make it about 5x slower than aiosqlite itself.

The dialects differ in two places, both named here:

- the claim: Postgres inserts or returns the row in its way in one statement (a
  data-modifying CTE); SQLite, which has no such CTE, inserts and, on conflict,
  reads the row, both inside one call to its connection thread;
- the connection: Postgres checks one out of the pool per statement (asyncpg runs
  one statement at a time per connection); SQLite keeps one pooled connection
  for the store's life, because SQLite admits one writer at a time and every
  hot-path statement writes: queueing on one connection's thread costs nothing,
  while several connections would wait for each other in ``busy_timeout`` sleeps.

Driver and pool errors become :class:`StoreError`. A connection that failed in a
way that leaves it unusable (closed, reset, server shutting down) is invalidated, so
it never returns to the pool and the next statement connects afresh.
"""

from __future__ import annotations

import asyncio
import operator
import sqlite3
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar, cast

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type information
import orjson
from sqlalchemy import (
    ClauseElement,
    Dialect,
    bindparam,
    delete,
    event,
    literal_column,
    null,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql.asyncpg import dialect as _asyncpg_dialect
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.dialects.sqlite.aiosqlite import dialect as _aiosqlite_dialect
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnClause

# greenlet_spawn: the same bridge AsyncEngine.raw_connection() uses. Returning a
# connection to the pool may do I/O (closing an overflow connection), which the
# async pool runs through it; without it there is no public async check-in.
from sqlalchemy.util import greenlet_spawn

from ..urls import async_url
from .base import (
    CLAIMED,
    STATUS_OF,
    TAKEN_OVER,
    Claim,
    ClaimOutcome,
    Record,
    RecordStatus,
    StoredResponse,
    StoreError,
    decide,
)
from .schema import UTCDateTime, metadata, records

__all__ = ["SQLStore"]

T = TypeVar("T")

_t = records
_TIME = UTCDateTime()
# A claim loses a race to a concurrent commit at most a few times; past that something is wrong.
_CLAIM_ATTEMPTS = 5
# Everything the pool, the drivers and the network raise for a failed statement.
_STORE_ERRORS: tuple[type[BaseException], ...] = (
    SQLAlchemyError,
    OSError,  # includes ConnectionError
    TimeoutError,  # asyncio.TimeoutError since 3.11: asyncpg's command_timeout
    asyncpg.PostgresError,
    asyncpg.InterfaceError,  # includes ConnectionDoesNotExistError
    asyncpg.InternalClientError,
    sqlite3.Error,
    ValueError,  # aiosqlite: "Connection closed" / "no active connection"
)
# Failures after which a Postgres connection is not reused, besides asyncpg reporting
# it closed (the rest are SQL errors on a healthy connection). Not TimeoutError: on
# command_timeout asyncpg sends a cancel request so that the server abandons the
# statement; terminating the connection instead would let a claim blocked on a lock
# commit after the client got its 503, and the retry would meet its own row (409).
_PG_BROKEN: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,  # SQLSTATE class 08
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,
)
_SQLITE_BROKEN: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    sqlite3.ProgrammingError,
    sqlite3.InterfaceError,
)

# ---------------------------------------------------------------------------------------
# The hot-path statements, written once in Core and compiled for each driver at import.

_IN_PROGRESS: ColumnClause[Any] = literal_column(f"'{RecordStatus.IN_PROGRESS.value}'")
_COMPLETED: ColumnClause[Any] = literal_column(f"'{RecordStatus.COMPLETED.value}'")

# One round trip: insert, or return the live row that is in the way. The outer
# SELECT sees the statement's snapshot, so a row committed by a racing claim
# after it began reads as NULL; the caller then simply asks again.
_PG_CLAIM = text(
    """
WITH ins AS (
    INSERT INTO idempotency_records
        (key, request_hash, status, token, created_at, locked_until, expires_at)
    VALUES (:key, :request_hash, 'in_progress', :token, :now, :locked_until, :expires_at)
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins) AS inserted,
       r.request_hash, r.status, r.token, r.created_at, r.locked_until, r.expires_at,
       r.response_status, r.response_headers, r.response_body
FROM (SELECT 1) AS one
LEFT JOIN idempotency_records AS r ON r.key = :key AND NOT EXISTS (SELECT 1 FROM ins)
"""
).bindparams(
    bindparam("now", type_=_TIME),
    bindparam("locked_until", type_=_TIME),
    bindparam("expires_at", type_=_TIME),
)

_RECORD_COLUMNS = (
    _t.c.request_hash,
    _t.c.status,
    _t.c.token,
    _t.c.created_at,
    _t.c.locked_until,
    _t.c.expires_at,
    _t.c.response_status,
    _t.c.response_headers,
    _t.c.response_body,
)

# What a claim writes, whether it inserts the row or takes an abandoned one over.
_CLAIMED_ROW = {
    "request_hash": bindparam("request_hash"),
    "status": _IN_PROGRESS,
    "token": bindparam("token"),
    "created_at": bindparam("now"),
    "locked_until": bindparam("locked_until"),
    "expires_at": bindparam("expires_at"),
}
_SQLITE_INSERT: ClauseElement = (
    sqlite_insert(_t)
    .values(key=bindparam("key"), **_CLAIMED_ROW)
    .on_conflict_do_nothing(index_elements=[_t.c.key])
    .returning(literal_column("1"))
)
_SELECT = select(*_RECORD_COLUMNS).where(_t.c.key == bindparam("key"))


def _owned() -> Any:
    return (
        (_t.c.key == bindparam("key"))
        & (_t.c.token == bindparam("token"))
        & (_t.c.status == _IN_PROGRESS)
    )


_COMPLETE = (
    update(_t)
    .where(_owned())
    .values(
        status=_COMPLETED,
        expires_at=bindparam("expires_at"),
        response_status=bindparam("response_status"),
        response_headers=bindparam("response_headers"),
        response_body=bindparam("response_body"),
    )
)
_RELEASE = delete(_t).where(_owned())
_RENEW = update(_t).where(_owned()).values(locked_until=bindparam("locked_until"))
# Conditional on the row exactly as read (its token) and still eligible, so of two
# racing retries exactly one wins; the other re-reads and gets 409.
_TAKE_OVER = (
    update(_t)
    .where(
        _t.c.key == bindparam("key"),
        _t.c.token == bindparam("old_token"),
        (_t.c.expires_at <= bindparam("now"))
        | (
            (_t.c.status == _IN_PROGRESS)
            & (_t.c.locked_until <= bindparam("now"))
            & (_t.c.request_hash == bindparam("request_hash"))
        ),
    )
    .values(
        **_CLAIMED_ROW,
        response_status=null(),
        response_headers=null(),
        response_body=null(),
    )
)


class _Compiled:
    """A statement compiled for one driver: its SQL and the order of its parameters."""

    __slots__ = ("_pick", "names", "sql")

    def __init__(self, stmt: ClauseElement, dialect: Dialect) -> None:
        compiled = cast(SQLCompiler, stmt.compile(dialect=dialect))
        self.sql: str = compiled.string
        self.names: tuple[str, ...] = tuple(compiled.positiontup or ())
        self._pick = operator.itemgetter(*self.names)

    def args(self, values: dict[str, Any]) -> tuple[Any, ...]:
        if len(self.names) == 1:  # itemgetter of one name returns the value, not a tuple
            return (self._pick(values),)
        return self._pick(values)  # type: ignore[no-any-return]


def _compile_all(dialect: Dialect) -> dict[str, _Compiled]:
    stmts: dict[str, ClauseElement] = {
        "select": _SELECT,
        "complete": _COMPLETE,
        "release": _RELEASE,
        "renew": _RENEW,
        "take_over": _TAKE_OVER,
    }
    stmts["claim"] = _PG_CLAIM if dialect.name == "postgresql" else _SQLITE_INSERT
    return {name: _Compiled(stmt, dialect) for name, stmt in stmts.items()}


_PG_SQL = _compile_all(_asyncpg_dialect())  # type: ignore[no-untyped-call]  # untyped in SQLAlchemy
_SQLITE_SQL = _compile_all(_aiosqlite_dialect())

# ---------------------------------------------------------------------------------------
# Values across the driver boundary.


def _encode_headers(headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    return orjson.dumps([[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers])


def _decode_headers(raw: bytes) -> tuple[tuple[bytes, bytes], ...]:
    return tuple([(k.encode("latin-1"), v.encode("latin-1")) for k, v in orjson.loads(raw)])


def _aware(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise StoreError("ValueError: naive datetime: pass an aware UTC datetime")
    return value


def _sqlite_time(value: datetime) -> str:
    # Exactly SQLAlchemy's SQLite DATETIME storage format (naive UTC, fixed width), so
    # rows written by Core and by this path compare correctly as text.
    v = _aware(value)
    if v.tzinfo is not UTC:
        v = v.astimezone(UTC)
    return "%04d-%02d-%02d %02d:%02d:%02d.%06d" % (  # noqa: UP031  # the fastest spelling
        v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond
    )  # fmt: skip


def _as_time(value: Any) -> datetime:
    # asyncpg returns aware datetimes for timestamptz; SQLite, naive-UTC text.
    if type(value) is datetime and value.tzinfo is not None:
        return value
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _to_record(key: str, row: Sequence[Any]) -> Record:
    """``row`` holds :data:`_RECORD_COLUMNS` in order."""
    response = None
    if row[6] is not None:
        response = StoredResponse(
            status=row[6], headers=_decode_headers(row[7]), body=bytes(row[8])
        )
    return Record(
        key=key,
        request_hash=row[0],
        status=STATUS_OF[row[1]],
        token=row[2],
        created_at=_as_time(row[3]),
        locked_until=_as_time(row[4]),
        expires_at=_as_time(row[5]),
        response=response,
    )


def _store_error(exc: BaseException) -> StoreError:
    return StoreError(f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------
# Drivers: the one place each dialect's connection handling lives.


class _Driver(Protocol):
    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        """(inserted, the row in the way as :data:`_RECORD_COLUMNS` or None)."""
        ...

    async def rowcount(self, name: str, values: dict[str, Any]) -> int: ...

    async def close(self) -> None: ...


class _NoConnection(Exception):
    """A hot-path statement waited ``command_timeout`` for a connection in vain."""


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(_NoConnection())


def _pg_checkin(fairy: PoolProxiedConnection, failure: BaseException | None) -> None:
    if failure is not None:
        fairy.invalidate(failure)
    fairy.close()


class _PostgresDriver:
    """asyncpg connections from SQLAlchemy's pool, kept by the hot path between statements.

    Up to ``limit`` connections stay checked out of SQLAlchemy's pool, idle in a
    stack of our own between statements: taking one back costs no greenlet hop and
    no pool wait, which was most of what a one-statement request paid for its
    checkout (and asyncpg's prepared statements stay warm). Past ``limit`` a
    statement waits, first come first served, for one to be handed back, up to
    ``timeout`` seconds. The rest of SQLAlchemy's pool stays free for transactional
    requests, ``get``, ``prune`` and the application's Core work. A connection that
    breaks takes every idle one with it, as SQLAlchemy's pool does on a disconnect:
    they share the cause, and each would otherwise fail one more request.
    """

    def __init__(self, engine: AsyncEngine, *, limit: int, timeout: float) -> None:
        self._engine = engine
        self._limit = max(1, limit)
        self._timeout = timeout
        self._held = 0  # checked out of SQLAlchemy's pool by us: idle or in use
        self._idle: list[PoolProxiedConnection] = []
        # FIFO waiters; a waiter is handed a connection, or None: "open a new one".
        self._waiters: deque[asyncio.Future[PoolProxiedConnection | None]] = deque()
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()

    async def _open(self) -> PoolProxiedConnection:
        self._held += 1
        try:
            return await self._engine.raw_connection()
        except BaseException as exc:
            self._release_slot()
            if isinstance(exc, _STORE_ERRORS):
                raise _store_error(exc) from exc
            raise

    def _release_slot(self) -> None:
        """One connection fewer is held: the longest waiter may open a new one."""
        self._held -= 1
        self._wake(None)

    async def _checkout(self) -> PoolProxiedConnection:
        if self._idle:
            return self._idle.pop()
        if self._held < self._limit:
            return await self._open()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[PoolProxiedConnection | None] = loop.create_future()
        self._waiters.append(waiter)
        # A timer on the future rather than asyncio.timeout(): no cancellation of this
        # task to set up and undo, on a path every request takes when the pool is busy.
        timer = loop.call_later(self._timeout, _expire, waiter)
        try:
            fairy = await waiter
        except BaseException as exc:
            # Timed out or cancelled: pass on what was handed over in the same moment
            # (a connection or a free slot), or it would be lost to every later waiter.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()
                if handed is None:
                    self._wake(None)
                else:
                    self._checkin(handed)
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            if isinstance(exc, _NoConnection):
                raise StoreError(f"no connection free within {self._timeout}s") from None
            raise
        finally:
            timer.cancel()
        return fairy if fairy is not None else await self._open()

    def _wake(self, fairy: PoolProxiedConnection | None) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(fairy)
                return True
        return False

    def _checkin(self, fairy: PoolProxiedConnection) -> None:
        if self._closed:
            self._held -= 1
            self._close_soon(fairy)
        elif not self._wake(fairy):
            self._idle.append(fairy)

    def _close_soon(self, fairy: PoolProxiedConnection) -> None:
        # Returning a connection to SQLAlchemy's pool needs an await; where the caller
        # cannot wait (cancelled, or a sync path) it happens in a task of its own.
        task = asyncio.ensure_future(greenlet_spawn(fairy.close))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _discard(self, fairy: PoolProxiedConnection, broken: BaseException) -> None:
        victims = [fairy, *self._idle]
        self._idle.clear()
        for victim in victims:
            # Invalidate outside the greenlet: asyncpg is then terminated at once rather
            # than closed gracefully, which could keep a 503 waiting on a dead socket.
            victim.invalidate(broken)
            await greenlet_spawn(victim.close)
            self._release_slot()  # each freed slot lets one waiter connect afresh

    async def _run(self, op: Callable[[Any], Awaitable[T]]) -> T:
        fairy = await self._checkout()
        driver: asyncpg.Connection = fairy.driver_connection
        try:
            result = await op(driver)
        except _STORE_ERRORS as exc:
            # TimeoutError is an OSError: test it first (see _PG_BROKEN).
            if driver.is_closed() or (
                isinstance(exc, _PG_BROKEN) and not isinstance(exc, TimeoutError)
            ):
                await self._discard(fairy, exc)
            else:
                self._checkin(fairy)
            raise _store_error(exc) from exc
        except BaseException:
            # Cancelled mid-statement: the connection's state is unknown; drop it.
            fairy.invalidate()
            self._close_soon(fairy)
            self._release_slot()
            raise
        self._checkin(fairy)
        return result

    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        args = _PG_SQL["claim"].args(values)
        row = await self._run(lambda c: c.fetchrow(_PG_SQL["claim"].sql, *args))
        assert row is not None  # the LEFT JOIN always yields one row
        if row[0]:
            return True, None
        return False, (None if row[2] is None else tuple(row)[1:])

    async def rowcount(self, name: str, values: dict[str, Any]) -> int:
        stmt = _PG_SQL[name]
        args = stmt.args(values)
        status: str = await self._run(lambda c: c.execute(stmt.sql, *args))
        return int(status.rpartition(" ")[2])  # "UPDATE 1", "DELETE 0"

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for fairy in idle:
            self._held -= 1
            await greenlet_spawn(fairy.close)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _sqlite_claim(
    conn: sqlite3.Connection, insert_args: tuple[Any, ...], select_args: tuple[Any, ...]
) -> tuple[bool, Sequence[Any] | None]:
    # Runs on aiosqlite's thread: insert, and on conflict read, in one hop.
    if conn.execute(_SQLITE_SQL["claim"].sql, insert_args).fetchone() is not None:
        return True, None
    return False, conn.execute(_SQLITE_SQL["select"].sql, select_args).fetchone()


def _sqlite_rowcount(conn: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> int:
    return conn.execute(sql, args).rowcount


def _sqlite_autocommit(conn: sqlite3.Connection, level: Any) -> Any:
    previous = conn.isolation_level
    conn.isolation_level = level
    return previous


class _SQLiteDriver:
    """One pooled aiosqlite connection, kept for the store's life, in autocommit.

    Each operation is one call on the connection's thread (aiosqlite's ``_execute``:
    its public helpers take one hop per cursor step, and a DML statement would open
    the sqlite3 module's implicit transaction, a second hop to commit).
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._fairy: PoolProxiedConnection | None = None
        self._saved_level: Any = None  # the connection's sqlite3 isolation_level, restored on close
        self._lock = asyncio.Lock()

    async def _connection(self) -> Any:
        fairy = self._fairy
        if fairy is None:
            async with self._lock:
                if self._fairy is None:
                    fresh = await self._engine.raw_connection()
                    driver: Any = fresh.driver_connection
                    try:
                        self._saved_level = await driver._execute(
                            _sqlite_autocommit, driver._conn, None
                        )
                    except BaseException:
                        await greenlet_spawn(fresh.close)
                        raise
                    self._fairy = fresh
                fairy = self._fairy
        return fairy.driver_connection

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            fairy = self._fairy
            driver: Any = fairy.driver_connection if fairy is not None else await self._connection()
            return await driver._execute(fn, driver._conn, *args)  # type: ignore[no-any-return]
        except _STORE_ERRORS as exc:
            broken = isinstance(exc, _SQLITE_BROKEN) and not isinstance(exc, TimeoutError)
            if broken and self._fairy is not None:
                fairy, self._fairy = self._fairy, None
                fairy.invalidate(exc)
                await greenlet_spawn(fairy.close)
            raise _store_error(exc) from exc

    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        return await self._run(
            _sqlite_claim,
            _SQLITE_SQL["claim"].args(values),
            _SQLITE_SQL["select"].args(values),
        )

    async def rowcount(self, name: str, values: dict[str, Any]) -> int:
        stmt = _SQLITE_SQL[name]
        return await self._run(_sqlite_rowcount, stmt.sql, stmt.args(values))

    async def close(self) -> None:
        fairy, self._fairy = self._fairy, None
        if fairy is None:
            return
        try:
            driver: Any = fairy.driver_connection
            await driver._execute(_sqlite_autocommit, driver._conn, self._saved_level)
        except _STORE_ERRORS:
            fairy.invalidate()
        await greenlet_spawn(fairy.close)


def _set_sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers run beside the one writer; busy_timeout makes concurrent
    # workers wait for the write lock instead of failing with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


class SQLStore:
    """Records in ``idempotency_records`` through SQLAlchemy's async engine.

    Args:
        url_or_engine: a database URL (``postgresql+asyncpg://…`` or
            ``sqlite+aiosqlite:///path.db``) or an ``AsyncEngine`` the caller owns
            (and disposes: :meth:`close` leaves a passed engine open, after returning
            the connection the store holds on SQLite).
        command_timeout: seconds any one statement may take before the store gives
            up and the request gets 503 (default 5). Set on the driver, so it costs
            no statement of its own. Applies when the store builds the engine.
        pool_size: on Postgres, connections per process that the hot path keeps for its
            one-statement operations (default 10); the engine the store builds has as
            many again for transactional requests, ``get``, ``prune`` and your own Core
            work. No overflow: a statement waits for a free connection, up to
            ``command_timeout``, rather than open one. With an engine of your own the
            hot path keeps half its pool.
    """

    def __init__(
        self,
        url_or_engine: str | AsyncEngine,
        *,
        command_timeout: float = 5.0,
        pool_size: int = 10,
    ) -> None:
        if command_timeout is None or command_timeout <= 0:
            raise ValueError("command_timeout must be a positive number of seconds")
        if isinstance(url_or_engine, AsyncEngine):
            engine, self._owns_engine = url_or_engine, False
        else:
            engine, self._owns_engine = (
                _make_engine(url_or_engine, command_timeout=command_timeout, pool_size=pool_size),
                True,
            )
        self.engine = engine
        self.dialect = engine.dialect.name
        if self.dialect not in ("postgresql", "sqlite"):
            raise ValueError(f"SQLStore supports postgresql and sqlite, not {self.dialect}")
        if self.dialect == "postgresql" and engine.dialect.driver != "asyncpg":
            raise ValueError(f"SQLStore needs postgresql+asyncpg, not {engine.dialect.driver}")
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._driver: _Driver = (
            _PostgresDriver(engine, limit=_hot_path_limit(engine), timeout=command_timeout)
            if self.dialect == "postgresql"
            else _SQLiteDriver(engine)
        )
        self._time: Callable[[datetime], Any] = (
            _aware if self.dialect == "postgresql" else _sqlite_time
        )

    async def create_all(self) -> None:
        """Create the table and index if missing (development and tests; migrate in production)."""
        try:
            async with self.engine.begin() as conn:
                await conn.run_sync(metadata.create_all)
        except _STORE_ERRORS as exc:
            raise StoreError(str(exc)) from exc

    async def claim(
        self,
        key: str,
        request_hash: str,
        token: str,
        *,
        now: datetime,
        locked_until: datetime,
        expires_at: datetime,
    ) -> Claim:
        when = self._time
        values = {
            "key": key,
            "request_hash": request_hash,
            "token": token,
            "now": when(now),
            "locked_until": when(locked_until),
            "expires_at": when(expires_at),
        }
        for _ in range(_CLAIM_ATTEMPTS):
            inserted, row = await self._driver.claim(values)
            if inserted:
                return CLAIMED
            if row is None:
                continue  # the row in the way vanished or is not yet visible: ask again
            existing = _to_record(key, row)
            expired = existing.expires_at <= now
            outcome = ClaimOutcome.TAKEN_OVER if expired else decide(existing, request_hash, now)
            if outcome is not ClaimOutcome.TAKEN_OVER:
                return Claim(outcome, existing)
            if await self._driver.rowcount("take_over", {**values, "old_token": existing.token}):
                return CLAIMED if expired else TAKEN_OVER
        raise StoreError(f"claim did not settle after {_CLAIM_ATTEMPTS} attempts")

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, expires_at: datetime
    ) -> bool:
        values = {
            "key": key,
            "token": token,
            "expires_at": self._time(expires_at),
            "response_status": response.status,
            "response_headers": _encode_headers(response.headers),
            "response_body": response.body,
        }
        return await self._driver.rowcount("complete", values) == 1

    async def release(self, key: str, token: str) -> bool:
        return await self._driver.rowcount("release", {"key": key, "token": token}) == 1

    async def renew(self, key: str, token: str, *, locked_until: datetime) -> bool:
        values = {"key": key, "token": token, "locked_until": self._time(locked_until)}
        return await self._driver.rowcount("renew", values) == 1

    # Off the hot path: Core on an autocommit connection.

    async def get(self, key: str) -> Record | None:
        try:
            async with self._autocommit.connect() as conn:
                row = (await conn.execute(select(*_RECORD_COLUMNS).where(_t.c.key == key))).first()
        except _STORE_ERRORS as exc:
            raise _store_error(exc) from exc
        return None if row is None else _to_record(key, tuple(row))

    async def prune(self, *, now: datetime, batch_size: int = 1000) -> int:
        victims = select(_t.c.key).where(_t.c.expires_at <= now).limit(batch_size)
        if self.dialect == "postgresql":
            # Rows a concurrent claim is taking over are skipped, not waited on.
            victims = victims.with_for_update(skip_locked=True)
        try:
            async with self._autocommit.connect() as conn:
                result = await conn.execute(
                    delete(_t).where(_t.c.key.in_(victims.scalar_subquery()))
                )
                return result.rowcount
        except _STORE_ERRORS as exc:
            raise _store_error(exc) from exc

    async def close(self) -> None:
        await self._driver.close()
        if self._owns_engine:
            await self.engine.dispose()


def _hot_path_limit(engine: AsyncEngine) -> int:
    """How many connections the hot path keeps: half of a sized pool, else a few."""
    size = getattr(engine.pool, "size", None)
    return max(1, size() // 2) if callable(size) else 4


def _make_engine(url: str, *, command_timeout: float, pool_size: int) -> AsyncEngine:
    url = async_url(url)  # the one URL rule (asgi_idempotency.urls): postgres:// -> asyncpg
    kwargs: dict[str, Any] = {}
    if url.startswith("postgresql"):
        kwargs = {
            # pool_size for the hot path, as many again for everything else.
            "pool_size": 2 * pool_size,
            # No overflow: the hot path holds a connection for one statement, so waiting
            # a moment for one is far cheaper than connecting. Overflow connections are
            # closed when returned to a full pool: at 32 concurrent requests and 10+10 the
            # pool reconnected constantly (replays at 0.47x the raw driver, 0.87x without).
            "max_overflow": 0,
            "pool_timeout": command_timeout,
            # Checkouts cost no ping: a broken connection fails its statement, the
            # store invalidates it, and the next statement connects afresh.
            "pool_pre_ping": False,
            "connect_args": {"command_timeout": command_timeout, "timeout": command_timeout},
        }
    elif url.startswith("sqlite"):
        kwargs = {"connect_args": {"timeout": command_timeout}}
    engine = create_async_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _set_sqlite_pragmas)
    return engine

"""Postgres: the asyncpg hot path on connections kept from SQLAlchemy's pool, and transactions.

The hot path checks a connection out per statement (asyncpg runs one statement at a
time per connection) and runs the statements of :mod:`.statements` as prepared
statements in autocommit: one statement, one round trip, no BEGIN/COMMIT around it.
Transactional mode opens one SQLAlchemy connection per request instead and runs the
claim (with the key's advisory lock), the handler's writes and the completion in one
transaction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

import asyncpg
from sqlalchemy import text
from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_dbapi
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.pool import PoolProxiedConnection

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.migrations import create_tables
from asgi_idempotency.stores.base import BUSY, Busy, NewClaim, Record, RecordStatus
from asgi_idempotency.stores.codec import pg_time, to_record
from asgi_idempotency.stores.errors import ErrorBoundary
from asgi_idempotency.stores.sql.dialect import (
    HotPath,
    HotPathOptions,
    SQLDialect,
    leave_engine,
    pool_options,
)
from asgi_idempotency.stores.sql.errors import sql_boundary, unwrap
from asgi_idempotency.stores.sql.pool import LANDED, KeptConnections, own_claim
from asgi_idempotency.stores.sql.queries import prune_by_ctid
from asgi_idempotency.stores.sql.statements import (
    CLAIM_LOCKED,
    COMPLETE,
    PG,
    PG_CLOCK,
    REPLACE,
    clock_claim_values,
)
from asgi_idempotency.stores.sql.transaction import (
    IdempotencyTransaction,
    SQLTransaction,
    close,
)
from asgi_idempotency.stores.sql.transaction import open_transaction as sql_transaction

__all__ = [
    "IdempotencyTransaction",
    "ONE_STATEMENT",
    "PG_ERRORS",
    "PostgresDriver",
    "PostgresTransaction",
    "claimed_row",
    "open_transaction",
    "own_claim",
    "statement_timeout_ms",
]


# SQLAlchemy's asyncpg adapter re-raises asyncpg's errors as DBAPI exceptions of its
# own, which derive from Exception alone. Engine and Core wrap them in DBAPIError,
# but the hot path's AsyncEngine.raw_connection() lets them through as they are: an
# unknown role, an unknown database or a wrong password at connect.
_ASYNCPG_ADAPTED: type[Exception] = AsyncAdapt_asyncpg_dbapi.Error

# Failures after which a Postgres connection is not reused, besides asyncpg reporting
# it closed (the rest are SQL errors on a healthy connection). InternalClientError is
# asyncpg's protocol state gone astray: a connection the server ended while it was idle
# reads its farewell (57P01) out of turn and refuses every later statement with
# "cannot switch to state N" before it is sent. Not TimeoutError: on
# command_timeout asyncpg sends a cancel request so that the server abandons the
# statement; terminating the connection instead would let a claim blocked on a lock
# commit after the client got its 503, and the retry would meet its own row (409).
_PG_BROKEN: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.InterfaceError,  # "connection is closed", ConnectionDoesNotExistError
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,  # SQLSTATE class 08
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,
)


def _pg_unwrap(exc: BaseException) -> BaseException:
    """asyncpg's own exception inside SQLAlchemy's wrappers."""
    driver = unwrap(exc)
    if isinstance(driver, _ASYNCPG_ADAPTED) and driver.__cause__ is not None:
        driver = driver.__cause__
    return driver


def _pg_breaks(exc: BaseException) -> bool:
    driver = _pg_unwrap(exc)
    return isinstance(driver, _PG_BROKEN) and not isinstance(driver, TimeoutError)


PG_ERRORS = sql_boundary(
    (
        _ASYNCPG_ADAPTED,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,  # includes ConnectionDoesNotExistError
        asyncpg.InternalClientError,
    ),
    _pg_breaks,
    missing_table=lambda exc: isinstance(exc, asyncpg.UndefinedTableError),
    unwrap=_pg_unwrap,
)

T = TypeVar("T")

# A claim in a transaction asks again only when a rival committed inside its statement;
# under the key's lock that settles at the second attempt unless writers that take no
# lock (default-mode claims of the same scoped key) keep racing it.
_INSERT_ATTEMPTS = 3


def _gone(fairy: PoolProxiedConnection) -> bool:
    """Whether asyncpg knows the connection closed (it read the server's end): no I/O."""
    driver: asyncpg.Connection = fairy.driver_connection  # type: ignore[assignment]  # None only once closed
    return driver.is_closed()


class PostgresDriver(KeptConnections):
    """asyncpg connections from SQLAlchemy's pool, kept by the hot path between
    statements (:class:`~.pool.KeptConnections`), asyncpg's prepared statements on them."""

    errors: ErrorBoundary = PG_ERRORS

    def _gone(self, fairy: PoolProxiedConnection) -> bool:
        """Whether the driver knows the connection closed (it read the server's end)."""
        return _gone(fairy)

    async def _run(self, op: Callable[[Any], Awaitable[T]]) -> T:
        fairy = await self._checkout()
        driver: asyncpg.Connection = fairy.driver_connection  # type: ignore[assignment]  # None only once closed
        try:
            result = await op(driver)
        except PG_ERRORS.errors as exc:
            if driver.is_closed() or PG_ERRORS.breaks(exc):
                await self._discard(fairy, exc)
            else:
                self._checkin(fairy)
            raise PG_ERRORS.translate(exc) from exc
        except BaseException:
            # Cancelled mid-statement: the connection's state is unknown; drop it.
            fairy.invalidate()
            self._close_soon(fairy)
            self._release_slot()
            raise
        self._checkin(fairy)
        return result

    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        """(inserted, the row in the way as :data:`RECORD_COLUMNS`, or None if not visible)."""
        args = PG["claim"].args(values)
        row = await self._send(lambda c: c.fetchrow(PG["claim"].sql, *args))
        assert row is not None  # the LEFT JOIN always yields one row
        if row[1]:
            return True, None
        return own_claim(values, None if row[2] is None else tuple(row)[2:])

    async def rowcount(self, name: str, values: dict[str, Any]) -> int:
        stmt = PG[name]
        args = stmt.args(values)
        select = PG["select"]

        async def op(c: asyncpg.Connection) -> int:
            status: str = await c.execute(stmt.sql, *args)
            return int(status.rpartition(" ")[2])  # "UPDATE 1", "DELETE 0"

        async def again(c: asyncpg.Connection) -> int:
            count = await op(c)
            if count or name not in LANDED:
                return count
            row = await c.fetchrow(select.sql, *select.args({"key": values["where_key"]}))
            return int(row is not None and LANDED[name](values, tuple(row)))

        return await self._send(op, again)


_US = timedelta(microseconds=1)
_IN_PROGRESS = RecordStatus.IN_PROGRESS.value


def claimed_row(values: dict[str, Any], at: datetime) -> tuple[Any, ...]:
    """The row a claim inserted at the database's time ``at``, as ``RECORD_COLUMNS``
    and the time it was read at: in progress, no response."""
    return (
        values["request_hash"], _IN_PROGRESS, values["token"], at,
        at + values["lease_us"] * _US, at + values["ttl_us"] * _US, None, None, None, at,
    )  # fmt: skip


class PostgresTransaction(SQLTransaction):
    """One request's transaction: the claim under the key's advisory lock, then the record.

    Round trips for a first request: BEGIN, claim (lock included), the handler's own
    statements, complete, COMMIT. Replays, 409s and 422s: BEGIN, claim, ROLLBACK (in
    report-only mode the handler runs there too, and its writes commit alone). A claim
    whose statement met a rival's commit asks once more.
    """

    __slots__ = ("_sent",)

    errors = PG_ERRORS

    @staticmethod
    def gone(fairy: PoolProxiedConnection) -> bool:
        return _gone(fairy)

    def __init__(
        self, engine: AsyncEngine, conn: AsyncConnection, closing: set[asyncio.Task[Any]]
    ) -> None:
        super().__init__(engine, conn, closing)
        self._sent = False  # whether a statement of the transaction was sent on _conn

    async def _claim(self, values: dict[str, Any]) -> Sequence[Any]:
        """The claim statement; as the transaction's first, once more on a fresh
        connection if the pool's turned out to be broken.

        The pool's connections are taken unpinged (no round trip), so one the server
        closed while it was idle is found out by the first statement sent on it. That
        one is safe to send again: its transaction never committed (its BEGIN rides
        with it), and the handler has not run. Never later: the handler may have.
        """
        first, self._sent = not self._sent, True
        try:
            row: Sequence[Any] = (await self._conn.execute(CLAIM_LOCKED, values)).one()
            return row
        except PG_ERRORS.errors as exc:
            if not first or not PG_ERRORS.breaks(exc):
                raise PG_ERRORS.translate(exc) from exc
            broken = exc
        # Invalidated outside a greenlet, as the hot path does: asyncpg is terminated at
        # once rather than closed gracefully, which could wait on a dead socket.
        dead = self._conn
        if dead.sync_connection is not None:
            dead.sync_connection.invalidate(broken)
        del broken  # its traceback holds this frame: no cycle left behind
        await close(dead, self._closing)
        self._conn = await self.begin(self._engine, self._closing)
        self.state = IdempotencyTransaction(self._conn, AsyncSession(bind=self._conn))
        with PG_ERRORS:
            row = (await self._conn.execute(CLAIM_LOCKED, values)).one()
        return row

    async def insert(self, new: NewClaim) -> Record | Literal[Busy.BUSY] | None:
        values = clock_claim_values(new)
        values["key"] = new.key
        for _ in range(_INSERT_ATTEMPTS):
            row = await self._claim(values)
            if not row[0]:
                return BUSY
            if row[1]:
                return None
            if row[2] is not None:
                return to_record(new.key, tuple(row)[2:])
            # Not inserted, yet no row read: a rival's claim committed after this
            # statement's snapshot, before its insert met the key (the lock is taken
            # after the snapshot too). Ask again: the next statement's snapshot follows
            # that commit, and the lock now held keeps every transactional claimant out.
        raise StoreError(f"insert did not settle after {_INSERT_ATTEMPTS} attempts")

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        # A compare-and-swap even under the key's lock: ``expected`` was read in the
        # claim statement's snapshot, which may predate a rival's take-over that
        # committed before this transaction won the lock. The swap then fails and the
        # lifecycle claims again, in a snapshot that sees the rival's row.
        values = clock_claim_values(new)
        values["where_key"] = new.key
        values["old_token"] = expected.token
        values["old_status"] = expected.status.value
        values["old_locked_until"] = expected.locked_until
        with PG_ERRORS:
            result = await self._conn.execute(REPLACE, values)
        return bool(result.rowcount)

    async def _complete(self, values: dict[str, Any]) -> int:
        return int((await self._conn.execute(COMPLETE, values)).rowcount)


def open_transaction(
    engine: AsyncEngine, closing: set[asyncio.Task[Any]]
) -> AbstractAsyncContextManager[PostgresTransaction]:
    """A connection in a transaction (:func:`.transaction.open_transaction`)."""
    return sql_transaction(PostgresTransaction, engine, closing)


# Serialises concurrent create_all calls on one database (a transaction-scoped lock).
_SCHEMA_LOCK = text("SELECT pg_advisory_xact_lock(hashtext('asgi_idempotency.schema'))")


async def _create_schema(
    engine: AsyncEngine, autocommit: AsyncEngine, command_timeout: float
) -> None:
    async with engine.begin() as conn:
        await conn.execute(_SCHEMA_LOCK)
        await conn.run_sync(create_tables)


def _one_statement(engine: AsyncEngine, options: HotPathOptions) -> HotPath:
    return PostgresDriver(engine, limit=options.limit, timeout=options.timeout)


# How much sooner than the client the server gives up on a statement: at most a second,
# a fifth of command_timeout when that is shorter (see statement_timeout_ms).
_SERVER_GIVES_UP_SOONER = 1.0


def statement_timeout_ms(command_timeout: float) -> int:
    """The server's ``statement_timeout`` (ms) for a store's ``command_timeout`` (s).

    When asyncpg's ``command_timeout`` fires, the store answers 503 at once, but the
    statement stops only when the cancel request asyncpg sends on a new connection
    arrives; if a lock it waited on is released first, it commits behind the client's
    back (a claim then answers 409 for its lease, with no handler run). The server's
    own timeout, shorter by a margin (the statement's trip to the server, and the
    server's reaction), ends it there first: a statement the store gave up on has
    already been rolled back.
    """
    margin = min(_SERVER_GIVES_UP_SOONER, command_timeout / 5)
    return max(1, int((command_timeout - margin) * 1000))


def _engine_options(command_timeout: float, pool_size: int) -> dict[str, Any]:
    # asyncpg's own command_timeout bounds each statement, at no statement's cost; the
    # server's statement_timeout, set once per connection, ends it there first.
    connect = {
        "command_timeout": command_timeout,
        "timeout": command_timeout,
        "server_settings": {"statement_timeout": str(statement_timeout_ms(command_timeout))},
    }
    return {**pool_options(command_timeout, pool_size), "connect_args": connect}


# The backend with one statement per request. The batching driver builds on this
# module, so the dialect SQLStore reads is postgres_batched.DIALECT: this one with a
# hot path that chooses between the two.
ONE_STATEMENT = SQLDialect(
    label="Postgres",
    driver="asyncpg",
    errors=PG_ERRORS,
    time=pg_time,
    clock=PG_CLOCK,
    hot_path=_one_statement,
    engine_options=_engine_options,
    configure_engine=leave_engine,
    create_schema=_create_schema,
    prune=prune_by_ctid,
    # Batching by default: under load a statement's round trip and commit are shared,
    # a request alone costs what it did, and what one request per statement never
    # suffered stays so (postgres_batched.py, tests/stores/test_batching_safety.py).
    batching=True,
    can_batch=True,
    transaction=open_transaction,
)

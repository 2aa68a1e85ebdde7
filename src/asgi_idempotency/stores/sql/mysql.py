"""MariaDB and MySQL: the asyncmy hot path on connections kept from SQLAlchemy's pool.

``SQLStore("mariadb+asyncmy://…")`` or ``("mysql+asyncmy://…")`` (the ``mysql`` extra).
SQLAlchemy owns the schema, the engine, its pool and dialect selection, as on
Postgres; the hot path keeps some of the pool's connections checked out (the
connection keeping is :class:`~.pool.KeptConnections`, which is driver-neutral)
and runs the statements of :data:`.statements.MYSQL` on them as server-side prepared
statements, in autocommit: one statement, one round trip, no BEGIN/COMMIT.

Round trips per primitive: the claim is one ``INSERT IGNORE`` (the affected rows say
whether it inserted), plus one ``SELECT`` of the row in the way only when it did not
(MySQL has no ``RETURNING`` on an insert and no data-modifying CTE); complete,
release, renew and the take-over's compare-and-swap are one fenced ``UPDATE`` or
``DELETE`` each, whose affected rows (matched rows: SQLAlchemy connects with
``CLIENT_FOUND_ROWS``) say whether the token still owned the row.

A connection the hot path has turned autocommit on for never goes back to the pool
as it is: it is invalidated when the hot path lets it go, so Core work on the same
engine never gets an autocommit connection it did not ask for.

Timeouts: on an engine the store builds, each connection gets the server-side
limits (:func:`session_limits`), so the server abandons a statement that runs past
``command_timeout`` (rolled back, never committed after the client's 503). The
backstop for a server that does not answer at all is a second later, so that the
server's own limit answers first: on the hot path, a watchdog that closes the
connection of an operation past that bound (within a quarter of a second: it looks
four times a second while operations are in flight); on SQLAlchemy's own
connections, asyncmy's ``read_timeout``. Either way a :class:`StoreError`, and the
connection is closed and dropped. The hot path turns ``read_timeout`` off on the
connections it keeps: with one set, asyncmy waits for
every read through ``asyncio.wait_for`` (a task of its own each time) and skips its
fast path for prepared statements' replies.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy import Dialect, String, delete, event, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.migrations import create_tables
from asgi_idempotency.stores.codec import mysql_time
from asgi_idempotency.stores.sql.dialect import HotPath, HotPathOptions, SQLDialect, pool_options
from asgi_idempotency.stores.sql.errors import sql_boundary
from asgi_idempotency.stores.sql.pool import LANDED, KeptConnections, own_claim
from asgi_idempotency.stores.sql.schema import records
from asgi_idempotency.stores.sql.statements import MYSQL, MYSQL_CLOCK

__all__ = [
    "DIALECT",
    "MYSQL_ERRORS",
    "MySQLDriver",
    "connect_args",
    "install_session_limits",
    "prune",
    "schema_lock",
    "session_limits",
]


try:  # the mysql extra: asyncmy raises its own errors, SQLAlchemy's adapter passes them on
    from asyncmy.errors import MySQLError as _MySQLError
except ImportError:  # pragma: no cover - without the extra no MySQL path can run

    class _MySQLError(Exception):  # type: ignore[no-redef]  # a stand-in nothing raises
        pass


# Server errors after which a MariaDB/MySQL connection is gone: shutdown (1053), killed
# (1927, MariaDB), idle too long (4031, MySQL 8). Client errors are 2000-2999 (2006
# server gone, 2013 lost connection); a deadlock or a timed-out statement leaves the
# connection usable.
_MYSQL_GONE = frozenset((1053, 1927, 4031))


def _mysql_breaks(exc: BaseException) -> bool:
    if not isinstance(exc, _MySQLError):
        return isinstance(exc, OSError)
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
    return 2000 <= code < 3000 or code in _MYSQL_GONE or code == 0


# asyncmy: every server error (a deadlock, 1213, and a lock wait timeout, 1205,
# included: the statement was rolled back, the client gets 503 and retries) and the
# client's own (2013, lost connection, also on its read timeout).
def _mysql_no_table(exc: BaseException) -> bool:
    return isinstance(exc, _MySQLError) and bool(exc.args) and exc.args[0] == 1146


MYSQL_ERRORS = sql_boundary((_MySQLError,), _mysql_breaks, missing_table=_mysql_no_table)

T = TypeVar("T")


# The little of asyncmy the hot path uses, typed (its stubs leave parameters untyped).
class _Result(Protocol):
    rows: tuple[tuple[Any, ...], ...] | None
    affected_rows: int


class _Prepared(Protocol):
    async def execute(self, args: Sequence[Any] = ...) -> _Result: ...


class _Connection(Protocol):
    _read_timeout: float | None

    def close(self) -> None: ...

    @property
    def connected(self) -> bool: ...

    def get_autocommit(self) -> bool: ...

    async def autocommit(self, value: bool) -> None: ...

    async def prepare(self, query: str) -> _Prepared: ...


class _Held:
    """A hot-path connection's driver and prepared statements, found by its pool proxy.

    Read once per operation with one dict lookup, where the proxy's
    ``driver_connection`` is a chain of properties through SQLAlchemy's pool.
    """

    __slots__ = ("driver", "expired", "statements")

    def __init__(self, driver: _Connection) -> None:
        self.driver = driver
        self.expired = False  # the watchdog hung up under an operation
        self.statements: dict[str, _Prepared] = {}  # statement ids die with a connection

    async def prepared(self, name: str) -> _Prepared:
        stmt = self.statements.get(name)
        if stmt is None:
            # One extra round trip, the first time this connection runs the statement.
            stmt = self.statements[name] = await self.driver.prepare(MYSQL[name].sql)
        return stmt


# How long past command_timeout the client waits for the server: the server's own
# limits (session_limits) end a slow statement at command_timeout with an error that
# leaves the connection usable; the client's bound only ends a silent server.
_MARGIN = 1.0

# What INSERT IGNORE would truncate silently (strict mode refuses it; IGNORE turns the
# refusal into a warning): checked before the statement, as Postgres' VARCHAR(n) does.
_LIMITS = tuple(
    (name, cast(int, cast(String, records.c[name].type).length))
    for name in ("key", "request_hash", "token")
)


def _check_claim(values: dict[str, Any]) -> None:
    for name, limit in _LIMITS:
        value = values[name]
        if not isinstance(value, str) or len(value) > limit or not value.isascii():
            raise StoreError(
                f"ValueError: the claim's {name} must be at most {limit} ASCII characters"
            )


class MySQLDriver(KeptConnections):
    """asyncmy connections from SQLAlchemy's pool, kept by the hot path between statements.

    The keeping (``limit`` connections at most, FIFO waiters, ``timeout`` seconds for a
    free one, a broken connection taking the idle ones with it) is
    :class:`~.pool.KeptConnections`'s, as for Postgres; what is this driver's: asyncmy's
    prepared statements, autocommit turned on per connection, and which errors break
    a connection (:data:`MYSQL_ERRORS`).
    """

    errors = MYSQL_ERRORS

    def __init__(self, engine: AsyncEngine, *, limit: int, timeout: float) -> None:
        super().__init__(engine, limit=limit, timeout=timeout)
        # Every connection the hot path holds (idle or in use), from _open until it is
        # let go (_close_soon, _discard, close): never handed back to the pool as it is.
        self._conns: dict[PoolProxiedConnection, _Held] = {}
        # The operations in flight and when each is past its bound (loop time), and
        # whether the watchdog (_watch) is scheduled to look at them.
        self._deadlines: dict[_Held, float] = {}
        self._watching = False

    async def _open(self) -> PoolProxiedConnection:
        fairy = await super()._open()
        driver = _driver(fairy)
        try:
            # Once per connection: every hot-path statement then commits by itself.
            if not driver.get_autocommit():
                await driver.autocommit(True)
            # Bounded by _run instead (see the module's docstring). Never back
            # in SQLAlchemy's pool (_close_soon), so its Core work keeps the backstop.
            if getattr(driver, "_read_timeout", None) is not None:
                driver._read_timeout = None
        except BaseException as exc:
            fairy.invalidate()
            await greenlet_spawn(fairy.close)
            self._release_slot()
            if isinstance(exc, MYSQL_ERRORS.errors):
                raise MYSQL_ERRORS.translate(exc) from exc
            raise
        self._conns[fairy] = _Held(driver)
        return fairy

    def _gone(self, fairy: PoolProxiedConnection) -> bool:
        return not self._conns[fairy].driver.connected

    def _close_soon(self, fairy: PoolProxiedConnection) -> None:
        self._conns.pop(fairy, None)
        if fairy.is_valid:
            fairy.invalidate()  # autocommit is on: never back into the pool as it is
        super()._close_soon(fairy)

    async def _discard(self, fairy: PoolProxiedConnection, broken: BaseException) -> None:
        for victim in (fairy, *self._idle):
            self._conns.pop(victim, None)
        await super()._discard(fairy, broken)

    async def _run(self, op: Callable[[Callable[[str], Awaitable[_Prepared]]], Awaitable[T]]) -> T:
        conns, idle = self._conns, self._idle
        if idle and conns[idle[-1]].driver.connected:
            fairy = idle.pop()  # the common case, without _checkout's coroutine
        else:
            fairy = await self._checkout()
        held = conns[fairy]
        driver = held.driver

        # The operation's bound: a deadline the one watchdog hangs up on, rather than a
        # timer per operation (whose scheduling and cancelling in the loop cost several
        # times this) or asyncio.timeout() (more again). A read the hang-up interrupts
        # fails as a lost connection, which drops it (and the idle ones, as on any
        # lost connection).
        bound = self._timeout + _MARGIN
        loop = asyncio.get_running_loop()
        self._deadlines[held] = loop.time() + bound
        if not self._watching:
            self._watching = True
            loop.call_later(_TICK, _watch, self, loop)
        try:
            result = await op(held.prepared)
        except MYSQL_ERRORS.errors as exc:
            expired = held.expired
            if expired or not driver.connected or MYSQL_ERRORS.breaks(exc):
                await self._discard(fairy, exc)
            else:
                self._checkin(fairy)
            if expired:
                timeout = _timeout(bound, exc)
                raise StoreError(f"TimeoutError: {timeout}") from timeout
            raise MYSQL_ERRORS.translate(exc) from exc
        except BaseException as exc:
            # Cancelled mid-statement: the protocol stream is out of step; drop it.
            fairy.invalidate()
            self._close_soon(fairy)
            self._release_slot()
            if held.expired and isinstance(exc, Exception):  # asyncmy, on a connection closed
                timeout = _timeout(bound, exc)
                raise StoreError(f"TimeoutError: {timeout}") from timeout
            raise
        finally:
            del self._deadlines[held]
        if held.expired:  # the answer came in the same loop pass as the hang-up: not reused
            fairy.invalidate()
            self._close_soon(fairy)
            self._release_slot()
        else:
            self._checkin(fairy)
        return result

    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        """(inserted, the row in the way as :data:`RECORD_COLUMNS`, or None if not visible).

        Autocommit, so the SELECT reads the latest committed row: one deleted between
        the two statements reads as None and the store asks again. Sent once more if
        its connection broke (:meth:`~.pool.KeptConnections._send`): a claim whose
        first attempt committed then meets its own row, answered as inserted.
        """
        _check_claim(values)
        insert_args = MYSQL["claim"].args(values)
        select_args = MYSQL["select"].args(values)

        async def op(
            prepared: Callable[[str], Awaitable[_Prepared]],
        ) -> tuple[bool, Sequence[Any] | None]:
            inserted = await (await prepared("claim")).execute(insert_args)
            if inserted.affected_rows == 1:
                return True, None
            rows = (await (await prepared("select")).execute(select_args)).rows
            return False, (rows[0] if rows else None)

        inserted, row = await self._send(op)
        return (True, None) if inserted else own_claim(values, row)

    async def rowcount(self, name: str, values: dict[str, Any]) -> int:
        args = MYSQL[name].args(values)

        async def op(prepared: Callable[[str], Awaitable[_Prepared]]) -> int:
            return int((await (await prepared(name)).execute(args)).affected_rows)

        async def again(prepared: Callable[[str], Awaitable[_Prepared]]) -> int:
            count = await op(prepared)
            if count or name not in LANDED:
                return count
            select = MYSQL["select"].args({"key": values["where_key"]})
            rows = (await (await prepared("select")).execute(select)).rows
            return int(LANDED[name](values, rows[0])) if rows else 0

        return await self._send(op, again)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for fairy in idle:
            self._held -= 1
            self._conns.pop(fairy, None)
            fairy.invalidate()  # autocommit is on: closed rather than pooled
            await greenlet_spawn(fairy.close)
        await super().close()


def _driver(fairy: PoolProxiedConnection) -> _Connection:
    return cast(_Connection, fairy.driver_connection)


def _timeout(bound: float, exc: BaseException) -> TimeoutError:
    """The cause of the 503 of an operation the server did not answer in time: a
    TimeoutError, so that it is not sent again (a second wait would double the
    client's), over the driver's error that the hang-up caused."""
    timeout = TimeoutError(f"no answer from the server within {bound:g}s")
    timeout.__cause__ = exc
    return timeout


# How often the watchdog looks at the operations in flight: an operation past its bound
# is hung up on within this much more.
_TICK = 0.25


def _watch(hot_path: MySQLDriver, loop: asyncio.AbstractEventLoop) -> None:
    """Hang up on every operation past its bound; look again in a tick while any is in
    flight. Not kept by the driver (the loop holds it), so it makes no cycle."""
    deadlines = hot_path._deadlines
    now = loop.time()
    for held, deadline in list(deadlines.items()):
        if deadline <= now and not held.expired:
            held.expired = True
            _hang_up(held.driver)
    if deadlines:
        loop.call_later(_TICK, _watch, hot_path, loop)
    else:
        hot_path._watching = False


def _hang_up(driver: _Connection) -> None:
    """A hot-path operation's time is up: close its connection under the pending read."""
    # Aborted, not only closed: a close waits for unsent bytes, which a server that
    # stopped reading would never take.
    transport = getattr(driver, "_transport", None)
    driver.close()
    if transport is not None:
        transport.abort()


# Off the hot path.


async def prune(conn: AsyncConnection, *, now: Any, batch_size: int) -> int:
    """One batch of the prune: up to ``batch_size`` rows expired at ``now``, by primary key.

    Two statements: a plain (non-locking) read of the victims' keys through the
    ``expires_at`` index, then a delete of those keys that checks the expiry again
    (a row taken over or renewed in between is kept). A single ``DELETE ... LIMIT``
    on the index would instead hold next-key locks on a range of it and block the
    claims inserting there; a delete by key locks only its own rows.
    """
    victims = select(records.c.key).where(records.c.expires_at <= now).limit(batch_size)
    keys = [row[0] for row in await conn.execute(victims)]
    if not keys:
        return 0
    gone = delete(records).where(records.c.key.in_(keys), records.c.expires_at <= now)
    return int((await conn.execute(gone)).rowcount)


# Serialises concurrent create_all calls on one server (a named lock of the session).
_LOCK_NAME = "asgi_idempotency.schema"


class schema_lock:  # used as a function: `async with schema_lock(conn, s):`
    """``GET_LOCK`` for the schema while ``create_all`` runs, released after.

    MariaDB/MySQL DDL commits by itself, so a transaction cannot keep two processes
    from both seeing no table and both recording the migrations' head.
    """

    def __init__(self, conn: AsyncConnection, timeout: float) -> None:
        self._conn, self._timeout = conn, max(1, math.ceil(timeout))

    async def __aenter__(self) -> None:
        got = await self._conn.scalar(
            text("SELECT GET_LOCK(:name, :timeout)"),
            {"name": _LOCK_NAME, "timeout": self._timeout},
        )
        if got != 1:
            raise StoreError(
                f"TimeoutError: another process held the schema lock for {self._timeout}s"
            )

    async def __aexit__(self, *exc: object) -> None:
        await self._conn.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": _LOCK_NAME})


def session_limits(dialect: Dialect, command_timeout: float) -> str:
    """The ``SET SESSION`` that makes the server give up on a statement by itself (and
    keeps notes out of the log).

    ``innodb_lock_wait_timeout`` (whole seconds, at least 1) bounds a wait for a row
    lock, such as a claim queued behind another's insert of the same key; MariaDB's
    ``max_statement_time`` bounds every statement, MySQL's ``max_execution_time`` its
    SELECTs (in milliseconds). Either way the statement is rolled back and the client
    gets an error, not a commit after its 503.
    """
    parts = [
        f"innodb_lock_wait_timeout = {max(1, math.ceil(command_timeout))}",
        # asyncmy logs every note at WARNING: create_all's IF NOT EXISTS on a table
        # that exists is not news.
        "sql_notes = 0",
    ]
    if getattr(dialect, "is_mariadb", False):
        parts.append(f"max_statement_time = {command_timeout:.6f}")
    else:
        parts.append(f"max_execution_time = {max(1, math.ceil(command_timeout * 1000))}")
    return "SET SESSION " + ", ".join(parts)


def install_session_limits(engine: AsyncEngine, command_timeout: float) -> None:
    """Run :func:`session_limits` on each new connection of ``engine`` (no per-statement cost).

    ``connect`` listeners run after the dialect's first-connect initialisation, so
    whether the server is MariaDB is known by then.
    """
    dialect = engine.dialect

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(session_limits(dialect, command_timeout))
        finally:
            cursor.close()

    event.listen(engine.sync_engine, "connect", on_connect)


def connect_args(command_timeout: float) -> dict[str, Any]:
    """asyncmy's connect arguments for an engine the store builds.

    ``read_timeout`` is a second past ``command_timeout`` so that the server's own
    limit (:func:`session_limits`) answers first and the connection stays usable; it
    fires only when the server does not answer at all, and closes the connection. The
    hot path turns it off on the connections it keeps and bounds each operation itself.
    """
    return {
        "connect_timeout": max(1, math.ceil(command_timeout)),
        "read_timeout": command_timeout + _MARGIN,
    }


async def _create_schema(
    engine: AsyncEngine, autocommit: AsyncEngine, command_timeout: float
) -> None:
    # DDL commits by itself here: in autocommit the head is recorded before the lock is
    # released, so the next process sees both or neither.
    async with autocommit.connect() as conn, schema_lock(conn, command_timeout):
        await conn.run_sync(create_tables)


def _hot_path(engine: AsyncEngine, options: HotPathOptions) -> HotPath:
    return MySQLDriver(engine, limit=options.limit, timeout=options.timeout)


def _engine_options(command_timeout: float, pool_size: int) -> dict[str, Any]:
    return {
        **pool_options(command_timeout, pool_size),
        "connect_args": connect_args(command_timeout),
    }


DIALECT = SQLDialect(
    label="MariaDB/MySQL",
    driver="asyncmy",
    errors=MYSQL_ERRORS,
    time=mysql_time,
    clock=MYSQL_CLOCK,
    hot_path=_hot_path,
    engine_options=_engine_options,
    configure_engine=install_session_limits,
    create_schema=_create_schema,
    prune=prune,
    # MariaDB's URLs get transactions (mariadb.py): its claim bounds its lock waits
    # with SET STATEMENT, which MySQL lacks.
    no_transactions=(
        "does not hold the claim and the handler in one transaction on MySQL: on a "
        "MariaDB server use a mariadb+asyncmy:// URL"
    ),
)

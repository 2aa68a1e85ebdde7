"""SQL store: ``postgresql+asyncpg`` or ``mariadb+asyncmy``/``mysql+asyncmy`` in production,
``sqlite+aiosqlite`` embedded.

SQLAlchemy owns the schema, the engine and its pool, dialect selection and
migrations. The hot path (insert, replace, complete, release, renew) runs on the
driver connection taken from that pool (:mod:`.postgres`, :mod:`.sqlite`,
:mod:`.mysql`): each
statement is written once as Core (:mod:`.statements`), compiled per driver at
import and executed as one prepared statement in autocommit, so one statement is
one round trip. Core's execution layer costs about twice the driver for the same
statements on Postgres, and far more on SQLite (``bench/results/NOTES.md``).

Everything off the hot path (``get``, ``find``, ``buckets``, ``prune``) runs through
Core on an autocommit connection. Driver and pool errors become :class:`StoreError`
(:mod:`.sqlerrors`).

The pool and the hot path's connections belong to one event loop at a time: called
from another, the store opens fresh ones there and closes the old ones on their own
loop as it shuts down (:mod:`.loops`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import Executable, event, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import Pool
from sqlalchemy.schema import CreateIndex, CreateTable
from sqlalchemy.util import greenlet_spawn

from ..errors import SchemaMissing, StoreError
from ..urls import async_url, redact
from .base import STATUS_OF, Bucket, NewClaim, Record, StoredResponse
from .loops import LoopTenure
from .mysql import MySQLDriver, install_session_limits, schema_lock
from .mysql import connect_args as mysql_connect_args
from .mysql import prune as mysql_prune
from .postgres import PostgresDriver, PostgresTransaction, open_transaction
from .postgres_batched import BatchingPostgresDriver
from .schema import MYSQL_DIALECTS, records
from .sqlerrors import DRIVER_ERRORS, translate
from .sqlite import pragmas, sqlite_driver
from .statements import (
    as_time,
    buckets_query,
    count_expired_query,
    encode_headers,
    find_query,
    get_query,
    prune_statement,
    sqlite_time,
    to_record,
)

__all__ = ["SQLStore"]

# A row committed by a racing claim after the claim statement's snapshot began reads
# as neither inserted nor in the way; asking again sees it. Past a few tries, give up.
_INSERT_ATTEMPTS = 5


class _Driver(Protocol):
    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        """(inserted, the row in the way as ``RECORD_COLUMNS``, or None if not visible)."""
        ...

    async def rowcount(self, name: str, values: dict[str, Any]) -> int: ...

    async def close(self) -> None: ...


def _aware(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise StoreError("ValueError: naive datetime: pass an aware UTC datetime")
    return value


def _sqlite_aware(value: datetime) -> str:
    return sqlite_time(_aware(value))


def _mysql_aware(value: datetime) -> datetime:
    # DATETIME(6) holds naive UTC (schema.UTCDateTime); asyncmy would drop any offset.
    return _aware(value).astimezone(UTC).replace(tzinfo=None)


class SQLStore:
    """Records in ``idempotency_records`` through SQLAlchemy's async engine.

    Args:
        url_or_engine: a database URL (``postgresql+asyncpg://…``,
            ``mariadb+asyncmy://…`` or ``mysql+asyncmy://…`` with the ``mysql`` extra,
            or ``sqlite+aiosqlite:///path.db``) or an ``AsyncEngine`` the caller owns
            (and disposes: :meth:`close` leaves a passed engine open; on SQLite it
            closes the store's own hot-path connection and joins its thread).
        command_timeout: seconds any one statement may take before the store gives
            up and the request gets 503 (default 5). Set on the driver, so it costs
            no statement of its own. Applies when the store builds the engine, and on
            SQLite to the hot path's own connection either way.
        pool_size: on Postgres and MariaDB/MySQL, connections per process that the
            hot path keeps for its one-statement operations (default 10); the engine
            the store builds has as many again for transactional requests, ``get``,
            ``prune`` and your own Core work. No overflow: a statement waits for a free
            connection, up to ``command_timeout``, rather than open one. With an engine
            of your own the hot path keeps half its pool.
        batching: on Postgres, send the claims, completions, releases and renewals
            that queue while a statement of their kind is in flight as one statement
            (:mod:`.postgres_batched`, and the README's Batching on Postgres section).
            Off by default; the argument alone decides (the library reads no
            environment variable). Ignored on SQLite and MariaDB/MySQL.

    Successive event loops (a ``TestClient`` without ``with``, ``asyncio.run`` twice)
    are fine: on a new loop the store opens a new pool and hot-path connections, and
    the old ones are closed on their loop as it shuts down. An engine you pass keeps
    its one pool: across loops give it ``poolclass=NullPool``, or pass a URL.
    """

    def __init__(
        self,
        url_or_engine: str | AsyncEngine,
        *,
        command_timeout: float = 5.0,
        pool_size: int = 10,
        batching: bool = False,
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
        if self.dialect not in ("postgresql", "sqlite", *MYSQL_DIALECTS):
            raise ValueError(
                f"SQLStore supports postgresql, sqlite, mariadb and mysql, not {self.dialect}"
            )
        if self.dialect == "postgresql" and engine.dialect.driver != "asyncpg":
            raise ValueError(f"SQLStore needs postgresql+asyncpg, not {engine.dialect.driver}")
        if self.dialect in MYSQL_DIALECTS and engine.dialect.driver != "asyncmy":
            raise ValueError(
                f"SQLStore needs {self.dialect}+asyncmy, not {engine.dialect.driver}"
            )
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.batching = batching and self.dialect == "postgresql"
        self._command_timeout = command_timeout
        self._driver = self._new_driver()
        # The loop that the pool's and the driver's connections belong to, and what
        # closes them on it (see _enter); None until the store is first used.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tenure: LoopTenure | None = None
        self._time: Callable[[datetime], Any] = (
            _aware
            if self.dialect == "postgresql"
            else _mysql_aware
            if self.dialect in MYSQL_DIALECTS
            else _sqlite_aware
        )
        # Transactions' connections close even when their request is cancelled.
        self._closing: set[asyncio.Task[Any]] = set()
        self._prepared = False  # prepare() passed once: later calls cost nothing

    def _new_driver(self) -> _Driver:
        engine, timeout = self.engine, self._command_timeout
        if self.dialect in MYSQL_DIALECTS:
            return MySQLDriver(engine, limit=_hot_path_limit(engine), timeout=timeout)
        if self.dialect != "postgresql":
            return sqlite_driver(engine, timeout=timeout)
        limit = _hot_path_limit(engine)
        if self.batching:
            return BatchingPostgresDriver(engine, limit=limit, timeout=timeout)
        return PostgresDriver(engine, limit=limit, timeout=timeout)

    def _enter(self) -> None:
        """Serve from the running loop, which is not the one the connections belong to.

        Every entry point calls this when ``asyncio.get_running_loop()`` is not
        ``self._loop``: the only cost of the check on the hot path. The connections
        of the previous loop cannot be used (nor closed) from this one: the store
        takes a new pool (its own engine) and a new hot-path driver, and leaves the
        old ones to the previous loop's tenure, which closes them on that loop.
        """
        if self._tenure is not None:
            if self._owns_engine:
                # A new pool; the old one is not closed here (close=False) but by its tenure.
                self.engine.sync_engine.dispose(close=False)
            self._driver = self._new_driver()
        close = functools.partial(self._close_loop, self._driver, self.engine.sync_engine.pool)
        self._tenure = LoopTenure(close)
        self._loop = self._tenure.loop

    async def _close_loop(self, driver: _Driver, pool: Pool) -> None:
        """Close a loop's driver and, on the store's own engine, its pool (on that loop)."""
        await driver.close()
        if self._owns_engine:
            await greenlet_spawn(pool.dispose)

    async def create_all(self) -> None:
        """Create the table and index if missing (development and tests; migrate in production).

        A table created here gets the migrations' head recorded in
        ``idempotency_alembic_version`` in the same transaction, so ``prepare``'s check
        passes and a later ``asgi-idempotency migrate`` continues from it. Safe to run
        from several processes at once (a lock on Postgres, ``GET_LOCK`` on MariaDB/MySQL,
        ``BEGIN IMMEDIATE`` on SQLite).
        """
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        try:
            if self.dialect == "sqlite":
                # Workers starting together queue for the write lock below: load what
                # stamping the head needs (alembic, the migration scripts) before taking
                # it, not while the others wait.
                from ..migrations import warm

                await asyncio.to_thread(warm)
                # pysqlite opens no transaction for DDL, and a deferred one would let two
                # workers both see no table: take SQLite's write lock first (busy timeout).
                async with self._autocommit.connect() as conn:
                    await conn.exec_driver_sql("BEGIN IMMEDIATE")
                    try:
                        await conn.run_sync(_create_schema)
                    except BaseException:
                        await conn.exec_driver_sql("ROLLBACK")
                        raise
                    await conn.exec_driver_sql("COMMIT")
            elif self.dialect in MYSQL_DIALECTS:
                # DDL commits by itself here: in autocommit the head is recorded before
                # the lock is released, so the next process sees both or neither.
                async with (
                    self._autocommit.connect() as conn,
                    schema_lock(conn, self._command_timeout),
                ):
                    await conn.run_sync(_create_schema)
            else:
                async with self.engine.begin() as conn:
                    await conn.execute(_PG_SCHEMA_LOCK)
                    await conn.run_sync(_create_schema)
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc

    async def prepare(self) -> None:
        """Make the store ready to serve; the middleware runs it at startup (``PreparedStore``).

        On SQLite, the embedded default, the table is created if missing
        (:meth:`create_all`), so the first start needs no separate step. On Postgres
        the schema is the operator's: this only checks that the table exists and the
        migrations' head is recorded, and changes nothing. Once it has passed, later
        calls return at once (every middleware on this store calls it).

        Raises:
            SchemaMissing: on Postgres, the table or the head is missing; the message
                names the table and ``asgi-idempotency migrate --database-url ...``.
            StoreError: the database could not be reached.
        """
        if self._prepared:
            return
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        if self.dialect == "sqlite":
            await self.create_all()
            self._prepared = True
            return
        from ..migrations import schema_problem, unknown_revisions

        try:
            async with self._autocommit.connect() as conn:
                problem = await conn.run_sync(schema_problem)
                newer = await conn.run_sync(unknown_revisions) if problem else ()
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc
        if newer:
            # Migrating cannot fix this one: this version does not carry the revision.
            url = redact(self.engine.url.render_as_string(hide_password=False))
            fix = (
                "deploy the asgi-idempotency version that migrated it (or downgrade the "
                "database with that version)"
            )
            raise SchemaMissing(
                f"{problem} ({url}): {fix}",
                detail=f"{problem} (the idempotency store's database): {fix}",
            )
        if problem is not None:
            url = redact(self.engine.url.render_as_string(hide_password=False))
            real = " (with the real password for ***)" if "***" in url else ""
            name = "Postgres" if self.dialect == "postgresql" else "MariaDB/MySQL"
            why = (
                f"On {name} the schema is the operator's: the middleware checks it at "
                "startup and creates nothing."
            )
            # The URL (host, port, user, database) is for the log; clients get the rest.
            raise SchemaMissing(
                f"{problem} in {url}: run `asgi-idempotency migrate --database-url '{url}'`"
                f"{real}. {why}",
                detail=f"{problem} in the idempotency store's database: run `asgi-idempotency "
                f"migrate --database-url URL` on it (the server's log names it). {why}",
            )
        self._prepared = True

    # The hot path: one prepared statement on the driver connection each.

    def _claim_values(self, new: NewClaim) -> dict[str, Any]:
        when = self._time
        return {
            "request_hash": new.request_hash,
            "token": new.token,
            "now": when(new.now),
            "locked_until": when(new.locked_until),
            "expires_at": when(new.expires_at),
        }

    async def insert(self, new: NewClaim) -> Record | None:
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        values = self._claim_values(new)
        values["key"] = new.key
        for _ in range(_INSERT_ATTEMPTS):
            inserted, row = await self._driver.claim(values)
            if inserted:
                return None
            if row is not None:
                return to_record(new.key, row)
        raise StoreError(f"insert did not settle after {_INSERT_ATTEMPTS} attempts")

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        values = self._claim_values(new)
        values["where_key"] = expected.key
        values["old_token"] = expected.token
        values["old_status"] = expected.status.value
        values["old_locked_until"] = self._time(expected.locked_until)
        return await self._driver.rowcount("replace", values) == 1

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, expires_at: datetime
    ) -> bool:
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        values = {
            "where_key": key,
            "where_token": token,
            "expires_at": self._time(expires_at),
            "response_status": response.status,
            "response_headers": encode_headers(response.headers),
            "response_body": response.body,
        }
        return await self._driver.rowcount("complete", values) == 1

    async def release(self, key: str, token: str) -> bool:
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        return await self._driver.rowcount("release", {"where_key": key, "where_token": token}) == 1

    async def renew(self, key: str, token: str, *, locked_until: datetime) -> bool:
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        values = {"where_key": key, "where_token": token, "locked_until": self._time(locked_until)}
        return await self._driver.rowcount("renew", values) == 1

    # Transactional mode (Postgres only).

    @property
    def transactions_unavailable(self) -> str | None:
        if self.dialect == "postgresql":
            return None
        if self.dialect in MYSQL_DIALECTS:
            # Not built yet: the transactional claim decides a key under a Postgres
            # advisory lock; GET_LOCK is the equivalent this dialect would need.
            return (
                f"SQLStore on {self.dialect} does not hold the claim and the handler in one "
                "transaction yet (the transactional claim is Postgres's)"
            )
        return (
            f"SQLStore on {self.dialect} cannot hold the claim and the handler in one transaction"
        )

    def transaction(self) -> AbstractAsyncContextManager[PostgresTransaction]:
        """One Postgres transaction for a transactional request (see ``transactional``).

        Raises:
            ValueError: the store is not on Postgres.
        """
        if self.transactions_unavailable is not None:
            raise ValueError(self.transactions_unavailable)
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        return open_transaction(self.engine, self._closing)

    # Off the hot path: Core on an autocommit connection.

    async def _all(self, query: Executable) -> Sequence[Any]:
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        try:
            async with self._autocommit.connect() as conn:
                return (await conn.execute(query)).all()
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc

    async def get(self, key: str) -> Record | None:
        rows = await self._all(get_query(key))
        return to_record(key, tuple(rows[0])) if rows else None

    async def find(self, prefix: str, *, limit: int = 2) -> list[Record]:
        rows = await self._all(find_query(prefix, limit))
        return [to_record(row[0], tuple(row)[1:]) for row in rows]

    async def buckets(self, *, now: datetime) -> list[Bucket]:
        rows = await self._all(buckets_query(now))
        return [
            Bucket(
                STATUS_OF[status],
                bool(expired),
                bool(lease_over),
                int(count),
                None if oldest is None else as_time(oldest),
            )
            for status, expired, lease_over, count, oldest in rows
        ]

    async def count_expired(self, *, now: datetime) -> int:
        rows = await self._all(count_expired_query(now))
        return int(rows[0][0])

    async def prune(self, *, now: datetime, batch_size: int = 1000) -> int:
        stmt = prune_statement(now, batch_size, postgres=self.dialect == "postgresql")
        if asyncio.get_running_loop() is not self._loop:
            self._enter()
        try:
            async with self._autocommit.connect() as conn:
                if self.dialect in MYSQL_DIALECTS:
                    return await mysql_prune(conn, now=now, batch_size=batch_size)
                result = await conn.execute(stmt)
                return int(result.rowcount)
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        closing = [task for task in self._closing if task.get_loop() is loop]
        if closing:
            await asyncio.gather(*closing, return_exceptions=True)
        tenure, self._tenure, self._loop = self._tenure, None, None
        if tenure is not None and tenure.loop is not loop:
            # The connections are another loop's, closed as that loop shuts down; a
            # pool disposed from here would close them on the wrong loop.
            if self._owns_engine:
                self.engine.sync_engine.dispose(close=False)
            return
        if tenure is None:
            await self._driver.close()
        else:
            await tenure.end()
        if self._owns_engine:
            await self.engine.dispose()  # and what was used beside the store (store.engine)


# Serialises concurrent create_all calls on one Postgres database (a transaction-scoped lock).
_PG_SCHEMA_LOCK = text("SELECT pg_advisory_xact_lock(hashtext('asgi_idempotency.schema'))")


def _create_schema(conn: Connection) -> None:
    """The table and its indexes from the one ``Table``; the migrations' head, if created now."""
    from ..migrations import stamp_head

    created = not inspect(conn).has_table(records.name)
    conn.execute(CreateTable(records, if_not_exists=True))
    for index in records.indexes:
        conn.execute(CreateIndex(index, if_not_exists=True))
    if created:
        stamp_head(conn)


def _hot_path_limit(engine: AsyncEngine) -> int:
    """How many connections the hot path keeps: half of a sized pool, else a few."""
    size = getattr(engine.pool, "size", None)
    return max(1, size() // 2) if callable(size) else 4


def _make_engine(url: str, *, command_timeout: float, pool_size: int) -> AsyncEngine:
    url = async_url(url)  # the one URL rule (asgi_idempotency.urls): postgres:// -> asyncpg
    kwargs: dict[str, Any] = {}
    if url.startswith(("postgresql", "mysql", "mariadb")):
        kwargs = {
            # pool_size for the hot path, as many again for everything else.
            "pool_size": 2 * pool_size,
            # No overflow: the hot path holds a connection for one statement, so waiting
            # a moment for one is far cheaper than connecting, and overflow connections
            # are closed when returned to a full pool, so it would reconnect constantly.
            "max_overflow": 0,
            "pool_timeout": command_timeout,
            # Checkouts cost no ping: a broken connection fails its statement, the
            # store invalidates it, and the next statement connects afresh.
            "pool_pre_ping": False,
            "connect_args": {"command_timeout": command_timeout, "timeout": command_timeout},
        }
        if url.startswith(("mysql", "mariadb")):
            kwargs["connect_args"] = mysql_connect_args(command_timeout)
    elif url.startswith("sqlite"):
        kwargs = {"connect_args": {"timeout": command_timeout}}
    engine = create_async_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", pragmas(command_timeout))
    elif engine.dialect.name in MYSQL_DIALECTS:
        install_session_limits(engine, command_timeout)
    return engine

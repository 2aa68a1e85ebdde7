"""SQL store: ``postgresql+asyncpg`` or ``mariadb+asyncmy``/``mysql+asyncmy`` in production,
``sqlite+aiosqlite`` embedded.

One store for every SQL backend. SQLAlchemy owns the schema, the engine and its pool,
dialect selection and migrations; what differs per database (its driver's hot path and
error boundary, how times bind, how the schema is created and a prune batch runs,
whether it batches or opens transactions) is that backend's
:class:`~.dialect.SQLDialect`, declared in its module (:mod:`.postgres`, :mod:`.sqlite`,
:mod:`.mysql`). The hot path (insert, replace, complete, release, renew) runs there on
the driver connection: each statement is written once as Core (:mod:`.statements`),
compiled per driver at import and executed as one prepared statement in autocommit,
so one statement is one round trip. Core's execution layer costs about twice the
driver for the same statements on Postgres, and far more on SQLite
(``bench/results/NOTES.md``).

Everything off the hot path (``get``, ``find``, ``buckets``, ``prune``) runs through
Core on an autocommit connection (:mod:`.queries`), inside the backend's error
boundary (:mod:`asgi_idempotency.stores.errors`, declared per driver).

The pool and the hot path's connections belong to one event loop at a time: called
from another, the store opens fresh ones there and closes the old ones on their own
loop as it shuts down (:mod:`.loops`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import Executable, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import Pool
from sqlalchemy.util import greenlet_spawn

from asgi_idempotency.core.errors import SchemaMissing, StoreError
from asgi_idempotency.stores.base import (
    BUSY,
    STATUS_OF,
    Bucket,
    Busy,
    Capabilities,
    NewClaim,
    Record,
    StoreBase,
    StoredResponse,
    StoreTransaction,
    utcnow,
)
from asgi_idempotency.stores.codec import as_time, encode_headers, to_record
from asgi_idempotency.stores.duplicates import Sighting, SuspectedDuplicate, group_sightings
from asgi_idempotency.stores.sql.dialect import (
    MAX_BATCH,
    HotPath,
    HotPathOptions,
    Op,
    SQLDialect,
    dialect_named,
)
from asgi_idempotency.stores.sql.queries import (
    buckets_query,
    count_expired_query,
    find_query,
    get_query,
    sightings_query,
)
from asgi_idempotency.stores.sql.statements import CALLER_CLOCK, clock_claim_values
from asgi_idempotency.stores.urls import async_url, redact

__all__ = ["SQLStore"]

# A row committed by a racing claim after the claim statement's snapshot began reads
# as neither inserted nor in the way; asking again sees it. Past a few tries, give up.
_INSERT_ATTEMPTS = 5
_US = timedelta(microseconds=1)


class SQLStore(StoreBase):
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
        batching: send the operations that queue while one is in flight together: on
            Postgres as one statement per kind (:mod:`.postgres_batched`, and the
            docs' Batching on Postgres section), on SQLite in one transaction of its
            connection thread. ``None`` (the default) takes the backend's default
            (:attr:`.dialect.SQLDialect.batching`: on for Postgres and SQLite);
            ``False`` sends one statement per request. The argument alone decides (the
            library reads no environment variable). Not available on MariaDB/MySQL yet
            (``True`` raises ``ValueError``).
        max_batch: at most this many operations in one batched statement or
            transaction (default 256).

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
        batching: bool | None = None,
        max_batch: int = MAX_BATCH,
    ) -> None:
        if command_timeout is None or command_timeout <= 0:
            raise ValueError("command_timeout must be a positive number of seconds")
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if isinstance(url_or_engine, AsyncEngine):
            engine, self._owns_engine = url_or_engine, False
        else:
            engine, self._owns_engine = (
                _make_engine(url_or_engine, command_timeout=command_timeout, pool_size=pool_size),
                True,
            )
        self.engine = engine
        self.dialect: str = engine.dialect.name
        spec = self._spec = dialect_named(self.dialect)
        self.errors = spec.errors  # the backend's driver's boundary
        if engine.dialect.driver != spec.driver:
            raise ValueError(
                f"SQLStore needs {self.dialect}+{spec.driver}, not {engine.dialect.driver}"
            )
        if batching and not spec.can_batch:
            raise ValueError(f"SQLStore does not batch on {spec.label} yet: pass batching=False")
        self.batching: bool = spec.batching if batching is None else batching
        self.capabilities = Capabilities(
            transactions=spec.transaction is not None,
            batching=self.batching,
            migrations=True,
            audit=True,
            own_clock=spec.clock is not None,
        )
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._command_timeout = command_timeout
        self._options = HotPathOptions(
            _hot_path_limit(engine), command_timeout, self.batching, max_batch
        )
        self._driver = spec.hot_path(engine, self._options)
        self._time = spec.time
        # Postgres and MariaDB/MySQL decide with their own clock, given durations; SQLite
        # with the caller's, given times (Store).
        self._clock = spec.clock
        self._read_at = (spec.clock or CALLER_CLOCK).read_at
        # Transactions' connections close even when their request is cancelled.
        self._closing: set[asyncio.Task[Any]] = set()
        self._prepared = False  # prepare() passed once: later calls cost nothing

    def _connect(self, *, moved: bool) -> Callable[[], Awaitable[None]]:
        """This loop's pool and hot-path driver (:meth:`StoreBase._bound`).

        The connections of the previous loop cannot be used (nor closed) from this
        one: the store takes a new pool (its own engine) and a new hot-path driver,
        and leaves the old ones to the previous loop's tenure, which closes them there.
        """
        if moved:
            if self._owns_engine:
                # A new pool; the old one is not closed here (close=False) but by its tenure.
                self.engine.sync_engine.dispose(close=False)
            self._driver = self._spec.hot_path(self.engine, self._options)
        return functools.partial(self._close_loop, self._driver, self.engine.sync_engine.pool)

    async def _close_loop(self, driver: HotPath, pool: Pool) -> None:
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
        self._bound()
        with self.errors:
            await self._spec.create_schema(self.engine, self._autocommit, self._command_timeout)

    async def prepare(self) -> None:
        """Make the store ready to serve; the middleware runs it at startup (``PreparedStore``).

        On SQLite, the embedded default, the table is created if missing
        (:meth:`create_all`), so the first start needs no separate step. On Postgres
        and MariaDB/MySQL the schema is the operator's: this only checks that the
        table exists and the migrations' head is recorded, and changes nothing. Once
        it has passed, later calls return at once (every middleware on this store
        calls it).

        Raises:
            SchemaMissing: the table or the head is missing; the message names the
                table and ``asgi-idempotency migrate --database-url ...``.
            ValueError: the server is too old for the backend's statements (MariaDB
                before 10.5 through a ``mariadb+asyncmy://`` URL).
            StoreError: the database could not be reached.
        """
        if self._prepared:
            return
        self._bound()
        if self._spec.embedded:
            await self.create_all()
            self._prepared = True
            return
        from asgi_idempotency.migrations import schema_problem, unknown_revisions

        with self.errors:
            async with self._autocommit.connect() as conn:
                problem = await conn.run_sync(schema_problem)
                newer = await conn.run_sync(unknown_revisions) if problem else ()
        check = self._spec.server_problem
        too_old = None if check is None else check(self.engine.dialect.server_version_info)
        if too_old is not None:
            raise ValueError(f"SQLStore on {self.dialect}: {too_old}")
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
            why = (
                f"On {self._spec.label} the schema is the operator's: the middleware checks "
                "it at startup and creates nothing."
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
        if self._clock is not None:
            return clock_claim_values(new)
        when, now = self._time, new.now
        return {
            "request_hash": new.request_hash,
            "token": new.token,
            "now": when(now),
            "locked_until": when(now + new.lease),
            "expires_at": when(now + new.ttl),
            "scope_digest": new.scope_digest,
            "route": new.route,
        }

    async def insert(self, new: NewClaim) -> Record | Literal[Busy.BUSY] | None:
        self._bound()
        values = self._claim_values(new)
        values["key"] = new.key
        for _ in range(_INSERT_ATTEMPTS):
            inserted, row = await self._driver.claim(values)
            if inserted:
                return None
            if row is BUSY:  # batching on Postgres: an open transaction holds the row
                return BUSY
            if row is not None:
                return to_record(new.key, row)
        raise StoreError(f"insert did not settle after {_INSERT_ATTEMPTS} attempts")

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        self._bound()
        values = self._claim_values(new)
        values["where_key"] = expected.key
        values["old_token"] = expected.token
        values["old_status"] = expected.status.value
        values["old_locked_until"] = self._time(expected.locked_until)
        return await self._driver.rowcount(Op.REPLACE, values) == 1

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        self._bound()
        values = {
            "where_key": key,
            "where_token": token,
            "response_status": response.status,
            "response_headers": encode_headers(response.headers),
            "response_body": response.body,
        }
        if self._clock is not None:
            values["ttl_us"] = ttl // _US
        else:
            values["expires_at"] = self._time(now + ttl)
        return await self._driver.rowcount(Op.COMPLETE, values) == 1

    async def release(self, key: str, token: str) -> bool:
        self._bound()
        values = {"where_key": key, "where_token": token}
        return await self._driver.rowcount(Op.RELEASE, values) == 1

    async def renew(self, key: str, token: str, *, now: datetime, lease: timedelta) -> bool:
        self._bound()
        values: dict[str, Any] = {"where_key": key, "where_token": token}
        if self._clock is not None:
            values["lease_us"] = lease // _US
        else:
            values["locked_until"] = self._time(now + lease)
        return await self._driver.rowcount(Op.RENEW, values) == 1

    # Transactional mode (where the backend has it: Postgres).

    @property
    def transactions_unavailable(self) -> str | None:
        if self._spec.transaction is not None:
            return None
        return f"SQLStore on {self.dialect} {self._spec.no_transactions}"

    def transaction(self) -> AbstractAsyncContextManager[StoreTransaction]:
        """One transaction for a transactional request (see ``transactional``).

        Raises:
            ValueError: the backend has no transactional claim (not Postgres).
        """
        open_transaction = self._spec.transaction
        if open_transaction is None:
            raise ValueError(self.transactions_unavailable)
        self._bound()
        return open_transaction(self.engine, self._closing)

    # Off the hot path: Core on an autocommit connection.

    async def _all(self, query: Executable) -> Sequence[Any]:
        self._bound()
        with self.errors:
            async with self._autocommit.connect() as conn:
                return (await conn.execute(query)).all()

    async def get(self, key: str) -> Record | None:
        rows = await self._all(get_query(key, self._read_at))
        return to_record(key, tuple(rows[0])) if rows else None

    async def find(self, prefix: str, *, limit: int = 2) -> list[Record]:
        rows = await self._all(find_query(prefix, limit, self._read_at))
        return [to_record(row[0], tuple(row)[1:]) for row in rows]

    def _now(self, now: datetime | None) -> Any:
        """The cut-off of an admin query: ``now`` if given, else the database's clock
        (the local one on SQLite)."""
        if now is not None:
            return now
        return utcnow() if self._clock is None else self._clock.now

    async def buckets(self, *, now: datetime | None = None) -> list[Bucket]:
        rows = await self._all(buckets_query(self._now(now)))
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

    async def count_expired(self, *, now: datetime | None = None) -> int:
        rows = await self._all(count_expired_query(self._now(now)))
        return int(rows[0][0])

    async def suspected_duplicates(
        self, *, since: datetime, window: timedelta, route: str | None = None
    ) -> list[SuspectedDuplicate]:
        rows = await self._all(sightings_query(since, route))
        return group_sightings(
            (Sighting(scope, path or "", fingerprint, key, as_time(created))
             for scope, path, fingerprint, key, created in rows),
            window,
        )  # fmt: skip

    async def prune(self, *, now: datetime | None = None, batch_size: int = 1000) -> int:
        self._bound()
        with self.errors:
            async with self._autocommit.connect() as conn:
                return await self._spec.prune(conn, now=self._now(now), batch_size=batch_size)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        closing = [task for task in self._closing if task.get_loop() is loop]
        if closing:
            await asyncio.gather(*closing, return_exceptions=True)
        ended = await self._end_loop()
        if ended is False:
            # The connections are another loop's, closed as that loop shuts down; a
            # pool disposed from here would close them on the wrong loop.
            if self._owns_engine:
                self.engine.sync_engine.dispose(close=False)
            return
        if ended is None:
            await self._driver.close()
        if self._owns_engine:
            await self.engine.dispose()  # and what was used beside the store (store.engine)


def _hot_path_limit(engine: AsyncEngine) -> int:
    """How many connections the hot path keeps: half of a sized pool, else a few."""
    size = getattr(engine.pool, "size", None)
    return max(1, size() // 2) if callable(size) else 4


def _make_engine(url: str, *, command_timeout: float, pool_size: int) -> AsyncEngine:
    url = async_url(url)  # the one URL rule (asgi_idempotency.stores.urls): postgres:// -> asyncpg
    spec: SQLDialect | None
    try:
        spec = dialect_named(make_url(url).get_backend_name())
    except ValueError:
        spec = None  # SQLStore refuses it by its engine's dialect, with the message
    engine = create_async_engine(
        url, **({} if spec is None else spec.engine_options(command_timeout, pool_size))
    )
    if spec is not None:
        spec.configure_engine(engine, command_timeout)
    return engine

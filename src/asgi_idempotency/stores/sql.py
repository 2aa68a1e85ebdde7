"""SQL store on SQLAlchemy Core: ``postgresql+asyncpg`` in production, ``sqlite+aiosqlite`` embedded.

Every hot-path operation is one statement on an autocommit connection: no
BEGIN/COMMIT round trips around single statements. The dialects differ in one
place only, the claim: Postgres inserts and returns the row in its way in one
statement (a data-modifying CTE); SQLite, which has no such CTE, inserts then
reads on conflict.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import bindparam, delete, event, select, text, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Row
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from .base import Claim, ClaimOutcome, Record, RecordStatus, StoredResponse, StoreError, decide
from .schema import UTCDateTime, metadata, records

__all__ = ["SQLStore"]

_t = records
_TIME = UTCDateTime()
# A claim loses a race to a concurrent commit at most a few times; past that something is wrong.
_CLAIM_ATTEMPTS = 5
_STORE_ERRORS = (SQLAlchemyError, OSError, TimeoutError, ConnectionError)

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

# One round trip: insert, or return the live row that is in the way. The outer
# SELECT sees the statement's snapshot, so a row committed by a racing claim
# after it began reads as NULL; the caller then simply asks again.
_PG_CLAIM = (
    text(
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
    )
    .bindparams(
        bindparam("now", type_=_TIME),
        bindparam("locked_until", type_=_TIME),
        bindparam("expires_at", type_=_TIME),
    )
)


def _encode_headers(headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    return orjson.dumps([[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers])


def _decode_headers(raw: bytes) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((k.encode("latin-1"), v.encode("latin-1")) for k, v in orjson.loads(raw))


def _as_time(value: Any) -> datetime:
    out = _TIME.process_result_value(value, None)  # type: ignore[arg-type]  # dialect unused for results
    assert out is not None
    return out


def _row_to_record(key: str, row: Row[Any]) -> Record:
    m = row._mapping
    response = None
    if m["response_status"] is not None:
        response = StoredResponse(
            status=m["response_status"],
            headers=_decode_headers(m["response_headers"]),
            body=bytes(m["response_body"]),
        )
    return Record(
        key=key,
        request_hash=m["request_hash"],
        status=RecordStatus(m["status"]),
        token=m["token"],
        created_at=_as_time(m["created_at"]),
        locked_until=_as_time(m["locked_until"]),
        expires_at=_as_time(m["expires_at"]),
        response=response,
    )


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
            (and disposes: :meth:`close` leaves a passed engine open).
        command_timeout: seconds any one statement may take before the store gives
            up and the request gets 503 (default 5). Set on the driver, so it costs
            no statement of its own. Applies when the store builds the engine.
        pool_size: connections kept per process when the store builds the engine.
    """

    def __init__(
        self,
        url_or_engine: str | AsyncEngine,
        *,
        command_timeout: float = 5.0,
        pool_size: int = 10,
    ) -> None:
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
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    @asynccontextmanager
    async def _connect(self) -> AsyncIterator[AsyncConnection]:
        try:
            async with self._autocommit.connect() as conn:
                yield conn
        except _STORE_ERRORS as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    async def create_all(self) -> None:
        """Create the table and index if missing (development and tests; use migrate in production)."""
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
        values = {
            "key": key,
            "request_hash": request_hash,
            "token": token,
            "now": now,
            "locked_until": locked_until,
            "expires_at": expires_at,
        }
        async with self._connect() as conn:
            for _ in range(_CLAIM_ATTEMPTS):
                if self.dialect == "postgresql":
                    existing, inserted = await self._claim_pg(conn, values)
                else:
                    existing, inserted = await self._claim_sqlite(conn, values)
                if inserted:
                    return Claim(ClaimOutcome.CLAIMED)
                if existing is None:
                    continue  # the row in the way vanished or is not yet visible: ask again
                outcome = (
                    ClaimOutcome.TAKEN_OVER
                    if existing.expires_at <= now
                    else decide(existing, request_hash, now)
                )
                if outcome is not ClaimOutcome.TAKEN_OVER:
                    return Claim(outcome, existing)
                if await self._take_over(conn, existing, values):
                    return Claim(
                        ClaimOutcome.CLAIMED
                        if existing.expires_at <= now
                        else ClaimOutcome.TAKEN_OVER
                    )
        raise StoreError(f"claim did not settle after {_CLAIM_ATTEMPTS} attempts")

    async def _claim_pg(
        self, conn: AsyncConnection, values: dict[str, Any]
    ) -> tuple[Record | None, bool]:
        row = (await conn.execute(_PG_CLAIM, values)).one()
        if row.inserted:
            return None, True
        if row.status is None:
            return None, False
        return _row_to_record(values["key"], row), False

    async def _claim_sqlite(
        self, conn: AsyncConnection, values: dict[str, Any]
    ) -> tuple[Record | None, bool]:
        stmt = (
            sqlite_insert(_t)
            .values(
                key=values["key"],
                request_hash=values["request_hash"],
                status=RecordStatus.IN_PROGRESS.value,
                token=values["token"],
                created_at=values["now"],
                locked_until=values["locked_until"],
                expires_at=values["expires_at"],
            )
            .on_conflict_do_nothing(index_elements=[_t.c.key])
            .returning(_t.c.key)
        )
        if (await conn.execute(stmt)).first() is not None:
            return None, True
        row = (
            await conn.execute(select(*_RECORD_COLUMNS).where(_t.c.key == values["key"]))
        ).first()
        return (None if row is None else _row_to_record(values["key"], row)), False

    async def _take_over(
        self, conn: AsyncConnection, existing: Record, values: dict[str, Any]
    ) -> bool:
        # Conditional on the row exactly as read (its token) and still eligible, so of
        # two racing retries exactly one wins; the other re-reads and gets 409.
        now = values["now"]
        stmt = (
            update(_t)
            .where(
                _t.c.key == values["key"],
                _t.c.token == existing.token,
                (_t.c.expires_at <= now)
                | (
                    (_t.c.status == RecordStatus.IN_PROGRESS.value)
                    & (_t.c.locked_until <= now)
                    & (_t.c.request_hash == values["request_hash"])
                ),
            )
            .values(
                request_hash=values["request_hash"],
                status=RecordStatus.IN_PROGRESS.value,
                token=values["token"],
                created_at=now,
                locked_until=values["locked_until"],
                expires_at=values["expires_at"],
                response_status=None,
                response_headers=None,
                response_body=None,
            )
        )
        return (await conn.execute(stmt)).rowcount == 1

    def _owned(self, key: str, token: str) -> Any:
        return (
            (_t.c.key == key)
            & (_t.c.token == token)
            & (_t.c.status == RecordStatus.IN_PROGRESS.value)
        )

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, expires_at: datetime
    ) -> bool:
        stmt = (
            update(_t)
            .where(self._owned(key, token))
            .values(
                status=RecordStatus.COMPLETED.value,
                expires_at=expires_at,
                response_status=response.status,
                response_headers=_encode_headers(response.headers),
                response_body=response.body,
            )
        )
        async with self._connect() as conn:
            return (await conn.execute(stmt)).rowcount == 1

    async def release(self, key: str, token: str) -> bool:
        async with self._connect() as conn:
            return (await conn.execute(delete(_t).where(self._owned(key, token)))).rowcount == 1

    async def renew(self, key: str, token: str, *, locked_until: datetime) -> bool:
        stmt = update(_t).where(self._owned(key, token)).values(locked_until=locked_until)
        async with self._connect() as conn:
            return (await conn.execute(stmt)).rowcount == 1

    async def get(self, key: str) -> Record | None:
        async with self._connect() as conn:
            row = (await conn.execute(select(*_RECORD_COLUMNS).where(_t.c.key == key))).first()
        return None if row is None else _row_to_record(key, row)

    async def prune(self, *, now: datetime, batch_size: int = 1000) -> int:
        victims = select(_t.c.key).where(_t.c.expires_at <= now).limit(batch_size)
        if self.dialect == "postgresql":
            # Rows a concurrent claim is taking over are skipped, not waited on.
            victims = victims.with_for_update(skip_locked=True)
        async with self._connect() as conn:
            result = await conn.execute(delete(_t).where(_t.c.key.in_(victims.scalar_subquery())))
            return result.rowcount

    async def close(self) -> None:
        if self._owns_engine:
            await self.engine.dispose()


def _make_engine(url: str, *, command_timeout: float, pool_size: int) -> AsyncEngine:
    kwargs: dict[str, Any] = {}
    if url.startswith("postgresql"):
        kwargs = {
            "pool_size": pool_size,
            "max_overflow": pool_size,
            "pool_timeout": command_timeout,
            # Checkouts cost no ping: a broken connection fails its statement, the
            # pool invalidates it, and the next request connects afresh.
            "pool_pre_ping": False,
            "connect_args": {"command_timeout": command_timeout, "timeout": command_timeout},
        }
    elif url.startswith("sqlite"):
        kwargs = {"connect_args": {"timeout": command_timeout}}
    engine = create_async_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _set_sqlite_pragmas)
    return engine


"""SQLite: the embedded default's hot path, on one connection kept for the store's life.

SQLite admits one writer at a time and every hot-path statement writes, so queueing
on one connection's thread costs nothing, while several connections would wait for
each other in ``busy_timeout`` sleeps. The claim inserts and, on conflict, reads the
row in the way, both in one call to that thread (SQLite has no data-modifying CTE).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from .sqlerrors import DRIVER_ERRORS, SQLITE_BROKEN, breaks, translate
from .statements import SQLITE

__all__ = ["SQLiteDriver", "set_pragmas"]

T = TypeVar("T")


def _sqlite_claim(
    conn: sqlite3.Connection, insert_args: tuple[Any, ...], select_args: tuple[Any, ...]
) -> tuple[bool, Sequence[Any] | None]:
    # Runs on aiosqlite's thread: insert, and on conflict read, in one hop.
    if conn.execute(SQLITE["claim"].sql, insert_args).fetchone() is not None:
        return True, None
    return False, conn.execute(SQLITE["select"].sql, select_args).fetchone()


def _sqlite_rowcount(conn: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> int:
    return conn.execute(sql, args).rowcount


def _sqlite_autocommit(conn: sqlite3.Connection, level: Any) -> Any:
    previous = conn.isolation_level
    conn.isolation_level = level
    return previous


class SQLiteDriver:
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
        except DRIVER_ERRORS as exc:
            if breaks(exc, SQLITE_BROKEN) and self._fairy is not None:
                fairy, self._fairy = self._fairy, None
                fairy.invalidate(exc)
                await greenlet_spawn(fairy.close)
            raise translate(exc) from exc

    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        return await self._run(
            _sqlite_claim,
            SQLITE["claim"].args(values),
            SQLITE["select"].args(values),
        )

    async def rowcount(self, name: str, values: dict[str, Any]) -> int:
        stmt = SQLITE[name]
        return await self._run(_sqlite_rowcount, stmt.sql, stmt.args(values))

    async def close(self) -> None:
        fairy, self._fairy = self._fairy, None
        if fairy is None:
            return
        try:
            driver: Any = fairy.driver_connection
            await driver._execute(_sqlite_autocommit, driver._conn, self._saved_level)
        except DRIVER_ERRORS:
            fairy.invalidate()
        await greenlet_spawn(fairy.close)


def set_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers run beside the one writer; busy_timeout makes concurrent
    # workers wait for the write lock instead of failing with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()

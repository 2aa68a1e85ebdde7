"""SQL driver errors: the one translation into :class:`StoreError`, and which break a connection.

Every SQL path (the Postgres and SQLite hot paths, Core queries off the hot path,
transactions) catches :data:`DRIVER_ERRORS` and raises :func:`translate` of it, so
nothing above ``stores/`` sees a driver's exception type.
"""

from __future__ import annotations

import sqlite3

import asyncpg
from sqlalchemy.exc import SQLAlchemyError

from ..errors import StoreError

__all__ = ["DRIVER_ERRORS", "PG_BROKEN", "SQLITE_BROKEN", "breaks", "translate"]

# Everything the pool, the drivers and the network raise for a failed statement.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
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
PG_BROKEN: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,  # SQLSTATE class 08
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,
)
SQLITE_BROKEN: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    sqlite3.ProgrammingError,
    sqlite3.InterfaceError,
)


def translate(exc: BaseException) -> StoreError:
    """The store error for a driver's exception (raise it ``from exc``)."""
    return StoreError.wrap(exc)


def breaks(exc: BaseException, broken: tuple[type[BaseException], ...]) -> bool:
    """Whether ``exc`` leaves the connection unusable (TimeoutError is an OSError: see above)."""
    return isinstance(exc, broken) and not isinstance(exc, TimeoutError)

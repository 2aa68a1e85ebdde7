"""SQL driver errors: the one translation into :class:`StoreError`, and which break a connection.

Every SQL path (the Postgres, SQLite and MariaDB/MySQL hot paths, Core queries off the hot path,
transactions) catches :data:`DRIVER_ERRORS` and raises :func:`translate` of it, so
nothing above ``stores/`` sees a driver's exception type. What is not a driver's
(a ``TypeError``, say) is a bug of ours and stays a 500.
"""

from __future__ import annotations

import sqlite3

import asyncpg
from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_dbapi
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from ..errors import StoreError

__all__ = [
    "DRIVER_ERRORS",
    "PG_BROKEN",
    "SQLITE_BROKEN",
    "breaks",
    "mysql_breaks",
    "translate",
]

try:  # the mysql extra: asyncmy raises its own errors, SQLAlchemy's adapter passes them on
    from asyncmy.errors import MySQLError as _MySQLError
except ImportError:  # pragma: no cover - without the extra no MySQL path can run

    class _MySQLError(Exception):  # type: ignore[no-redef]  # a stand-in nothing raises
        pass


# SQLAlchemy's asyncpg adapter re-raises asyncpg's errors as DBAPI exceptions of its
# own, which derive from Exception alone. Engine and Core wrap them in DBAPIError,
# but the hot path's AsyncEngine.raw_connection() lets them through as they are: an
# unknown role, an unknown database or a wrong password at connect.
_ASYNCPG_ADAPTED: type[Exception] = AsyncAdapt_asyncpg_dbapi.Error

# Everything the pool, the drivers and the network raise for a failed statement.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    SQLAlchemyError,
    _ASYNCPG_ADAPTED,
    OSError,  # includes ConnectionError
    TimeoutError,  # asyncio.TimeoutError since 3.11: asyncpg's command_timeout
    asyncpg.PostgresError,
    asyncpg.InterfaceError,  # includes ConnectionDoesNotExistError
    asyncpg.InternalClientError,
    sqlite3.Error,
    ValueError,  # aiosqlite: "Connection closed" / "no active connection"
    # asyncmy: every server error (a deadlock, 1213, and a lock wait timeout, 1205,
    # included: the statement was rolled back, the client gets 503 and retries) and
    # the client's own (2013, lost connection, also on its read timeout).
    _MySQLError,
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
    """The store error for a driver's exception (raise it ``from exc``).

    Its message is the driver's own exception, class and message (``"InvalidPasswordError:
    password authentication failed for user ..."``), unwrapped from SQLAlchemy's
    wrappers, whose text would add the statement and its parameters, and with any
    credentials masked (:meth:`StoreError.wrap`).
    """
    driver = exc
    if isinstance(driver, DBAPIError) and driver.orig is not None:
        driver = driver.orig
    if isinstance(driver, _ASYNCPG_ADAPTED) and driver.__cause__ is not None:
        driver = driver.__cause__
    return StoreError.wrap(driver)


# Server errors after which a MariaDB/MySQL connection is gone: shutdown (1053), killed
# (1927, MariaDB), idle too long (4031, MySQL 8). Client errors are 2000-2999 (2006
# server gone, 2013 lost connection); a deadlock or a timed-out statement leaves the
# connection usable.
_MYSQL_GONE = frozenset((1053, 1927, 4031))


def mysql_breaks(exc: BaseException) -> bool:
    """Whether ``exc`` leaves an asyncmy connection unusable."""
    if not isinstance(exc, _MySQLError):
        return isinstance(exc, OSError)
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
    return 2000 <= code < 3000 or code in _MYSQL_GONE or code == 0


def breaks(exc: BaseException, broken: tuple[type[BaseException], ...]) -> bool:
    """Whether ``exc`` leaves the connection unusable (TimeoutError is an OSError: see above)."""
    return isinstance(exc, broken) and not isinstance(exc, TimeoutError)

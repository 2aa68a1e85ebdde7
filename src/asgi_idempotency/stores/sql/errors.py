"""SQL driver errors: one boundary per driver, mapping its failures to :class:`StoreError` once.

Each SQL dialect declares its driver's :class:`ErrorBoundary` (:data:`PG_ERRORS`,
:data:`SQLITE_ERRORS`, :data:`MYSQL_ERRORS`): which exceptions are that driver's
failures, and which of them leave a connection unusable. Every path of that dialect
(the hot path, Core queries off it, transactions) runs inside it (``with boundary:``),
so nothing above ``stores/`` sees a driver's exception type. What is not the driver's
(a ``TypeError``, a ``ValueError`` from our own code on Postgres, say) is a bug of ours
and stays a logged 500.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from types import TracebackType

import asyncpg
from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_dbapi
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from asgi_idempotency.core.errors import SchemaMissing, StoreError

__all__ = ["MYSQL_ERRORS", "PG_ERRORS", "SQLITE_ERRORS", "ErrorBoundary", "translate"]

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

# What every SQL dialect's path may raise besides its driver's own: SQLAlchemy's pool
# and Core, the network, and a timeout (asyncio.TimeoutError since 3.11).
_COMMON: tuple[type[BaseException], ...] = (SQLAlchemyError, OSError, TimeoutError)


def _driver_exception(exc: BaseException) -> BaseException:
    """The driver's own exception inside SQLAlchemy's wrappers."""
    driver = exc
    if isinstance(driver, DBAPIError) and driver.orig is not None:
        driver = driver.orig
    if isinstance(driver, _ASYNCPG_ADAPTED) and driver.__cause__ is not None:
        driver = driver.__cause__
    return driver


def translate(exc: BaseException) -> StoreError:
    """The store error for a driver's exception (raise it ``from exc``).

    Its message is the driver's own exception, class and message (``"InvalidPasswordError:
    password authentication failed for user ..."``), unwrapped from SQLAlchemy's
    wrappers, whose text would add the statement and its parameters, and with any
    credentials masked (:meth:`StoreError.wrap`).
    """
    return StoreError.wrap(_driver_exception(exc))


# What a client may read when the records table is missing (the log has the driver's words).
_NO_TABLE_DETAIL = (
    "The idempotency store's table is missing: run `asgi-idempotency migrate "
    "--database-url URL` on its database."
)


def _never(exc: BaseException) -> bool:
    return False


class ErrorBoundary:
    """One driver's failures, mapped to :class:`StoreError` in one place.

    ``with boundary:`` around driver work raises :meth:`translate` of any of
    :attr:`errors` that escapes it; anything else passes unchanged (a bug is a bug).
    Stateless, so one instance serves every call, nested or concurrent. Paths that
    must also drop a broken connection catch :attr:`errors` themselves, ask
    :meth:`breaks`, and raise :meth:`translate`.

    Args:
        errors: the exception types that are this driver's failures.
        breaks: whether such a failure leaves its connection unusable.
        missing_table: whether it says the records table does not exist; it then
            becomes :class:`SchemaMissing`, whose fix is a migration, not a retry.
    """

    __slots__ = ("_breaks", "_missing_table", "errors")

    def __init__(
        self,
        errors: tuple[type[BaseException], ...],
        breaks: Callable[[BaseException], bool],
        missing_table: Callable[[BaseException], bool] = _never,
    ) -> None:
        self.errors = errors
        self._breaks = breaks
        self._missing_table = missing_table

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and isinstance(exc, self.errors) and not isinstance(exc, StoreError):
            raise self.translate(exc) from exc

    def breaks(self, exc: BaseException) -> bool:
        """Whether ``exc`` (one of :attr:`errors`) leaves the connection unusable."""
        return self._breaks(exc)

    def translate(self, exc: BaseException) -> StoreError:
        """The :class:`StoreError` for one of :attr:`errors` (raise it ``from exc``)."""
        driver = _driver_exception(exc)
        if self._missing_table(driver):
            message = StoreError.wrap(driver).args[0]
            return SchemaMissing(message, detail=_NO_TABLE_DETAIL)
        return StoreError.wrap(driver)


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


def _pg_breaks(exc: BaseException) -> bool:
    driver = _driver_exception(exc)
    return isinstance(driver, _PG_BROKEN) and not isinstance(driver, TimeoutError)


PG_ERRORS = ErrorBoundary(
    (
        *_COMMON,
        _ASYNCPG_ADAPTED,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,  # includes ConnectionDoesNotExistError
        asyncpg.InternalClientError,
    ),
    _pg_breaks,
    missing_table=lambda exc: isinstance(exc, asyncpg.UndefinedTableError),
)

# sqlite3 raises ProgrammingError on a closed connection; aiosqlite (the engine's
# connections) a ValueError ("Connection closed", "no active connection").
_SQLITE_BROKEN: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    sqlite3.ProgrammingError,
    sqlite3.InterfaceError,
)


def _sqlite_breaks(exc: BaseException) -> bool:
    return isinstance(exc, _SQLITE_BROKEN) and not isinstance(exc, TimeoutError)


def _sqlite_no_table(exc: BaseException) -> bool:
    # SQLite reports a missing table with its generic error code (SQLITE_ERROR); its
    # message is all there is to tell it by.
    return isinstance(exc, sqlite3.OperationalError) and str(exc).startswith("no such table")


SQLITE_ERRORS = ErrorBoundary(
    (*_COMMON, sqlite3.Error, ValueError), _sqlite_breaks, missing_table=_sqlite_no_table
)


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


MYSQL_ERRORS = ErrorBoundary((*_COMMON, _MySQLError), _mysql_breaks, missing_table=_mysql_no_table)

"""SQLAlchemy's share of the SQL stores' error boundaries.

Each SQL driver's module declares its own :class:`~asgi_idempotency.stores.errors.ErrorBoundary`
(:data:`.postgres.PG_ERRORS` for asyncpg, :data:`.mysql.MYSQL_ERRORS` for asyncmy,
:data:`.sqlite.SQLITE_ERRORS` for sqlite3) through :func:`sql_boundary`, which adds
what every SQL path may raise besides its driver's own (SQLAlchemy's pool and Core,
the network, a timeout) and finds the driver's exception inside SQLAlchemy's
``DBAPIError``. Only SQLAlchemy is imported here: no driver.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from asgi_idempotency.stores.errors import ErrorBoundary

__all__ = ["COMMON", "ErrorBoundary", "sql_boundary", "unwrap"]

# What every SQL dialect's path may raise besides its driver's own: SQLAlchemy's pool
# and Core, the network, and a timeout (asyncio.TimeoutError since 3.11).
COMMON: tuple[type[BaseException], ...] = (SQLAlchemyError, OSError, TimeoutError)


def unwrap(exc: BaseException) -> BaseException:
    """The driver's own exception inside SQLAlchemy's ``DBAPIError``."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        return exc.orig
    return exc


def _never(exc: BaseException) -> bool:
    return False


def sql_boundary(
    errors: tuple[type[BaseException], ...],
    breaks: Callable[[BaseException], bool],
    *,
    missing_table: Callable[[BaseException], bool] = _never,
    unwrap: Callable[[BaseException], BaseException] = unwrap,
) -> ErrorBoundary:
    """A SQL driver's boundary: its ``errors`` and SQLAlchemy's (:data:`COMMON`)."""
    return ErrorBoundary((*COMMON, *errors), breaks, missing_table=missing_table, unwrap=unwrap)

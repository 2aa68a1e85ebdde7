"""The error boundary: one driver's failures mapped to :class:`StoreError` once.

Driver-neutral: this module imports no driver. Each driver's module declares its own
boundary (:data:`.sql.postgres.PG_ERRORS` for asyncpg, :data:`.sql.mysql.MYSQL_ERRORS`
for asyncmy, :data:`.sql.sqlite.SQLITE_ERRORS` for sqlite3, :data:`.redis.REDIS_ERRORS`
for redis-py; SQLAlchemy's own types and wrappers join the SQL ones through
:mod:`.sql.errors`): which exceptions are its failures, which of them leave a
connection unusable, which say the records table is missing, and how to find the
driver's exception inside a wrapper. Every path of that store runs inside it
(``with boundary:``), so nothing above ``stores/`` sees a driver's exception type.
What is not the driver's (a ``TypeError``, a ``ValueError`` of our own code) is a bug
of ours and stays a logged 500.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from asgi_idempotency.core.errors import SchemaMissing, StoreError

__all__ = ["ErrorBoundary"]

# What a client may read when the records table is missing (the log has the driver's words).
_NO_TABLE_DETAIL = (
    "The idempotency store's table is missing: run `asgi-idempotency migrate "
    "--database-url URL` on its database."
)


def _never(exc: BaseException) -> bool:
    return False


def _itself(exc: BaseException) -> BaseException:
    return exc


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
        missing_table: whether it says the records table does not exist (asked of the
            driver's own exception); it then becomes :class:`SchemaMissing`, whose fix
            is a migration, not a retry.
        unwrap: the driver's own exception inside a wrapper (SQLAlchemy's); by default
            the exception itself. The message names the driver's exception, class and
            message, never the wrapper's text (which would add the statement and its
            parameters).
    """

    __slots__ = ("_breaks", "_missing_table", "_unwrap", "errors")

    def __init__(
        self,
        errors: tuple[type[BaseException], ...],
        breaks: Callable[[BaseException], bool],
        missing_table: Callable[[BaseException], bool] = _never,
        unwrap: Callable[[BaseException], BaseException] = _itself,
    ) -> None:
        self.errors = errors
        self._breaks = breaks
        self._missing_table = missing_table
        self._unwrap = unwrap

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

    def driver_exception(self, exc: BaseException) -> BaseException:
        """The driver's own exception inside the wrappers around ``exc``."""
        return self._unwrap(exc)

    def translate(self, exc: BaseException) -> StoreError:
        """The :class:`StoreError` for one of :attr:`errors` (raise it ``from exc``):
        ``"ClassName: message"`` of the driver's own exception, credentials masked
        (:meth:`StoreError.wrap`)."""
        driver = self._unwrap(exc)
        if self._missing_table(driver):
            message = StoreError.wrap(driver).args[0]
            return SchemaMissing(message, detail=_NO_TABLE_DETAIL)
        return StoreError.wrap(driver)

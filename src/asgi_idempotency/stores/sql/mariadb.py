"""MariaDB: the MariaDB/MySQL backend (:mod:`.mysql`), its claim in one statement, and
transactional mode.

``SQLStore("mariadb+asyncmy://…")`` claims with ``INSERT ... ON DUPLICATE KEY UPDATE
... RETURNING`` (MariaDB 10.5 or later), which returns the row inserted or the one in
the way: one round trip for a replay, 409 or 422, where MySQL's ``INSERT IGNORE``
then ``SELECT`` take two (:class:`MariaDBDriver`). It serves transactional routes: one
SQLAlchemy connection per request, whose transaction holds the claim, the handler's
writes and the completed record (:class:`MariaDBTransaction`). ``mysql+asyncmy://``
URLs keep the plain backend: MySQL has neither ``RETURNING`` nor the ``SET
STATEMENT`` that bounds the transactional claim's lock waits.

Transactional claims wait on nobody: where Postgres takes a non-blocking advisory
lock, the claim's own row lock serves (the statement locks the key's row, new or met,
until the transaction ends), with ``innodb_lock_wait_timeout = 0``, so a key another
transaction holds answers :data:`~.base.BUSY` (409) at once. No gap lock, no lock past
the transaction, and the handler keeps the server's isolation level
(:class:`MariaDBTransaction`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Any, Literal

from sqlalchemy import ClauseElement
from sqlalchemy.dialects.mysql.asyncmy import dialect as _asyncmy_dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from asgi_idempotency.stores.base import BUSY, Busy, NewClaim, Record
from asgi_idempotency.stores.codec import mysql_time, to_record
from asgi_idempotency.stores.sql.dialect import HotPath, HotPathOptions
from asgi_idempotency.stores.sql.mysql import DIALECT as _MYSQL
from asgi_idempotency.stores.sql.mysql import MYSQL_ERRORS, MySQLDriver, _check_claim
from asgi_idempotency.stores.sql.pool import own_claim
from asgi_idempotency.stores.sql.statements import (
    MARIADB_TX_CLAIM,
    MARIADB_TX_COMPLETE,
    MARIADB_TX_REPLACE,
    MYSQL,
    Compiled,
    clock_claim_values,
)
from asgi_idempotency.stores.sql.transaction import SQLTransaction
from asgi_idempotency.stores.sql.transaction import open_transaction as sql_transaction

__all__ = ["DIALECT", "MariaDBDriver", "MariaDBTransaction", "open_transaction", "server_problem"]

_LOCK_WAIT_TIMEOUT = 1205


def _no_wait(stmt: ClauseElement) -> Compiled:
    """``stmt`` for asyncmy's cursor (``%s``), waiting for no row lock."""
    compiled = Compiled(stmt, _asyncmy_dialect())
    compiled.sql = f"SET STATEMENT innodb_lock_wait_timeout = 0 FOR {compiled.sql}"
    return compiled


_CLAIM = _no_wait(MARIADB_TX_CLAIM)
# The claim's own row, locked by this transaction since its claim: nothing to wait for.
_REPLACE = Compiled(MARIADB_TX_REPLACE, _asyncmy_dialect())
_COMPLETE = Compiled(MARIADB_TX_COMPLETE, _asyncmy_dialect())


class MariaDBDriver(MySQLDriver):
    """MySQL's hot path, with the claim in one statement that returns the row it met."""

    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        """(inserted, the row in the way as :data:`RECORD_COLUMNS`): the statement returns
        the row inserted (exactly this claim's values) or the one it met. The same answer
        when it is sent again after its connection broke: its own row, inserted."""
        _check_claim(values)
        args = MYSQL["claim_returning"].args(values)

        async def op(prepared: Callable[[str], Awaitable[Any]]) -> Sequence[Any]:
            rows = (await (await prepared("claim_returning")).execute(args)).rows
            assert rows  # one row, inserted or met, whichever
            row: Sequence[Any] = rows[0]
            return row

        return own_claim(values, await self._send(op))


def _hot_path(engine: AsyncEngine, options: HotPathOptions) -> HotPath:
    return MariaDBDriver(engine, limit=options.limit, timeout=options.timeout)


def _code(exc: DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


class MariaDBTransaction(SQLTransaction):
    """One request's transaction: the claim under its row's lock, then the record.

    The claim runs with no lock wait (1205 is :data:`~.base.BUSY`); the handler's
    statements keep the session's. The row the claim judges is the last committed one
    (a locking read), so the transaction keeps the server's isolation level and the
    handler's snapshot, under REPEATABLE READ, begins at its own first read.

    Round trips for a first request: the claim (the transaction begins with it), the
    handler's own statements, complete, COMMIT. Replays, 409s and 422s: the claim,
    then ROLLBACK as the connection goes back to the pool.
    """

    __slots__ = ()

    errors = MYSQL_ERRORS

    async def insert(self, new: NewClaim) -> Record | Literal[Busy.BUSY] | None:
        values = clock_claim_values(new)
        values["key"] = new.key
        _check_claim(values)
        with MYSQL_ERRORS:
            try:
                result = await self._conn.exec_driver_sql(_CLAIM.sql, _CLAIM.args(values))
            except DBAPIError as exc:
                if _code(exc) == _LOCK_WAIT_TIMEOUT:
                    # Another transaction holds the row: it is deciding this key. Only
                    # the statement was rolled back; the caller rolls back the rest.
                    return BUSY
                raise
            row = tuple(result.one())
        # The row returned is the one inserted (exactly this claim) or the one met.
        inserted, _ = own_claim(values, row)
        return None if inserted else to_record(new.key, row)

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        # A compare-and-swap, as everywhere, though the claim's lock has kept the row
        # as it read it.
        values = clock_claim_values(new)
        values["where_key"] = new.key
        values["old_token"] = expected.token
        values["old_status"] = expected.status.value
        values["old_locked_until"] = mysql_time(expected.locked_until)
        with MYSQL_ERRORS:
            result = await self._conn.exec_driver_sql(_REPLACE.sql, _REPLACE.args(values))
        return bool(result.rowcount)

    async def _complete(self, values: dict[str, Any]) -> int:
        result = await self._conn.exec_driver_sql(_COMPLETE.sql, _COMPLETE.args(values))
        return int(result.rowcount)


def open_transaction(
    engine: AsyncEngine, closing: set[asyncio.Task[Any]]
) -> AbstractAsyncContextManager[MariaDBTransaction]:
    """A connection in a transaction (:func:`.transaction.open_transaction`)."""
    return sql_transaction(MariaDBTransaction, engine, closing)


def server_problem(version: tuple[Any, ...] | None) -> str | None:
    """Why a server cannot serve a ``mariadb+asyncmy://`` store, or None: ``RETURNING`` on
    an insert came with MariaDB 10.5."""
    if version is None or tuple(version[:2]) >= (10, 5):
        return None
    found = ".".join(str(part) for part in version[:3])
    return (
        f"the server is MariaDB {found}; the claim's INSERT ... RETURNING needs MariaDB "
        "10.5 or later (a mysql+asyncmy:// URL serves older servers, without "
        "transactional mode)"
    )


DIALECT = replace(
    _MYSQL, hot_path=_hot_path, transaction=open_transaction, server_problem=server_problem
)

"""Transactional mode's one shape: a connection of the pool in a transaction, what the
handler writes through, and the commit with the record, for every backend that has it.

A backend says only how its claim and its swap run under the key's lock (Postgres:
an advisory lock, :class:`~.postgres.PostgresTransaction`; MariaDB: the claim's own
row lock, :class:`~.mariadb.MariaDBTransaction`), how it completes the record, and,
where its driver can tell, which pooled connection the server has already closed.
Opening, committing with the record, committing the writes alone and closing (even
when cancelled) are here, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.pool import PoolProxiedConnection

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.base import StoredResponse
from asgi_idempotency.stores.codec import encode_headers
from asgi_idempotency.stores.errors import ErrorBoundary

__all__ = ["IdempotencyTransaction", "SQLTransaction", "close", "open_transaction"]

_US = timedelta(microseconds=1)


@dataclass(frozen=True, slots=True)
class IdempotencyTransaction:
    """What a transactional handler writes through: one connection, one transaction.

    ``session`` is bound to ``connection``; its ``commit()`` does not end the outer
    transaction (the middleware commits it, with the record, after the handler).
    """

    connection: AsyncConnection
    session: AsyncSession


class SQLTransaction:
    """One request's transaction on one pooled connection (a backend subclasses it with
    its ``insert`` and ``replace``, and :meth:`_complete`)."""

    __slots__ = ("_closing", "_conn", "_engine", "state")

    # The driver's boundary, which every statement of the transaction runs inside.
    errors: ClassVar[ErrorBoundary]

    @staticmethod
    def gone(fairy: PoolProxiedConnection) -> bool:
        """Whether the driver knows a pooled connection closed (it read the server's
        end), with no I/O; by default it cannot tell (the first statement finds out)."""
        return False

    def __init__(
        self, engine: AsyncEngine, conn: AsyncConnection, closing: set[asyncio.Task[Any]]
    ) -> None:
        self._engine = engine
        self._closing = closing
        self._conn = conn
        self.state = IdempotencyTransaction(conn, AsyncSession(bind=conn))

    async def _complete(self, values: dict[str, Any]) -> int:
        """Complete the record (``values``: the key, the token, the ttl and the
        response); the rows it changed."""
        raise NotImplementedError

    async def commit(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> None:
        values = {
            "where_key": key,
            "where_token": token,
            "ttl_us": ttl // _US,
            "response_status": response.status,
            "response_headers": encode_headers(response.headers),
            "response_body": response.body,
        }
        with self.errors:
            await self.state.session.flush()
            if await self._complete(values) != 1:
                # The row is not this claim's (another token's, or gone): the claim was
                # answered wrongly, and another run of the handler owns the key. Its
                # writes must not land beside that run's; the retry replays its answer.
                await self._conn.rollback()
                raise StoreError("the record is not this transaction's claim; rolled back")
            await self._conn.commit()

    async def commit_writes(self) -> None:
        with self.errors:
            await self.state.session.flush()
            await self._conn.commit()

    @classmethod
    async def begin(cls, engine: AsyncEngine, closing: set[asyncio.Task[Any]]) -> AsyncConnection:
        """A connection of the pool, its transaction begun (no statement: the BEGIN
        goes to the server with the claim)."""
        while True:
            with cls.errors:
                conn = await engine.connect()
            # One the server closed while it was idle, which the driver has read the end
            # of, would only fail the claim: skipped for the next, invalidated so that
            # it connects afresh when next taken.
            assert conn.sync_connection is not None  # set until the connection is closed
            if not cls.gone(conn.sync_connection.connection):
                break
            conn.sync_connection.invalidate()
            await close(conn, closing)
        try:
            with cls.errors:
                await conn.begin()
        except BaseException:
            await conn.close()
            raise
        return conn


_Tx = TypeVar("_Tx", bound=SQLTransaction)


@asynccontextmanager
async def open_transaction(
    kind: type[_Tx], engine: AsyncEngine, closing: set[asyncio.Task[Any]]
) -> AsyncIterator[_Tx]:
    """A transaction of ``kind`` on a connection of ``engine``'s pool; closing it (even
    when cancelled) rolls back what was not committed and returns the connection."""
    tx = kind(engine, await kind.begin(engine, closing), closing)
    try:
        yield tx
    finally:
        await close(tx._conn, closing)


async def close(conn: AsyncConnection, closing: set[asyncio.Task[Any]]) -> None:
    """Roll back what was not committed and return ``conn`` to the pool, even when
    cancelled (in a task of its own, which the store's close waits for)."""
    task = asyncio.ensure_future(conn.close())
    closing.add(task)
    task.add_done_callback(closing.discard)
    await asyncio.shield(task)

"""Transactional mode: the handler's writes and the idempotency record commit together.

For a route with ``Policy(transactional=True)`` the middleware asks the store for one
transaction (:class:`~asgi_idempotency.stores.base.TransactionalStore`; on Postgres,
:class:`~asgi_idempotency.stores.sql.postgres.PostgresTransaction`), decides the key
inside it without waiting on any other request (``pg_try_advisory_xact_lock`` on the
scoped key, folded into the claim statement), and hands the handler that transaction
as ``request.state.idempotency`` (``.connection`` and ``.session``). The record is
completed in the same transaction, which commits before the response is sent. A
crash, an exception, a cancelled request or a retryable status rolls back both the
claim and the handler's writes, so a retry runs exactly once.

This module holds what handlers use: the dependencies that hand them the transaction.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from starlette.requests import Request

from asgi_idempotency.stores.sql.postgres import IdempotencyTransaction

__all__ = ["IdempotencyTransaction", "get_connection", "get_session", "get_transaction"]


def get_transaction(request: Request) -> IdempotencyTransaction:
    """The request's transaction (a FastAPI dependency: ``Depends(get_transaction)``).

    Raises:
        RuntimeError: the route is not guarded in transactional mode.
    """
    tx = getattr(request.state, "idempotency", None)
    if not isinstance(tx, IdempotencyTransaction):
        raise RuntimeError(
            "no idempotency transaction: guard this route with Policy(transactional=True) "
            "and send an Idempotency-Key"
        )
    return tx


def get_session(request: Request) -> AsyncSession:
    """The request's ``AsyncSession`` in the idempotency transaction (FastAPI dependency)."""
    return get_transaction(request).session


def get_connection(request: Request) -> AsyncConnection:
    """The request's ``AsyncConnection`` in the idempotency transaction (FastAPI dependency)."""
    return get_transaction(request).connection

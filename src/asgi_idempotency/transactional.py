"""Transactional mode: the handler's writes and the idempotency record commit together.

For a route with ``Policy(transactional=True)`` the middleware opens one Postgres
transaction, decides the key inside it without waiting on any other request
(``pg_try_advisory_xact_lock`` on the scoped key, folded into the claim
statement), and hands the handler that transaction as
``request.state.idempotency`` (``.connection`` and ``.session``). The record is
completed in the same transaction, which commits before the response is sent.
A crash, an exception, a cancelled request or a retryable status rolls back
both the claim and the handler's writes, so a retry runs exactly once.

Round trips for a first request: BEGIN, claim (lock included), the handler's
own statements, complete, COMMIT. Replays, 409s and 422s: BEGIN, claim, ROLLBACK.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from starlette.requests import Request

from .stores.base import Record, RecordStatus, StoredResponse
from .stores.schema import UTCDateTime, decode_headers, encode_headers

__all__ = [
    "DATABASE_ERRORS",
    "IdempotencyTransaction",
    "TransactionalClaim",
    "claim_in_transaction",
    "complete_in_transaction",
    "get_connection",
    "get_session",
    "get_transaction",
]

_TIME = UTCDateTime()
# What a failing database raises through SQLAlchemy and asyncpg (command_timeout included).
DATABASE_ERRORS = (SQLAlchemyError, OSError, TimeoutError)

# The lock CTE is volatile, so Postgres evaluates it exactly once and before the
# insert that reads it. A held lock means another transaction is deciding this
# key right now: answer 409 at once instead of queueing behind its row lock.
_CLAIM = text(
    """
WITH lock AS (
    SELECT pg_try_advisory_xact_lock(hashtextextended(CAST(:key AS text), 0)) AS got
),
ins AS (
    INSERT INTO idempotency_records
        (key, request_hash, status, token, created_at, locked_until, expires_at)
    SELECT :key, :request_hash, 'in_progress', :token, :now, :locked_until, :expires_at
    FROM lock WHERE lock.got
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
)
SELECT (SELECT got FROM lock) AS locked,
       EXISTS (SELECT 1 FROM ins) AS inserted,
       r.request_hash, r.status, r.token, r.created_at, r.locked_until, r.expires_at,
       r.response_status, r.response_headers, r.response_body
FROM (SELECT 1) AS one
LEFT JOIN idempotency_records AS r
       ON r.key = :key AND NOT EXISTS (SELECT 1 FROM ins) AND (SELECT got FROM lock)
"""
).bindparams(
    bindparam("now", type_=_TIME),
    bindparam("locked_until", type_=_TIME),
    bindparam("expires_at", type_=_TIME),
)

# An expired or abandoned row found under the lock is replaced in place.
_REPLACE = text(
    """
UPDATE idempotency_records
SET request_hash = :request_hash, status = 'in_progress', token = :token,
    created_at = :now, locked_until = :locked_until, expires_at = :expires_at,
    response_status = NULL, response_headers = NULL, response_body = NULL
WHERE key = :key
"""
).bindparams(
    bindparam("now", type_=_TIME),
    bindparam("locked_until", type_=_TIME),
    bindparam("expires_at", type_=_TIME),
)

_COMPLETE = text(
    """
UPDATE idempotency_records
SET status = 'completed', expires_at = :expires_at, response_status = :status,
    response_headers = :headers, response_body = :body
WHERE key = :key AND token = :token
"""
).bindparams(bindparam("expires_at", type_=_TIME))


@dataclass(frozen=True, slots=True)
class IdempotencyTransaction:
    """What a transactional handler writes through: one connection, one transaction.

    ``session`` is bound to ``connection``; its ``commit()`` does not end the outer
    transaction (the middleware commits it, with the record, after the handler).
    """

    connection: AsyncConnection
    session: AsyncSession


@dataclass(frozen=True, slots=True)
class TransactionalClaim:
    locked: bool  # False: another transaction holds this key now (409)
    inserted: bool  # True: this request owns the key
    existing: Record | None  # the row in the way, when neither


async def claim_in_transaction(
    conn: AsyncConnection,
    key: str,
    request_hash: str,
    token: str,
    *,
    now: datetime,
    locked_until: datetime,
    expires_at: datetime,
) -> TransactionalClaim:
    values = {
        "key": key,
        "request_hash": request_hash,
        "token": token,
        "now": now,
        "locked_until": locked_until,
        "expires_at": expires_at,
    }
    row = (await conn.execute(_CLAIM, values)).one()
    if not row.locked:
        return TransactionalClaim(False, False, None)
    if row.inserted:
        return TransactionalClaim(True, True, None)
    m = row._mapping
    response = None
    if m["response_status"] is not None:
        response = StoredResponse(
            m["response_status"], decode_headers(m["response_headers"]), bytes(m["response_body"])
        )
    existing = Record(
        key=key,
        request_hash=m["request_hash"],
        status=RecordStatus(m["status"]),
        token=m["token"],
        created_at=_TIME.from_db(m["created_at"]),
        locked_until=_TIME.from_db(m["locked_until"]),
        expires_at=_TIME.from_db(m["expires_at"]),
        response=response,
    )
    expired = existing.expires_at <= now
    # Under the lock nothing else can be deciding this key, so an expired row, or a
    # default-mode claim whose lease ran out for this same request, is ours to take.
    abandoned = (
        existing.status is RecordStatus.IN_PROGRESS
        and existing.locked_until <= now
        and existing.request_hash == request_hash
    )
    if expired or abandoned:
        await conn.execute(_REPLACE, values)
        return TransactionalClaim(True, True, None)
    return TransactionalClaim(True, False, existing)


async def complete_in_transaction(
    conn: AsyncConnection, key: str, token: str, response: StoredResponse, *, expires_at: datetime
) -> None:
    await conn.execute(
        _COMPLETE,
        {
            "key": key,
            "token": token,
            "expires_at": expires_at,
            "status": response.status,
            "headers": encode_headers(response.headers),
            "body": response.body,
        },
    )


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

"""The store's queries off the hot path (inspection, stats, prune), as SQLAlchemy Core.

``now`` is a bound time or the database's clock as an expression (:mod:`.statements`).

They run through Core on an autocommit connection, for every SQL dialect alike; the
one per-dialect difference, how a prune batch finds its victims, is named here for
Postgres and SQLite and in :mod:`.mysql` for MariaDB/MySQL.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Delete, Select, delete, func, literal_column, select
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnClause

from asgi_idempotency.stores.sql.schema import records as _t
from asgi_idempotency.stores.sql.statements import RECORD_COLUMNS

__all__ = [
    "buckets_query",
    "count_expired_query",
    "find_query",
    "get_query",
    "prune_by_ctid",
    "prune_by_key",
    "sightings_query",
]


def get_query(key: str, read_at: Any) -> Select[Any]:
    return select(*RECORD_COLUMNS, read_at).where(_t.c.key == key)


def find_query(prefix: str, limit: int, read_at: Any) -> Select[Any]:
    # Keys are hex digests: a prefix has no LIKE metacharacters to escape.
    return (
        select(_t.c.key, *RECORD_COLUMNS, read_at)
        .where(_t.c.key.startswith(prefix, autoescape=True))
        .order_by(_t.c.key)
        .limit(limit)
    )


def buckets_query(now: Any) -> Select[Any]:
    expired = (_t.c.expires_at <= now).label("expired")
    lease_over = (_t.c.locked_until <= now).label("lease_over")
    return select(
        _t.c.status, expired, lease_over, func.count().label("n"), func.min(_t.c.created_at)
    ).group_by(_t.c.status, expired, lease_over)


def count_expired_query(now: Any) -> Select[Any]:
    return select(func.count()).select_from(_t).where(_t.c.expires_at <= now)


def sightings_query(since: datetime, route: str | None) -> Select[Any]:
    """The audit's candidate rows: since ``since``, one caller's (scope digest) requests
    with one fingerprint seen under more than one key. Both passes read the index on
    (scope_digest, request_hash, created_at) alone; the grouping by window is
    :func:`.duplicates.group_sightings`'."""
    recent = [_t.c.scope_digest.is_not(None), _t.c.created_at >= since]
    if route is not None:
        recent.append(_t.c.route == route)
    repeated = (
        select(_t.c.scope_digest, _t.c.request_hash)
        .where(*recent)
        .group_by(_t.c.scope_digest, _t.c.request_hash)
        .having(func.count() > 1)
        .subquery("repeated")
    )
    return (
        select(_t.c.scope_digest, _t.c.route, _t.c.request_hash, _t.c.key, _t.c.created_at)
        .join(
            repeated,
            (repeated.c.scope_digest == _t.c.scope_digest)
            & (repeated.c.request_hash == _t.c.request_hash),
        )
        .where(*recent)
    )


def _prune_by_key_statement(now: Any, batch_size: int) -> Delete:
    victims = select(_t.c.key).where(_t.c.expires_at <= now).limit(batch_size)
    return delete(_t).where(_t.c.key.in_(victims.scalar_subquery()))


def _prune_by_ctid_statement(now: Any, batch_size: int) -> Delete:
    # The victims by ctid, not by key. The rows are then deleted where they lie (a TID
    # scan) instead of each found again through the primary key, a probe per row into
    # a big index (measured in bench/results/NOTES.md). Rows a
    # concurrent claim is taking over are locked by it: skipped, never waited on. The
    # subquery holds its lock on each victim until the delete, which still checks the
    # expiry, so a row renewed in between is not touched.
    ctid: ColumnClause[Any] = literal_column("ctid")
    victims = (
        select(ctid)
        .where(_t.c.expires_at <= now)
        .limit(batch_size)
        .with_for_update(skip_locked=True)
    )
    return delete(_t).where(ctid == func.any(func.array(victims.scalar_subquery())),
                            _t.c.expires_at <= now)  # fmt: skip


async def prune_by_key(conn: AsyncConnection, *, now: Any, batch_size: int) -> int:
    """One batch of the prune: up to ``batch_size`` rows expired at ``now``, found by index."""
    return int((await conn.execute(_prune_by_key_statement(now, batch_size))).rowcount)


async def prune_by_ctid(conn: AsyncConnection, *, now: Any, batch_size: int) -> int:
    """Postgres's prune batch: victims by ``ctid``, locked ones skipped (see above)."""
    return int((await conn.execute(_prune_by_ctid_statement(now, batch_size))).rowcount)

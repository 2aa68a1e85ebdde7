"""The one definition of ``idempotency_records``; ``create_all`` and alembic both use it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Column,
    DateTime,
    Dialect,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
)
from sqlalchemy.types import TypeDecorator

__all__ = ["UTCDateTime", "metadata", "records"]

metadata = MetaData()


class UTCDateTime(TypeDecorator[datetime]):
    """``timestamptz`` on Postgres; on SQLite a fixed-width naive-UTC string.

    SQLite has no time zone type: storing every value as naive UTC keeps the
    text comparisons in ``expires_at <= :now`` correct, and results come back aware.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: pass an aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value


records = Table(
    "idempotency_records",
    metadata,
    # sha256 hex of (principal, client key): raw keys are never stored.
    Column("key", String(64), primary_key=True),
    Column("request_hash", String(64), nullable=False),
    Column("status", String(16), nullable=False),
    # Fences complete/release/renew to the claim that owns the row.
    Column("token", String(32), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("locked_until", UTCDateTime(), nullable=False),
    Column("expires_at", UTCDateTime(), nullable=False),
    Column("response_status", Integer, nullable=True),
    Column("response_headers", LargeBinary, nullable=True),
    Column("response_body", LargeBinary, nullable=True),
)

# Serves prune (expires_at <= now) without a sequential scan.
Index("ix_idempotency_records_expires_at", records.c.expires_at)

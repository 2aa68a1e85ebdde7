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
from sqlalchemy.dialects import mysql
from sqlalchemy.types import TypeDecorator, TypeEngine

__all__ = ["MYSQL_DIALECTS", "UTCDateTime", "metadata", "records"]

metadata = MetaData()

#: The dialect names of MariaDB and MySQL (``mariadb+asyncmy`` / ``mysql+asyncmy`` URLs).
MYSQL_DIALECTS = ("mysql", "mariadb")


def _ascii(length: int) -> TypeEngine[str]:
    """``VARCHAR(length)``; on MariaDB/MySQL a fixed-width ASCII column compared byte-wise.

    Keys, hashes and tokens are hex: one byte a character instead of utf8mb4's four in
    the primary key, and a binary collation, so that two keys differing only in case
    are never the same row.
    """
    fixed = mysql.CHAR(length, charset="ascii", collation="ascii_bin")
    return String(length).with_variant(fixed, *MYSQL_DIALECTS)


def _blob() -> TypeEngine[bytes]:
    # MySQL's BLOB stops at 64 KiB; LargeBinary elsewhere has no such limit.
    return LargeBinary().with_variant(mysql.LONGBLOB(), *MYSQL_DIALECTS)


class UTCDateTime(TypeDecorator[datetime]):
    """``timestamptz`` on Postgres; on SQLite a fixed-width naive-UTC string; on
    MariaDB/MySQL ``DATETIME(6)`` in UTC.

    SQLite has no time zone type: storing every value as naive UTC keeps the
    text comparisons in ``expires_at <= :now`` correct, and results come back aware.
    MariaDB/MySQL's ``TIMESTAMP`` converts through the session's time zone and ends
    in 2038, so naive UTC in a ``DATETIME`` with microseconds (a lease is compared to
    the microsecond by the take-over's compare-and-swap).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in MYSQL_DIALECTS:
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(self.impl)

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: pass an aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name != "postgresql" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value


records = Table(
    "idempotency_records",
    metadata,
    # sha256 hex of (principal, client key): raw keys are never stored.
    Column("key", _ascii(64), primary_key=True),
    Column("request_hash", _ascii(64), nullable=False),
    Column("status", _ascii(16), nullable=False),
    # Fences complete/release/renew to the claim that owns the row.
    Column("token", _ascii(32), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("locked_until", UTCDateTime(), nullable=False),
    Column("expires_at", UTCDateTime(), nullable=False),
    Column("response_status", Integer, nullable=True),
    Column("response_headers", _blob(), nullable=True),
    Column("response_body", _blob(), nullable=True),
    # For the audit of likely duplicates (stores/duplicates.py), written by every HTTP
    # claim: sha256 hex of the caller's host and principal (never the principal in
    # clear), and the route template. NULL on records of other kinds and on rows
    # written before revision 0003.
    Column("scope_digest", _ascii(64), nullable=True),
    Column("route", String(255), nullable=True),
)

# Serves prune (expires_at <= now) without a sequential scan.
Index("ix_idempotency_records_expires_at", records.c.expires_at)
# Serves the audit: one caller's rows with one fingerprint, in time order.
Index(
    "ix_idempotency_records_scope",
    records.c.scope_digest,
    records.c.request_hash,
    records.c.created_at,
)

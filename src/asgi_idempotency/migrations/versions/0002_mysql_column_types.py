"""MariaDB/MySQL column types: ASCII keys, DATETIME(6) in UTC, LONGBLOB responses.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-04

On MariaDB/MySQL, 0001's generic types become utf8mb4 ``VARCHAR`` keys, ``DATETIME``
without fractions (a lease compared to the microsecond by the take-over's
compare-and-swap would never match) and ``BLOB`` bodies cut at 64 KiB. This revision
gives those columns the types ``stores/schema.py`` declares for these dialects. On
Postgres and SQLite it changes nothing. Like 0001, a frozen snapshot: never edit it.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_TABLE = "idempotency_records"


def _ascii(length: int) -> mysql.CHAR:
    return mysql.CHAR(length, charset="ascii", collation="ascii_bin")


# (column, 0001's type, this revision's type, nullable)
_COLUMNS: list[tuple[str, sa.types.TypeEngine[Any], sa.types.TypeEngine[Any], bool]] = [
    ("key", sa.String(64), _ascii(64), False),
    ("request_hash", sa.String(64), _ascii(64), False),
    ("status", sa.String(16), _ascii(16), False),
    ("token", sa.String(32), _ascii(32), False),
    ("created_at", sa.DateTime(timezone=True), mysql.DATETIME(fsp=6), False),
    ("locked_until", sa.DateTime(timezone=True), mysql.DATETIME(fsp=6), False),
    ("expires_at", sa.DateTime(timezone=True), mysql.DATETIME(fsp=6), False),
    ("response_headers", sa.LargeBinary(), mysql.LONGBLOB(), True),
    ("response_body", sa.LargeBinary(), mysql.LONGBLOB(), True),
]


def _on_mysql() -> bool:
    return op.get_context().dialect.name in ("mysql", "mariadb")


def upgrade() -> None:
    if not _on_mysql():
        return
    for name, old, new, nullable in _COLUMNS:
        op.alter_column(_TABLE, name, type_=new, existing_type=old, existing_nullable=nullable)


def downgrade() -> None:
    if not _on_mysql():
        return
    for name, old, new, nullable in _COLUMNS:
        op.alter_column(_TABLE, name, type_=old, existing_type=new, existing_nullable=nullable)

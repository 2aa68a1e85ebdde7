"""The audit's columns: scope_digest and route, and the index that serves the audit.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05

Nullable, so adding them rewrites no row and rows written before stay valid (the audit
skips them). Like 0001 and 0002, a frozen snapshot: never edit it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_TABLE = "idempotency_records"
_INDEX = "ix_idempotency_records_scope"


def upgrade() -> None:
    ascii_64 = sa.String(64).with_variant(
        mysql.CHAR(64, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )
    with op.batch_alter_table(_TABLE) as batch:
        batch.add_column(sa.Column("scope_digest", ascii_64, nullable=True))
        batch.add_column(sa.Column("route", sa.String(255), nullable=True))
    op.create_index(_INDEX, _TABLE, ["scope_digest", "request_hash", "created_at"], unique=False)


def downgrade() -> None:
    op.drop_index(_INDEX, table_name=_TABLE)
    with op.batch_alter_table(_TABLE) as batch:
        batch.drop_column("route")
        batch.drop_column("scope_digest")

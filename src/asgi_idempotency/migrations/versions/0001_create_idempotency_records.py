"""Create idempotency_records and its expiry index.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from asgi_idempotency.stores.schema import records

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Built from the one Table definition, so the migration cannot drift from it.
    records.to_metadata(sa.MetaData()).create(op.get_bind())


def downgrade() -> None:
    op.drop_index("ix_idempotency_records_expires_at", table_name="idempotency_records")
    op.drop_table("idempotency_records")

"""Alembic environment: async engines, our own version table, batch mode on SQLite.

The database, first found wins, each through the one URL rule (:mod:`asgi_idempotency.stores.urls`):

1. ``asgi_idempotency.migrations.upgrade(url)`` / ``downgrade(url)`` (``config.attributes``);
2. ``alembic -x url=URL ...``;
3. ``$IDEMPOTENCY_DATABASE_URL``;
4. ``sqlalchemy.url`` in the ini file (the shipped ``migrations/alembic.ini`` sets none).
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from alembic.util import CommandError
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from asgi_idempotency.migrations import VERSION_TABLE
from asgi_idempotency.stores.sql.schema import metadata
from asgi_idempotency.stores.urls import ENV_URL, async_url

config = context.config


def _url() -> str:
    url = (
        config.attributes.get("url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get(ENV_URL)
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise CommandError(
            f"no database URL: pass `-x url=URL`, set {ENV_URL}, or set sqlalchemy.url in "
            f"{config.config_file_name or 'the alembic config'}"
        )
    try:
        return async_url(url)
    except ValueError as exc:
        # CommandError: alembic prints "FAILED: ..." and exits 1, without a traceback.
        raise CommandError(str(exc)) from None


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        compare_type=True,
        **kwargs,  # type: ignore[arg-type]  # object: the callers pass configure()'s own options
    )


def run_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


async def run_online() -> None:
    engine = create_async_engine(_url(), poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    asyncio.run(run_online())

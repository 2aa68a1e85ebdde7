"""Alembic migrations for ``idempotency_records``, shipped in the wheel and run from code.

They keep their own version table (``idempotency_alembic_version``) so they live
beside an application's own alembic history without touching it.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

__all__ = ["VERSION_TABLE", "alembic_config", "downgrade", "upgrade"]

VERSION_TABLE = "idempotency_alembic_version"
SCRIPT_LOCATION = str(Path(__file__).parent)


def alembic_config(url: str) -> Config:
    """An alembic ``Config`` for the database at ``url``.

    Any spelling :func:`asgi_idempotency.urls.async_url` accepts (``postgres://``,
    ``sqlite:///path.db``, ...). The URL travels in ``Config.attributes``, which
    ``env.py`` reads before ``-x url=``, ``$IDEMPOTENCY_DATABASE_URL`` and the ini, so
    code that names a database migrates that one whatever the environment says.
    """
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.attributes["url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision``. Blocks; run it outside an event loop."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at ``url`` down to ``revision``."""
    command.downgrade(alembic_config(url), revision)

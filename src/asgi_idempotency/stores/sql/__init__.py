"""The SQL store: one store over Postgres, MariaDB/MySQL and SQLite dialects."""

from asgi_idempotency.stores.sql.store import SQLStore

__all__ = ["SQLStore"]

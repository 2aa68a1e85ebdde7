"""``asgi-idempotency migrate``: upgrade the schema to the latest revision."""

from __future__ import annotations

from typing import TextIO

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.ops.commands._common import (
    CLIError,
    Exit,
    command,
    database_error,
    nothing_to,
    output,
    require_url,
    store_errors,
)
from asgi_idempotency.stores.registry import kind_of
from asgi_idempotency.stores.urls import redact

__all__ = ["migrate"]


@command("migrate")
def migrate(database_url: str | None = None, *, out: TextIO | None = None) -> int:
    """Upgrade the records table of ``database_url`` (default ``$IDEMPOTENCY_DATABASE_URL``)
    to the latest revision; on a store without a schema (Redis), say so and succeed."""
    out = output(out)
    url = require_url(database_url, existing=False)
    kind = kind_of(url)
    if not kind.capabilities.migrations:
        # Success, like prune on Redis: a deploy step that runs migrate on every
        # deploy keeps working when the store moves to Redis.
        print(nothing_to("migrate", "migrations", kind), file=out)
        return Exit.OK
    try:
        from asgi_idempotency.migrations import SchemaConflict, UnknownRevision, upgrade
    except ImportError as exc:
        raise CLIError(Exit.INTERNAL, f"this build carries no migrations: {exc}") from exc
    try:
        with store_errors(url):
            upgrade(url)
    except SchemaConflict as exc:
        raise CLIError(Exit.UNREACHABLE, f"cannot migrate {redact(url)}: {exc}") from exc
    except UnknownRevision as exc:
        # Not a bug, and retrying will not help: the operator runs the wrong version.
        raise CLIError(Exit.USAGE, f"cannot migrate {redact(url)}: {exc}") from None
    except StoreError as exc:
        raise database_error(exc, url) from exc
    print(f"migrated {redact(url)} to the latest revision", file=out)
    return Exit.OK

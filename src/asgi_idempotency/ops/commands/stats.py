"""``asgi-idempotency stats``: row counts by status, expired, oldest in progress."""

from __future__ import annotations

import asyncio
import json
from typing import Any, TextIO

from asgi_idempotency.ops.commands._common import (
    CLIError,
    Exit,
    command,
    fmt_time,
    iso,
    output,
    require_url,
    with_store,
)
from asgi_idempotency.stores.registry import kind_of

__all__ = ["stats"]


@command("stats")
def stats(
    database_url: str | None = None,
    *,
    timeout: float = 10.0,
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """Count the records by status (live, lease ended, expired) and show the oldest live
    one in progress (:func:`.retention.table_stats`); a store that cannot count is a
    usage error."""
    from asgi_idempotency.ops.retention import table_stats
    from asgi_idempotency.stores.base import capabilities

    out = output(out)
    url = require_url(database_url)

    async def body(store: Any) -> Exit:
        if not capabilities(store).stats:
            why = kind_of(url).why_not("stats")
            raise CLIError(Exit.USAGE, f"stats: this store cannot count its records ({why})")
        found = await table_stats(store)
        if as_json:
            payload = {
                "now": iso(found.now),
                "total": found.total,
                "live": dict(found.live),
                "expired": found.expired,
                "abandoned": found.abandoned,
                "oldest_in_progress": iso(found.oldest_in_progress),
            }
            print(json.dumps(payload), file=out)
            return Exit.OK
        print(f"{'records':<30} {found.total:>12,}", file=out)
        for status in ("completed", "in_progress"):
            print(f"  {'live ' + status:<28} {found.live.get(status, 0):>12,}", file=out)
        print(f"  {'in_progress, lease ended':<28} {found.abandoned:>12,}", file=out)
        print(f"  {'expired, awaiting prune':<28} {found.expired:>12,}", file=out)
        oldest = fmt_time(found.oldest_in_progress, found.now)
        print(f"{'oldest live in_progress':<30} {oldest}", file=out)
        return Exit.OK

    return asyncio.run(with_store(url, timeout, body))

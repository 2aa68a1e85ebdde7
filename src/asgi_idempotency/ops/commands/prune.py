"""``asgi-idempotency prune``: delete expired records in batches."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, TextIO

from asgi_idempotency.ops.commands._common import (
    Exit,
    command,
    nothing_to,
    output,
    plural,
    require_url,
    with_store,
)
from asgi_idempotency.stores.registry import kind_of

__all__ = ["prune"]


@command("prune")
def prune(
    database_url: str | None = None,
    *,
    timeout: float = 10.0,
    batch_size: int = 1000,
    dry_run: bool = False,
    pause: float = 0.0,
    max_batches: int = 1_000_000,
    quiet: bool = False,
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """Delete the expired records, ``batch_size`` rows per statement, ``pause`` seconds
    between batches, at most ``max_batches`` batches (:func:`.retention.prune_all`);
    with ``dry_run`` count them only. ``timeout``: seconds per statement. ``quiet``
    prints nothing on success, ``as_json`` one JSON object. Progress goes to a terminal
    on stderr."""
    from asgi_idempotency.ops.retention import count_expired, prune_all

    out = output(out)
    url = require_url(database_url)
    kind = kind_of(url)
    if not kind.capabilities.prune:
        note = nothing_to("prune", "prune", kind)
        if as_json:
            print(json.dumps({"pruned": 0, "dry_run": dry_run, "note": note}), file=out)
        elif not quiet:
            print(note, file=out)
        return Exit.OK
    err: TextIO = sys.stderr
    show_progress = not as_json and not quiet and err.isatty()

    async def body(store: Any) -> Exit:
        now = None  # the store's own time decides what has expired
        started = time.perf_counter()
        expected = await count_expired(store, now=now) if (dry_run or show_progress) else 0
        if dry_run:
            pruned = expected
        else:

            def progress(done: int, _batch: int) -> None:
                share = f" ({100 * done / expected:.0f}%)" if expected else ""
                of = plural(expected, "expired record")
                err.write(f"\rpruned {done:,} of {of}{share}")
                err.flush()

            pruned = await prune_all(
                store,
                batch_size=batch_size,
                now=now,
                pause=pause,
                max_batches=max_batches,
                progress=progress if show_progress else None,
            )
            if show_progress:
                err.write("\n")
        elapsed = time.perf_counter() - started
        records = plural(pruned, "expired record")
        if as_json:
            payload = {"pruned": pruned, "dry_run": dry_run, "elapsed_s": round(elapsed, 3)}
            print(json.dumps(payload), file=out)
        elif dry_run:
            print(f"{records} would be pruned (dry run: nothing deleted)", file=out)
        elif not quiet:
            print(f"pruned {records} in {elapsed:.1f}s", file=out)
        return Exit.OK

    return asyncio.run(with_store(url, timeout, body))

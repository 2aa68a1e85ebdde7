"""``asgi-idempotency demo``: the refund incident with and without the guard, on throwaway
databases (:mod:`asgi_idempotency.ops.demo`)."""

from __future__ import annotations

import importlib
from typing import TextIO

from asgi_idempotency.ops.commands._common import (
    CLIError,
    Exit,
    command,
    output,
    plural,
    require_url,
    run_on_database,
)
from asgi_idempotency.stores.registry import kind_of

__all__ = ["demo"]


def _require_demo_extra() -> None:
    """Both demos serve with uvicorn and call with httpx: the ``demo`` extra."""
    for name in ("uvicorn", "httpx"):
        try:
            importlib.import_module(name)
        except ImportError:
            raise CLIError(
                Exit.USAGE,
                f"the demo needs {name}, which is not installed: "
                "pip install 'asgi-idempotency[demo]'",
            ) from None


@command("demo")
def demo(
    database_url: str | None = None,
    *,
    kill_after_write: bool = False,
    out: TextIO | None = None,
) -> int:
    """Replay the refund incident with and without the guard: 0 when the guarded run made
    1 refund and the unguarded 2, else 1. With ``kill_after_write`` (Postgres): a worker
    SIGKILLed after writing a refund, in the default and the transactional mode; 0 when
    they end with 2 and 1 refunds. On Postgres both run on scratch databases created on
    the server ``database_url`` names and dropped afterwards; without one, or on SQLite,
    on throwaway SQLite files."""
    out = output(out)
    _require_demo_extra()
    if kill_after_write:
        return _kill_demo(require_url(database_url, existing=False), out)
    # Without --database-url the incident demo brings its own throwaway SQLite files
    # (the environment's URL is the operator's store, not asked for here); with a
    # Postgres one it runs on scratch databases on that server, dropped afterwards.
    from asgi_idempotency.ops.demo import run_demo

    url = None
    if database_url:
        url = require_url(database_url, existing=False)
        kind = kind_of(url)
        if not kind.capabilities.migrations:
            # It writes its refunds in a table of its own beside the records.
            raise CLIError(Exit.USAGE, f"the demo runs on Postgres or SQLite, not {kind.name}")
    code = run_on_database(url, lambda: run_demo(url))
    return Exit(code) if code in (Exit.OK, Exit.NOT_FOUND) else Exit.INTERNAL


def _kill_demo(url: str, out: TextIO) -> Exit:
    from asgi_idempotency.ops.demo import kill_after_write, scratch_database

    if not url.startswith("postgresql"):
        raise CLIError(Exit.USAGE, "--kill-after-write needs a Postgres --database-url")

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    async def both() -> tuple[tuple[int, int], tuple[int, int]]:
        # Its refunds and records go to a database of its own, not the user's.
        async with scratch_database(url, say=say) as scratch:
            default = await kill_after_write(scratch, transactional=False, say=say)
            say("")
            return default, await kill_after_write(scratch, transactional=True, say=say)

    default, transactional = run_on_database(url, both)
    say(
        f"\nDefault mode: {plural(default[1], 'refund')} (the crash left one, the retry made "
        f"another). Transactional mode: {plural(transactional[1], 'refund')}."
    )
    return Exit.OK if (default, transactional) == ((1, 2), (0, 1)) else Exit.NOT_FOUND

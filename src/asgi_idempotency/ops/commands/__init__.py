"""The commands of ``asgi-idempotency``, one module each, each a plain function with typed
parameters that returns its exit code (:class:`Exit`), callable without the parser::

    from asgi_idempotency.ops.commands import prune

    code = prune("postgresql://db/app", dry_run=True)

A command prints to ``out`` (default: standard output) and says what went wrong on
stderr, one line starting ``asgi-idempotency NAME:``, before returning a non-zero code.
:mod:`asgi_idempotency.ops.cli` builds the argument parser over them.
"""

from __future__ import annotations

from asgi_idempotency.ops.commands._common import EXIT_MEANINGS, Exit
from asgi_idempotency.ops.commands.audit import audit
from asgi_idempotency.ops.commands.check import check
from asgi_idempotency.ops.commands.demo import demo
from asgi_idempotency.ops.commands.inspect import inspect
from asgi_idempotency.ops.commands.migrate import migrate
from asgi_idempotency.ops.commands.prune import prune
from asgi_idempotency.ops.commands.scope_digest import scope_digest
from asgi_idempotency.ops.commands.stats import stats

__all__ = [
    "EXIT_MEANINGS",
    "Exit",
    "audit",
    "check",
    "demo",
    "inspect",
    "migrate",
    "prune",
    "scope_digest",
    "stats",
]

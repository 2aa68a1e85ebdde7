"""The caller's half of asgi-idempotency: keys, retries, an httpx transport, a ledger.

::

    key = derive_key(run_id, step, "refund", args)          # same call -> same key
    transport = AsyncIdempotentTransport()                  # retries under that key
    async with httpx.AsyncClient(transport=transport, timeout=10) as http:
        response = await http.post(url, json=args, headers={"Idempotency-Key": key})

Only :func:`derive_key` and :func:`canonical_json` are imported eagerly (orjson alone);
the other names load httpx, stamina or sqlalchemy on first use, and without the
``client`` extra raise :class:`ImportError` naming it. Errors and usage: docs/client.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

from asgi_idempotency.client.keys import KEY_VERSION, derive_key
from asgi_idempotency.core.canonical import CanonicalJSONError, canonical_json

if TYPE_CHECKING:
    from asgi_idempotency.client.ledger import (
        LedgerConflict,
        LedgerEntry,
        LedgerError,
        LedgerStatus,
        OutboundCall,
        OutboundLedger,
        OutcomeUnknown,
        ReadBack,
        ledger_metadata,
        ledger_table,
    )
    from asgi_idempotency.client.retry import (
        AttemptRecord,
        Decision,
        RetriesExhausted,
        RetryPolicy,
        retryable,
    )
    from asgi_idempotency.client.transport import (
        IDEMPOTENCY_KEY_HEADER,
        AsyncIdempotentTransport,
        IdempotentTransport,
        KeyFunction,
        random_key,
    )

__all__ = [
    "AsyncIdempotentTransport",
    "AttemptRecord",
    "CanonicalJSONError",
    "Decision",
    "IDEMPOTENCY_KEY_HEADER",
    "IdempotentTransport",
    "KEY_VERSION",
    "KeyFunction",
    "LedgerConflict",
    "LedgerEntry",
    "LedgerError",
    "LedgerStatus",
    "OutboundCall",
    "OutboundLedger",
    "OutcomeUnknown",
    "ReadBack",
    "RetriesExhausted",
    "RetryPolicy",
    "canonical_json",
    "derive_key",
    "ledger_metadata",
    "ledger_table",
    "random_key",
    "retryable",
]

# Public name -> submodule that defines it, for the names loaded on first access.
_LAZY: Final = {
    **dict.fromkeys(
        ["AttemptRecord", "Decision", "RetriesExhausted", "RetryPolicy", "retryable"], "retry"
    ),
    **dict.fromkeys(
        [
            "IDEMPOTENCY_KEY_HEADER",
            "AsyncIdempotentTransport",
            "IdempotentTransport",
            "KeyFunction",
            "random_key",
        ],
        "transport",
    ),
    **dict.fromkeys(
        [
            "LedgerConflict",
            "LedgerEntry",
            "LedgerError",
            "LedgerStatus",
            "OutboundCall",
            "OutboundLedger",
            "OutcomeUnknown",
            "ReadBack",
            "ledger_metadata",
            "ledger_table",
        ],
        "ledger",
    ),
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # cache: the next access skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

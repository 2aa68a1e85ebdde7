"""Server-side ``Idempotency-Key`` enforcement for Starlette and FastAPI, and the caller's half.

Server names are imported lazily so that ``asgi_idempotency.client`` works in
processes without Starlette or SQLAlchemy installed.

``__all__`` holds only names that a plain install can import, so
``from asgi_idempotency import *`` works without any extra. Names that need an
extra (``PrometheusMetrics``, the ``prometheus`` extra) are still attributes of the
package; their first use raises :class:`ImportError` naming the extra when it is
not installed.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asgi_idempotency.core.canonical import CanonicalJSONError, canonical_json
    from asgi_idempotency.core.errors import (
        AppNotStarted,
        AttemptsUnknown,
        BodyTooLarge,
        GuardMisconfigured,
        IdempotencyError,
        InProgress,
        InvalidHost,
        InvalidKey,
        InvalidSignature,
        KeyMismatch,
        KeyReused,
        MiddlewareMisplaced,
        MissingKey,
        MissingMessageId,
        OnceError,
        PrincipalMisconfigured,
        PrincipalMissing,
        RequestInProgress,
        ResponseNotKept,
        SchemaMissing,
        StoreError,
        StoreUnavailable,
        Undecodable,
    )
    from asgi_idempotency.core.lifecycle import Claim, ClaimOutcome, RecordState
    from asgi_idempotency.functions.once import Once
    from asgi_idempotency.http.middleware import IdempotencyMiddleware
    from asgi_idempotency.http.policy import Policy, idempotent
    from asgi_idempotency.observability.metrics import (
        FanOutMetrics,
        InMemoryMetrics,
        MetricsSnapshot,
        Outcome,
    )
    from asgi_idempotency.observability.prometheus import (
        PrometheusMetrics as PrometheusMetrics,  # not in __all__
    )
    from asgi_idempotency.ops.retention import Pruner, PruningMiddleware, prune_all
    from asgi_idempotency.stores.base import (
        BUSY,
        AuditableStore,
        Bucket,
        Capabilities,
        NewClaim,
        PreparedStore,
        Record,
        RecordStatus,
        Store,
        StoredResponse,
        StoreTransaction,
        TransactionalStore,
    )
    from asgi_idempotency.stores.duplicates import SuspectedDuplicate
    from asgi_idempotency.stores.memory import MemoryStore
    from asgi_idempotency.stores.redis import (
        RedisStore as RedisStore,  # not in __all__: the redis extra
    )
    from asgi_idempotency.stores.sql.store import SQLStore

__all__ = [
    "AppNotStarted",
    "AttemptsUnknown",
    "AuditableStore",
    "BUSY",
    "BodyTooLarge",
    "Bucket",
    "CanonicalJSONError",
    "Capabilities",
    "Claim",
    "ClaimOutcome",
    "FanOutMetrics",
    "GuardMisconfigured",
    "IdempotencyError",
    "IdempotencyMiddleware",
    "InMemoryMetrics",
    "InProgress",
    "InvalidHost",
    "InvalidKey",
    "InvalidSignature",
    "KeyMismatch",
    "KeyReused",
    "MemoryStore",
    "MetricsSnapshot",
    "MiddlewareMisplaced",
    "MissingKey",
    "MissingMessageId",
    "NewClaim",
    "Once",
    "OnceError",
    "Outcome",
    "Policy",
    "PreparedStore",
    "PrincipalMisconfigured",
    "PrincipalMissing",
    # Not "PrometheusMetrics": it needs the prometheus extra, and star import must
    # work without it. It stays reachable as an attribute, through _WHERE.
    "Pruner",
    "PruningMiddleware",
    "Record",
    "RecordState",
    "RecordStatus",
    "RequestInProgress",
    "ResponseNotKept",
    "SQLStore",
    "SchemaMissing",
    "Store",
    "StoreError",
    "StoreTransaction",
    "StoreUnavailable",
    "StoredResponse",
    "SuspectedDuplicate",
    "TransactionalStore",
    "Undecodable",
    "__version__",
    "canonical_json",
    "idempotent",
    "prune_all",
]

_WHERE = {
    "CanonicalJSONError": "asgi_idempotency.core.canonical",
    "canonical_json": "asgi_idempotency.core.canonical",
    "FanOutMetrics": "asgi_idempotency.observability.metrics",
    "InMemoryMetrics": "asgi_idempotency.observability.metrics",
    "MetricsSnapshot": "asgi_idempotency.observability.metrics",
    "Outcome": "asgi_idempotency.observability.metrics",
    "IdempotencyMiddleware": "asgi_idempotency.http.middleware",
    "Once": "asgi_idempotency.functions.once",
    "Policy": "asgi_idempotency.http.policy",
    "idempotent": "asgi_idempotency.http.policy",
    "PrometheusMetrics": "asgi_idempotency.observability.prometheus",
    "Pruner": "asgi_idempotency.ops.retention",
    "PruningMiddleware": "asgi_idempotency.ops.retention",
    "prune_all": "asgi_idempotency.ops.retention",
    "BodyTooLarge": "asgi_idempotency.core.errors",
    "IdempotencyError": "asgi_idempotency.core.errors",
    "InvalidHost": "asgi_idempotency.core.errors",
    "InvalidKey": "asgi_idempotency.core.errors",
    "InvalidSignature": "asgi_idempotency.core.errors",
    "KeyMismatch": "asgi_idempotency.core.errors",
    "InProgress": "asgi_idempotency.core.errors",
    "KeyReused": "asgi_idempotency.core.errors",
    "OnceError": "asgi_idempotency.core.errors",
    "MissingMessageId": "asgi_idempotency.core.errors",
    "AttemptsUnknown": "asgi_idempotency.core.errors",
    "Undecodable": "asgi_idempotency.core.errors",
    "MissingKey": "asgi_idempotency.core.errors",
    "RequestInProgress": "asgi_idempotency.core.errors",
    "PrincipalMisconfigured": "asgi_idempotency.core.errors",
    "GuardMisconfigured": "asgi_idempotency.core.errors",
    "MiddlewareMisplaced": "asgi_idempotency.core.errors",
    "AppNotStarted": "asgi_idempotency.core.errors",
    "PrincipalMissing": "asgi_idempotency.core.errors",
    "ResponseNotKept": "asgi_idempotency.core.errors",
    "SchemaMissing": "asgi_idempotency.core.errors",
    "StoreError": "asgi_idempotency.core.errors",
    "StoreUnavailable": "asgi_idempotency.core.errors",
    "Claim": "asgi_idempotency.core.lifecycle",
    "ClaimOutcome": "asgi_idempotency.core.lifecycle",
    "RecordState": "asgi_idempotency.core.lifecycle",
    "BUSY": "asgi_idempotency.stores.base",
    "AuditableStore": "asgi_idempotency.stores.base",
    "SuspectedDuplicate": "asgi_idempotency.stores.duplicates",
    "Bucket": "asgi_idempotency.stores.base",
    "Capabilities": "asgi_idempotency.stores.base",
    "NewClaim": "asgi_idempotency.stores.base",
    "PreparedStore": "asgi_idempotency.stores.base",
    "StoreTransaction": "asgi_idempotency.stores.base",
    "Record": "asgi_idempotency.stores.base",
    "RecordStatus": "asgi_idempotency.stores.base",
    "Store": "asgi_idempotency.stores.base",
    "StoredResponse": "asgi_idempotency.stores.base",
    "TransactionalStore": "asgi_idempotency.stores.base",
    "MemoryStore": "asgi_idempotency.stores.memory",
    "SQLStore": "asgi_idempotency.stores.sql.store",
    "RedisStore": "asgi_idempotency.stores.redis",  # the redis extra: reachable, not star-exported
}

# A library leaves log output to the application (the logging HOWTO, "Configuring
# Logging for a Library"). The one exception: a middleware, once started, shows
# WARNING and up in the server's log while the app configures no handler at all
# (observer.route_to_server_log), since uvicorn configures only its own loggers.
logging.getLogger(__name__).addHandler(logging.NullHandler())

try:
    __version__ = version("asgi-idempotency")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'asgi_idempotency' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *_WHERE})

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
    from .canonical import CanonicalJSONError, canonical_json
    from .errors import (
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
    )
    from .lifecycle import Claim, ClaimOutcome, RecordState
    from .metrics import FanOutMetrics, InMemoryMetrics, MetricsSnapshot, Outcome
    from .middleware import IdempotencyMiddleware
    from .once import Once
    from .policy import Policy, idempotent
    from .prometheus import PrometheusMetrics as PrometheusMetrics  # not in __all__
    from .retention import Pruner, PruningMiddleware, prune_all
    from .stores.base import (
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
    from .stores.duplicates import SuspectedDuplicate
    from .stores.memory import MemoryStore
    from .stores.redis import RedisStore as RedisStore  # not in __all__: the redis extra
    from .stores.sql import SQLStore

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
    "__version__",
    "canonical_json",
    "idempotent",
    "prune_all",
]

_WHERE = {
    "CanonicalJSONError": ".canonical",
    "canonical_json": ".canonical",
    "FanOutMetrics": ".metrics",
    "InMemoryMetrics": ".metrics",
    "MetricsSnapshot": ".metrics",
    "Outcome": ".metrics",
    "IdempotencyMiddleware": ".middleware",
    "Once": ".once",
    "Policy": ".policy",
    "idempotent": ".policy",
    "PrometheusMetrics": ".prometheus",
    "Pruner": ".retention",
    "PruningMiddleware": ".retention",
    "prune_all": ".retention",
    "BodyTooLarge": ".errors",
    "IdempotencyError": ".errors",
    "InvalidHost": ".errors",
    "InvalidKey": ".errors",
    "InvalidSignature": ".errors",
    "KeyMismatch": ".errors",
    "InProgress": ".errors",
    "KeyReused": ".errors",
    "OnceError": ".errors",
    "MissingMessageId": ".errors",
    "AttemptsUnknown": ".errors",
    "MissingKey": ".errors",
    "RequestInProgress": ".errors",
    "PrincipalMisconfigured": ".errors",
    "GuardMisconfigured": ".errors",
    "MiddlewareMisplaced": ".errors",
    "AppNotStarted": ".errors",
    "PrincipalMissing": ".errors",
    "ResponseNotKept": ".errors",
    "SchemaMissing": ".errors",
    "StoreError": ".errors",
    "StoreUnavailable": ".errors",
    "Claim": ".lifecycle",
    "ClaimOutcome": ".lifecycle",
    "RecordState": ".lifecycle",
    "BUSY": ".stores.base",
    "AuditableStore": ".stores.base",
    "SuspectedDuplicate": ".stores.duplicates",
    "Bucket": ".stores.base",
    "Capabilities": ".stores.base",
    "NewClaim": ".stores.base",
    "PreparedStore": ".stores.base",
    "StoreTransaction": ".stores.base",
    "Record": ".stores.base",
    "RecordStatus": ".stores.base",
    "Store": ".stores.base",
    "StoredResponse": ".stores.base",
    "TransactionalStore": ".stores.base",
    "MemoryStore": ".stores.memory",
    "SQLStore": ".stores.sql",
    "RedisStore": ".stores.redis",  # the redis extra: reachable, not star-exported
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

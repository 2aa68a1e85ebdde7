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
    from .metrics import FanOutMetrics, InMemoryMetrics, MetricsSnapshot, Outcome
    from .middleware import IdempotencyMiddleware
    from .policy import Policy, idempotent
    from .problems import (
        BodyTooLarge,
        IdempotencyError,
        InvalidKey,
        KeyMismatch,
        MissingKey,
        RequestInProgress,
        StoreUnavailable,
    )
    from .prometheus import PrometheusMetrics as PrometheusMetrics  # not in __all__
    from .retention import Pruner, PruningMiddleware, prune_all
    from .stores.base import (
        Claim,
        ClaimOutcome,
        Record,
        RecordStatus,
        Store,
        StoredResponse,
        StoreError,
    )
    from .stores.memory import MemoryStore
    from .stores.sql import SQLStore

__all__ = [
    "BodyTooLarge",
    "CanonicalJSONError",
    "Claim",
    "ClaimOutcome",
    "FanOutMetrics",
    "IdempotencyError",
    "IdempotencyMiddleware",
    "InMemoryMetrics",
    "InvalidKey",
    "KeyMismatch",
    "MemoryStore",
    "MetricsSnapshot",
    "MissingKey",
    "Outcome",
    "Policy",
    # Not "PrometheusMetrics": it needs the prometheus extra, and star import must
    # work without it. It stays reachable as an attribute, through _WHERE.
    "Pruner",
    "PruningMiddleware",
    "Record",
    "RecordStatus",
    "RequestInProgress",
    "SQLStore",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "StoredResponse",
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
    "Policy": ".policy",
    "idempotent": ".policy",
    "PrometheusMetrics": ".prometheus",
    "Pruner": ".retention",
    "PruningMiddleware": ".retention",
    "prune_all": ".retention",
    "BodyTooLarge": ".problems",
    "IdempotencyError": ".problems",
    "InvalidKey": ".problems",
    "KeyMismatch": ".problems",
    "MissingKey": ".problems",
    "RequestInProgress": ".problems",
    "StoreUnavailable": ".problems",
    "Claim": ".stores.base",
    "ClaimOutcome": ".stores.base",
    "Record": ".stores.base",
    "RecordStatus": ".stores.base",
    "Store": ".stores.base",
    "StoreError": ".stores.base",
    "StoredResponse": ".stores.base",
    "MemoryStore": ".stores.memory",
    "SQLStore": ".stores.sql",
}

# A library leaves log output to the application: without a handler of its own, a
# process that configures no logging gets WARNING and up printed by Python's
# last-resort handler. See the logging HOWTO, "Configuring Logging for a Library".
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

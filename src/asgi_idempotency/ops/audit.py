"""The audit: likely duplicates that keys could not catch, from the records every worker wrote.

A client that mints its Idempotency-Key inside its retry loop sends each attempt under
a new key, and each attempt runs (the incident: 340 refunds paid twice, found at
month-end). Every guarded request's claim stores a digest of its caller (host and
principal) and its route template beside its fingerprint, with the middleware's default
settings, so the audit sees every worker and host that shares the store:
:func:`suspected_duplicates` finds one caller's identical requests to one route under
different keys, each within a window of the one before (:mod:`.stores.duplicates`).

The same query feeds ``asgi-idempotency audit``, the gauge
``idempotency_audit_suspected_regenerated_keys{route}`` (:class:`AuditExporter`, or
``asgi-idempotency audit --format prometheus`` for a textfile collector) and the shipped
alert ``IdempotencyRegeneratedKeys``. A suspicion, not a verdict: a caller that means
to do the same thing twice within the window looks the same.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Protocol

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.ops.periodic import PeriodicTask
from asgi_idempotency.stores.base import AuditableStore, capabilities, utcnow
from asgi_idempotency.stores.duplicates import SuspectedDuplicate, extra_keys_by_route

__all__ = [
    "DEFAULT_SINCE",
    "DEFAULT_WINDOW",
    "AuditExporter",
    "AuditSink",
    "SuspectedDuplicate",
    "extra_keys_by_route",
    "parse_duration",
    "suspected_duplicates",
]

logger = logging.getLogger("asgi_idempotency")

#: How far back the audit looks by default, and the default gap between two requests
#: of one run.
DEFAULT_SINCE = timedelta(hours=1)
DEFAULT_WINDOW = timedelta(minutes=10)

_DURATION = re.compile(r"(\d+)(s|m|h|d)")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_duration(text: str) -> timedelta:
    """``30s``, ``10m``, ``1h``, ``2d`` (a whole number and one unit) as a positive timedelta.

    Raises:
        ValueError: anything else, zero included.
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise ValueError(f"a duration such as 30s, 10m, 1h or 2d, more than 0: got {text!r}")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


async def suspected_duplicates(
    store: object,
    *,
    since: timedelta = DEFAULT_SINCE,
    window: timedelta = DEFAULT_WINDOW,
    route: str | None = None,
    now: datetime | None = None,
) -> list[SuspectedDuplicate]:
    """Runs of one caller's identical requests to one route under different keys, claimed
    in the last ``since`` (default 1 hour), each within ``window`` (default 10 minutes)
    of the one before; only ``route``'s (a template, as the logs name it) when given.

    Reads only what the store kept of records not yet expired: look back no further
    than the routes' ``ttl``. Records written before this version have no scope digest
    and are not seen.

    Raises:
        TypeError: the store does not declare the ``audit`` capability.
        ValueError: ``since`` or ``window`` is not positive.
        StoreError: the store failed.
    """
    if since <= timedelta(0) or window <= timedelta(0):
        raise ValueError("since and window must be positive")
    if not capabilities(store).audit or not isinstance(store, AuditableStore):
        raise TypeError(
            f"{type(store).__name__} does not keep what the audit reads (Capabilities.audit)"
        )
    start = (utcnow() if now is None else now) - since
    return await store.suspected_duplicates(since=start, window=window, route=route)


class AuditSink(Protocol):
    """What :class:`AuditExporter` reports to (``PrometheusMetrics`` is one)."""

    def observe_audit(self, found: list[SuspectedDuplicate]) -> None: ...


class AuditExporter(PeriodicTask):
    """Runs the audit every ``interval`` seconds and reports it to ``metrics``.

    With :class:`~asgi_idempotency.observability.prometheus.PrometheusMetrics` it sets the gauge
    ``idempotency_audit_suspected_regenerated_keys{route}``, which the shipped alert
    ``IdempotencyRegeneratedKeys`` reads. One exporter per deployment is enough (every
    worker sees the same records; the alert takes the maximum over instances). Use it
    as an async context manager in the app's lifespan, like :class:`.retention.Pruner`
    (the loop is :class:`~asgi_idempotency.ops.periodic.PeriodicTask`'s).

    Args:
        store: a store that declares ``Capabilities.audit``.
        metrics: where each run's findings go.
        interval: seconds between runs (default 60).
        since: how far back each run looks (default 1 hour).
        window: the longest gap within one run of requests (default 10 minutes).
        clock: returns the current aware UTC time.
    """

    def __init__(
        self,
        store: object,
        metrics: AuditSink,
        *,
        interval: float = 60.0,
        since: timedelta = DEFAULT_SINCE,
        window: timedelta = DEFAULT_WINDOW,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        if not capabilities(store).audit:
            raise TypeError(
                f"{type(store).__name__} does not keep what the audit reads (Capabilities.audit)"
            )
        super().__init__(store)
        self.metrics = metrics
        self.interval, self.since, self.window, self.clock = interval, since, window, clock

    async def run_once(self) -> list[SuspectedDuplicate]:
        found = await suspected_duplicates(
            self.store, since=self.since, window=self.window, now=self.clock()
        )
        self.metrics.observe_audit(found)
        return found

    def failed(self, exc: Exception) -> None:
        logger.warning(
            "idempotency.audit_failed error=%s detail=%s -- the next run retries",
            type(exc).__name__,
            str(exc).replace("\n", " "),
            extra={"event": "idempotency.audit_failed", "error": type(exc).__name__},
            exc_info=not isinstance(exc, StoreError),
        )

    def next_wait(self) -> float:
        return self.interval

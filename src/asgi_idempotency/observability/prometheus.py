"""Prometheus counters of guarded-request outcomes (``asgi-idempotency[prometheus]``).

One counter, ``idempotency_requests_total{route, outcome}``: ``route`` is the route
template (``/orders/{order_id}/refunds``), never a path or a key, so its cardinality
is the number of guarded routes times the ten outcomes. Requests that match no route
(the router answers 404 or 405) pass through and are not counted; an app without a
router (a bare ASGI app) has no templates, so its guarded requests are counted under
``route="<unrouted>"``. Rates are left to PromQL, as Prometheus recommends (the
README's Operations section has the recipes)::

    from asgi_idempotency.observability.prometheus import PrometheusMetrics

    metrics = PrometheusMetrics()  # the process-wide default registry
    app.add_middleware(IdempotencyMiddleware, store=store, metrics=metrics)
    app.add_route("/metrics", metrics.endpoint)

This is the only module that imports ``prometheus_client``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from asgi_idempotency._extras import missing_extra
from asgi_idempotency.observability.metrics import Outcome

try:
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        REGISTRY,
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        generate_latest,
        make_asgi_app,
    )
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise missing_extra(__name__, "prometheus-client", "prometheus") from exc

from asgi_idempotency.stores.duplicates import extra_keys_by_route

if TYPE_CHECKING:
    from asgi_idempotency.stores.duplicates import SuspectedDuplicate

__all__ = ["PrometheusMetrics"]

# The counters this module registered, per registry and prefix. A registry takes a
# name once, so a second PrometheusMetrics on the same registry and prefix (two apps,
# or two middlewares, in one process) reuses the first one's counter and the counts
# add up. Weak keys: a registry that is dropped takes its entries with it, and an
# id() reused by a later registry cannot hand it a counter it does not hold.
_counters: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Counter]] = (
    weakref.WeakKeyDictionary()
)
_counters_lock = threading.Lock()


_named: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Counter]] = (
    weakref.WeakKeyDictionary()
)


def _requests_counter(registry: CollectorRegistry, prefix: str) -> Counter:
    with _counters_lock:
        by_prefix = _counters.setdefault(registry, {})
        counter = by_prefix.get(prefix)
        if counter is None:
            # prometheus_client appends the _total suffix to counters.
            counter = Counter(
                f"{prefix}_requests",
                "Requests on idempotency-guarded routes, by route template and outcome.",
                ("route", "outcome"),
                registry=registry,
            )
            by_prefix[prefix] = counter
        return counter


def _counter(registry: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...]) -> Counter:
    """One counter per registry and name, shared by every instance that asks for it."""
    by_name = _named.setdefault(registry, {})
    counter = by_name.get(name)
    if counter is None:
        counter = Counter(name, doc, labels, registry=registry)
        by_name[name] = counter
    return counter


_histograms: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Histogram]] = (
    weakref.WeakKeyDictionary()
)


def _histogram(
    registry: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...]
) -> Histogram:
    by_name = _histograms.setdefault(registry, {})
    found = by_name.get(name)
    if found is None:
        # Store calls take milliseconds: buckets from 0.5 ms up to the default timeout.
        buckets = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
        found = Histogram(name, doc, labels, registry=registry, buckets=buckets)
        by_name[name] = found
    return found


_gauges: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Gauge]] = (
    weakref.WeakKeyDictionary()
)


def _gauge(registry: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...]) -> Gauge:
    """One gauge per registry and name, shared by every instance that asks for it."""
    with _counters_lock:
        by_name = _gauges.setdefault(registry, {})
        found = by_name.get(name)
        if found is None:
            found = by_name[name] = Gauge(name, doc, labels, registry=registry)
        return found


class PrometheusMetrics:
    """A :class:`~asgi_idempotency.observability.metrics.MetricsSink` counting into a
    Prometheus registry.

    Args:
        registry: where the counter is registered (default: ``prometheus_client.REGISTRY``,
            the one the usual ``/metrics`` endpoints expose). Instances on the same
            registry and prefix share one counter, so several apps or middlewares in
            one process can each create their own and their counts add up.
        prefix: metric name prefix (default ``"idempotency"`` →
            ``idempotency_requests_total``).
        routes: route templates to create every ``(route, outcome)`` series for up
            front, at zero, so that ``rate()`` and alerts see a series before its first
            event. Optional; unlisted routes appear on first use.

    Raises:
        ValueError: something other than a ``PrometheusMetrics`` already registered
            the metric name in ``registry``.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        prefix: str = "idempotency",
        routes: Iterable[str] = (),
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.prefix = prefix
        self.requests = _requests_counter(self.registry, prefix)
        self.regenerated: Counter | None = None
        self._audited: set[tuple[str]] = set()  # routes the audit gauge has a series for
        self.store_seconds = _histogram(
            self.registry,
            f"{prefix}_store_seconds",
            "Time one store operation took, by operation (claim, complete, release, mark) "
            "and store.",
            ("operation", "store"),
        )
        self.takeovers = _counter(
            self.registry,
            f"{prefix}_takeovers",
            "Abandoned claims a retry took over after the holder's lease ran out, by route.",
            ("route",),
        )
        for route in routes:
            for outcome in Outcome:
                self.requests.labels(route=route, outcome=outcome.value)

    def observe(self, route: str, outcome: Outcome) -> None:
        self.requests.labels(route=route, outcome=outcome.value).inc()

    def observe_store(self, operation: str, store: str, seconds: float) -> None:
        """How long one store operation took (claim, complete, release, mark)."""
        self.store_seconds.labels(operation=operation, store=store).observe(seconds)

    def observe_takeover(self, route: str) -> None:
        """A retry took over an abandoned claim."""
        self.takeovers.labels(route=route).inc()

    def observe_regenerated_key(self, route: str) -> None:
        """A request the regenerated-key detector flagged (created on first use)."""
        if self.regenerated is None:
            self.regenerated = _counter(
                self.registry,
                f"{self.prefix}_suspected_regenerated_keys",
                "Requests that repeated a recent request of the same caller under a new "
                "Idempotency-Key: a client minting keys inside its retry loop.",
                ("route",),
            )
        self.regenerated.labels(route=route).inc()

    def observe_audit(self, found: list[SuspectedDuplicate]) -> None:
        """The audit's latest findings (:mod:`asgi_idempotency.ops.audit`): per route, the
        requests that repeated one of the same caller's under another key. Routes found
        before and not now go back to 0, so the alert resolves."""
        gauge = _gauge(
            self.registry,
            f"{self.prefix}_audit_suspected_regenerated_keys",
            "Requests in the audit's lookback that repeated one of the same caller's to the "
            "same route, with the same body, under another Idempotency-Key (within the "
            "window): likely duplicates a key minted inside a retry loop let through.",
            ("route",),
        )
        extra = extra_keys_by_route(found)
        for (route,) in list(self._audited):
            if route not in extra:
                gauge.labels(route=route).set(0)
        for route, count in extra.items():
            gauge.labels(route=route).set(count)
            self._audited.add((route,))

    async def endpoint(self, request: Request) -> Response:
        """A Starlette/FastAPI endpoint serving this registry's exposition text.

        Add it as a route, which answers ``GET /metrics`` itself (200, no redirect)::

            app.add_route("/metrics", metrics.endpoint)

        It serves the Prometheus text format (``CONTENT_TYPE_LATEST``), uncompressed;
        :meth:`asgi_app` also negotiates OpenMetrics and gzip.
        """
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def asgi_app(self) -> ASGIApp:
        """prometheus_client's ASGI app for this registry (OpenMetrics, gzip, ``name[]``).

        It answers any path. Mounted (``app.mount("/metrics", ...)``), it is reached
        only at ``/metrics/``: Starlette and FastAPI answer ``/metrics`` with a 307
        redirect. Prefer :meth:`endpoint` as a route.
        """
        app: ASGIApp = make_asgi_app(self.registry)
        return app

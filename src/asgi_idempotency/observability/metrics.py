"""Outcomes of guarded requests and an in-process counter of them.

Two numbers tell whether the guard works and is needed (see the README's Operations
section):

- the replay rate: replayed / guarded requests. Small and non-zero in a healthy
  service; a spike means clients retry faster than the service answers.
- the conflict rate: 422 mismatches / guarded requests. Should be zero; anything
  else is a client bug (one key reused for different requests) to chase.

Each request the middleware guards is observed once, as ``(route, outcome)``.
``route`` is the route template the app's router matched (``/orders/{order_id}``).
Requests that match no route (the router answers 404 or 405) pass through and are
not observed. An app without a router (a bare ASGI app) has no templates, so its
guarded requests are observed as ``"<unrouted>"``.

"Guarded" means every outcome but :attr:`Outcome.UNGUARDED`. For Prometheus, see
:class:`asgi_idempotency.observability.prometheus.PrometheusMetrics`.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["FanOutMetrics", "InMemoryMetrics", "MetricsSink", "MetricsSnapshot", "Outcome"]


class Outcome(enum.StrEnum):
    """What the guard did with one request on a guarded route."""

    EXECUTED = "executed"  # the handler ran and its response was stored
    REPLAYED = "replayed"  # a stored response was sent; the handler did not run
    IN_PROGRESS = "in_progress"  # 409: the same key is running elsewhere
    MISMATCH = "mismatch"  # 422: the key belongs to a different request
    MISSING_KEY = "missing_key"  # 400
    INVALID_KEY = "invalid_key"  # 400
    INVALID_HOST = "invalid_host"  # 400: Host (or X-Forwarded-Host) sent twice
    INVALID_SIGNATURE = "invalid_signature"  # 400: a webhook delivery its sender did not sign
    TOO_LARGE = "too_large"  # 413
    STORE_UNAVAILABLE = "store_unavailable"  # 503, or run unguarded with fail_open
    RELEASED = "released"  # the handler ran and failed (5xx, 401/408/409/429..., exception)
    UNGUARDED = "unguarded"  # no key on a route where it is optional
    UNIDENTIFIED = "unidentified"  # 401 (no caller) or 500 (the guard cannot tell callers apart)
    REJECTED = "rejected"  # the app refused it before the handler (auth, validation): no record


class MetricsSink(Protocol):
    """Receives one call per guarded request. Must not block or raise."""

    def observe(self, route: str, outcome: Outcome) -> None: ...


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Counts by ``(route template, outcome)`` at one moment; rates are computed from them."""

    counts: dict[tuple[str, Outcome], int]
    # Requests the regenerated-key detector flagged, by route (empty when it is off).
    suspected_regenerated_keys: dict[str, int] = field(default_factory=dict)

    def total(self, outcome: Outcome | None = None, route: str | None = None) -> int:
        return sum(
            n
            for (r, o), n in self.counts.items()
            if (outcome is None or o is outcome) and (route is None or r == route)
        )

    def _guarded(self, route: str | None) -> int:
        return self.total(route=route) - self.total(Outcome.UNGUARDED, route)

    def replay_rate(self, route: str | None = None) -> float:
        """Replays over all guarded requests (0.0 when there were none)."""
        guarded = self._guarded(route)
        return self.total(Outcome.REPLAYED, route) / guarded if guarded else 0.0

    def conflict_rate(self, route: str | None = None) -> float:
        """422 mismatches over all guarded requests: should be zero."""
        guarded = self._guarded(route)
        return self.total(Outcome.MISMATCH, route) / guarded if guarded else 0.0


class InMemoryMetrics:
    """Counts outcomes per route template in process memory; read with :meth:`snapshot`.

    :meth:`observe` runs on every guarded request, so it takes no lock: each thread
    counts into its own dict, which only that thread writes, and :meth:`snapshot`
    adds them up. A thread's counts stay after the thread ends.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._shards: list[dict[tuple[str, Outcome], int]] = []
        self._shards_lock = threading.Lock()  # taken once per thread, and by snapshot
        self._regenerated: Counter[str] = Counter()  # rare, and counted under the lock

    def observe(self, route: str, outcome: Outcome) -> None:
        try:
            shard: dict[tuple[str, Outcome], int] = self._local.counts
        except AttributeError:
            shard = self._new_shard()
        # No lost updates: this thread is the only writer of its shard.
        key = (route, outcome)
        shard[key] = shard.get(key, 0) + 1

    def observe_regenerated_key(self, route: str) -> None:
        """One request the regenerated-key detector flagged on ``route``."""
        with self._shards_lock:
            self._regenerated[route] += 1

    def _new_shard(self) -> dict[tuple[str, Outcome], int]:
        shard: dict[tuple[str, Outcome], int] = {}
        with self._shards_lock:
            self._shards.append(shard)
        self._local.counts = shard
        return shard

    def snapshot(self) -> MetricsSnapshot:
        with self._shards_lock:
            shards = list(self._shards)
            regenerated = dict(self._regenerated)
        totals: Counter[tuple[str, Outcome]] = Counter()
        for shard in shards:
            # dict.copy is one call that another thread's write cannot split: a
            # consistent reading, at most one observation behind.
            totals.update(shard.copy())
        return MetricsSnapshot(dict(totals), regenerated)


class FanOutMetrics:
    """Passes each observation to several sinks, e.g. Prometheus and an in-process snapshot."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def observe(self, route: str, outcome: Outcome) -> None:
        for sink in self.sinks:
            sink.observe(route, outcome)

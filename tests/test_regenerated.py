"""The opt-in detector for keys minted inside a client's retry loop."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore
from asgi_idempotency.client import derive_key
from asgi_idempotency.principals import from_headers
from asgi_idempotency.prometheus import PrometheusMetrics

pytestmark = pytest.mark.anyio


def _app(**guard: Any) -> Starlette:
    async def refund(request: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    return Starlette(
        routes=[Route("/refunds", refund, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                principal=from_headers("X-User-Id"),
                **guard,
            )
        ],
    )


async def _attempts(app: Starlette, keys: list[str], user: str = "u1") -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for key in keys:
            await c.post(
                "/refunds",
                json={"order": "A-88214", "amount_p": 4500},
                headers={"Idempotency-Key": key, "X-User-Id": user},
            )


def _guard(app: Starlette) -> IdempotencyMiddleware:
    return IdempotencyMiddleware.of(app)


async def test_a_key_minted_per_attempt_is_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asgi_idempotency")
    registry = CollectorRegistry()
    app = _app(detect_regenerated_keys=timedelta(seconds=60), metrics=PrometheusMetrics(registry))
    await _attempts(app, [str(uuid.uuid4()) for _ in range(3)])  # the bug: a key per try
    snapshot = _guard(app).snapshot()
    assert snapshot.suspected_regenerated_keys == {"/refunds": 2}
    value = registry.get_sample_value(
        "idempotency_suspected_regenerated_keys_total", {"route": "/refunds"}
    )
    assert value == 2
    flagged = [r for r in caplog.records if "idempotency.regenerated_key" in r.getMessage()]
    assert len(flagged) == 2
    digests = {flagged[0].__dict__["key_digest"], flagged[0].__dict__["other_key_digest"]}
    assert len(digests) == 2
    assert all(len(d) == 16 for d in digests)


async def test_a_key_derived_once_is_not_flagged() -> None:
    app = _app(detect_regenerated_keys=timedelta(seconds=60))
    key = derive_key("run-1", 3, "refund", {"order": "A-88214"})
    await _attempts(app, [key, key, key])  # retries of one attempt: replays
    await _attempts(app, [str(uuid.uuid4())], user="u2")  # another caller's own request
    assert _guard(app).snapshot().suspected_regenerated_keys == {}


async def test_off_by_default() -> None:
    app = _app()
    await _attempts(app, [str(uuid.uuid4()) for _ in range(3)])
    assert _guard(app).snapshot().suspected_regenerated_keys == {}


def test_the_window_is_a_positive_timedelta() -> None:
    from asgi_idempotency.regenerated import RegeneratedKeys

    with pytest.raises(ValueError, match="window"):
        RegeneratedKeys(timedelta(0))


async def test_store_latency_and_takeovers_reach_prometheus() -> None:
    registry = CollectorRegistry()
    app = _app(metrics=PrometheusMetrics(registry))
    await _attempts(app, ["k-1", "k-1"])  # a claim and a completion, then a replay's claim
    labels = {"operation": "claim", "store": "MemoryStore"}
    assert registry.get_sample_value("idempotency_store_seconds_count", labels) == 2
    completes = {"operation": "complete", "store": "MemoryStore"}
    assert registry.get_sample_value("idempotency_store_seconds_count", completes) == 1
    assert registry.get_sample_value("idempotency_takeovers_total", {"route": "/refunds"}) is None

"""An abandoned claim taken over, on real stores: counted (``idempotency_takeovers_total``)
and traced (``idempotency.taken_over``), for the middleware and for the function guard.

A claim is abandoned the way a worker abandons it: its request is cancelled while the
handler runs (the claim stays in progress, unrenewed), and the clock moves past its lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from asgi_idempotency import IdempotencyMiddleware, Once, SQLStore, idempotent
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.observability.prometheus import PrometheusMetrics
from tests.conftest import StoreClock, emptied
from tests.observability.otel_memory import attributes, in_memory_exporter

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    url = request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url")
    async with emptied(SQLStore(url)) as sql:
        yield sql


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return in_memory_exporter()


def _takeovers(registry: CollectorRegistry, route: str) -> float | None:
    return registry.get_sample_value("idempotency_takeovers_total", {"route": route})


async def test_the_middleware_counts_and_traces_a_takeover(
    store: SQLStore, exporter: InMemorySpanExporter
) -> None:
    clock, registry = StoreClock(store), CollectorRegistry()
    entered, runs = asyncio.Event(), []

    app = FastAPI()

    @app.post("/refunds", status_code=201)
    @idempotent(required=True, lease=clock.unit)
    async def refund() -> dict[str, int]:
        runs.append(1)
        if len(runs) == 1:
            entered.set()
            await asyncio.Event().wait()  # the worker hangs, then dies (cancelled)
        return {"refund": len(runs)}

    app.add_middleware(
        IdempotencyMiddleware, store=store, principal=ANONYMOUS, clock=clock,
        metrics=PrometheusMetrics(registry),
    )  # fmt: skip
    transport = httpx.ASGITransport(app=OpenTelemetryMiddleware(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        first = asyncio.ensure_future(c.post("/refunds", headers={"Idempotency-Key": "k"}))
        await entered.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        # Within the lease the claim is still someone's: 409, and nothing counted.
        assert (await c.post("/refunds", headers={"Idempotency-Key": "k"})).status_code == 409
        assert _takeovers(registry, "/refunds") is None
        await clock.past(clock.unit)
        retried = await c.post("/refunds", headers={"Idempotency-Key": "k"})
    assert retried.status_code == 201
    assert len(runs) == 2
    assert _takeovers(registry, "/refunds") == 1
    servers = [
        attributes(s)
        for s in exporter.get_finished_spans()
        if s.kind is trace.SpanKind.SERVER and "idempotency.outcome" in attributes(s)
    ]
    last = servers[-1]
    assert last["idempotency.taken_over"] is True
    assert last["idempotency.outcome"] == "executed"
    assert not any(s.get("idempotency.taken_over") for s in servers[:-1])


async def test_the_function_guard_counts_and_traces_a_takeover(
    store: SQLStore, exporter: InMemorySpanExporter
) -> None:
    clock, registry = StoreClock(store), CollectorRegistry()
    once = Once(
        store, namespace="billing.refund", lease=clock.unit, clock=clock,
        metrics=PrometheusMetrics(registry),
    )  # fmt: skip
    entered, runs = asyncio.Event(), []

    async def refund(order: str) -> int:
        runs.append(order)
        if len(runs) == 1:
            entered.set()
            await asyncio.Event().wait()  # the consumer hangs, then is cancelled
        return len(runs)

    first = asyncio.ensure_future(once.call("r-1", refund, "A-1"))
    await entered.wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await clock.past(clock.unit)
    assert await once.call("r-1", refund, "A-1") == 2
    assert _takeovers(registry, "billing.refund") == 1
    calls: list[dict[str, Any]] = [
        attributes(s) for s in exporter.get_finished_spans() if s.name == "once billing.refund"
    ]
    # The cancelled call's span ends with the cancellation, no outcome; the retry took over.
    assert calls[-1]["idempotency.taken_over"] is True
    assert calls[-1]["idempotency.outcome"] == "executed"
    assert "idempotency.taken_over" not in calls[0]

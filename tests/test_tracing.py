"""OpenTelemetry: a traced FastAPI app's server spans carry the guard's decision, and each
store operation is a child span; nothing when no SDK records."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, idempotent, tracing
from asgi_idempotency.principals import ANONYMOUS

pytestmark = pytest.mark.anyio

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)  # once per process: the API allows no second one
    return _EXPORTER


def _app() -> Any:
    app = FastAPI()

    @app.post("/refunds", status_code=201)
    @idempotent(required=True)
    async def refund() -> dict[str, int]:
        return {"refund": 1}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS)
    return OpenTelemetryMiddleware(app)  # the server span, as an instrumented service has


async def test_server_spans_carry_the_outcome_and_store_calls_are_child_spans(
    exporter: InMemorySpanExporter,
) -> None:
    exporter.clear()
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        await c.post("/refunds", headers={"Idempotency-Key": "k-1"})
        await c.post("/refunds", headers={"Idempotency-Key": "k-1"})
        await c.post("/refunds")
    spans = exporter.get_finished_spans()
    # The request's span as the ASGI instrumentation opens it (FastAPI's own telemetry may
    # open a second server span beside it).
    servers = [
        s
        for s in spans
        if s.kind is trace.SpanKind.SERVER and "idempotency.outcome" in (s.attributes or {})
    ]
    outcomes = [dict(s.attributes or {}).get("idempotency.outcome") for s in servers]
    assert outcomes == ["executed", "replayed", "missing_key"]
    first = dict(servers[0].attributes or {})
    assert first["http.route"] == "/refunds"
    assert len(str(first["idempotency.key_digest"])) == 16
    assert "k-1" not in str(first.values())  # a digest, never the key
    stores = [s for s in spans if s.name.startswith("idempotency ")]
    assert [s.name for s in stores] == [
        "idempotency claim",
        "idempotency complete",
        "idempotency claim",
    ]
    by_id = {s.context.span_id: s for s in servers}
    assert all(s.parent is not None and s.parent.span_id in by_id for s in stores)


def test_nothing_is_built_when_no_span_records() -> None:
    # Outside any recording span: the hooks return the shared no-op context.
    assert tracing.store_span("claim") is tracing.store_span("complete")
    tracing.annotate(outcome="executed")  # no span: nothing to set, nothing raised

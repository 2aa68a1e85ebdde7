"""OpenTelemetry: a traced FastAPI app's server spans carry the guard's decision, and each
store operation is a child span; nothing when no SDK records."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Once, idempotent
from asgi_idempotency.functions.once import KeyReused
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.observability import tracing
from tests.observability.otel_memory import attributes, in_memory_exporter

pytestmark = pytest.mark.anyio


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return in_memory_exporter()  # once per process: the API allows no second provider


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


# --- The function guard: a span of its own per call, store spans under it.


def _once_spans(exporter: InMemorySpanExporter) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith("once ")]


async def test_a_guarded_call_inside_a_handler_has_its_own_span_under_the_server_span(
    exporter: InMemorySpanExporter,
) -> None:
    store = MemoryStore()
    once = Once(store, namespace="billing.charge")
    runs: list[int] = []

    async def charge(order: int) -> dict[str, int]:
        runs.append(order)
        return {"charged": order}

    app = FastAPI()

    @app.post("/orders/{order}/pay", status_code=201)
    @idempotent(required=True)
    async def pay(order: int) -> dict[str, int]:
        return await once.call(f"charge-{order}", charge, order)

    app.add_middleware(IdempotencyMiddleware, store=store, principal=ANONYMOUS)
    transport = httpx.ASGITransport(app=OpenTelemetryMiddleware(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        # Two HTTP keys, one function key: the second request runs, the charge replays.
        assert (await c.post("/orders/7/pay", headers={"Idempotency-Key": "a"})).status_code == 201
        assert (await c.post("/orders/7/pay", headers={"Idempotency-Key": "b"})).status_code == 201
    assert runs == [7]
    spans = exporter.get_finished_spans()
    servers = [
        s
        for s in spans
        if s.kind is trace.SpanKind.SERVER and "idempotency.outcome" in attributes(s)
    ]
    # The middleware's decision stays on the server span: the function's is on its own.
    assert [attributes(s)["idempotency.outcome"] for s in servers] == ["executed", "executed"]
    calls = _once_spans(exporter)
    assert [attributes(s)["idempotency.outcome"] for s in calls] == ["executed", "replayed"]
    assert all(s.kind is trace.SpanKind.INTERNAL for s in calls)
    first = attributes(calls[0])
    assert calls[0].name == "once billing.charge"
    assert first["idempotency.namespace"] == "billing.charge"
    assert str(first["code.function.name"]).endswith("charge")
    assert len(str(first["idempotency.key_digest"])) == 16
    assert "charge-7" not in str(list(first.values()))  # a digest, never the key
    assert "http.route" not in first
    # Within each request's trace (under the endpoint's span, FastAPI's telemetry has one).
    assert [s.context.trace_id for s in calls] == [s.context.trace_id for s in servers]
    assert all(s.parent is not None for s in calls)
    # Its store operations are its children, not the server span's.
    by_call = {s.context.span_id: s for s in calls}
    children = [s for s in spans if s.parent is not None and s.parent.span_id in by_call]
    names = sorted(s.name for s in children)
    assert names == ["idempotency claim", "idempotency claim", "idempotency complete"]


def test_a_sync_call_outside_any_span_is_a_root_span_and_says_what_the_guard_answered(
    exporter: InMemorySpanExporter,
) -> None:
    once = Once(MemoryStore(), namespace="jobs.nightly")

    def nightly(day: str) -> str:
        return day

    try:
        assert once.call_sync("2026-12-04", nightly, "2026-12-04") == "2026-12-04"
        assert once.call_sync("2026-12-04", nightly, "2026-12-04") == "2026-12-04"
        with pytest.raises(KeyReused):
            once.call_sync("2026-12-04", nightly, "2026-12-05")
    finally:
        once.close()
    calls = _once_spans(exporter)
    assert [attributes(s)["idempotency.outcome"] for s in calls] == [
        "executed",
        "replayed",
        "mismatch",
    ]
    assert all(s.parent is None for s in calls)
    # The store calls ran on the guard's own loop thread, and still hang under the call.
    claims = [s for s in exporter.get_finished_spans() if s.name == "idempotency claim"]
    assert len(claims) == 3
    assert [c.parent.span_id for c in claims if c.parent] == [s.context.span_id for s in calls]
    assert calls[2].status.status_code is StatusCode.ERROR  # KeyReused left the span


async def test_a_function_that_raises_is_released_and_traced_as_such(
    exporter: InMemorySpanExporter,
) -> None:
    once = Once(MemoryStore(), namespace="mail.send")

    async def send() -> None:
        raise RuntimeError("smtp down")

    with pytest.raises(RuntimeError):
        await once.call("m-1", send)
    (call,) = _once_spans(exporter)
    assert attributes(call)["idempotency.outcome"] == "released"
    names = [s.name for s in exporter.get_finished_spans() if s.name.startswith("idempotency ")]
    assert names == ["idempotency claim", "idempotency release"]


async def test_no_span_is_opened_without_a_tracer_provider(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in a process whose app configured no SDK: the provider global is unset.
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)

    def no_tracer(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tracer was asked for although nothing can record")

    monkeypatch.setattr(tracing, "_get_tracer", no_tracer)
    assert tracing.function_span("ns", "f") is tracing.store_span("claim")
    once = Once(MemoryStore(), namespace="quiet")

    async def work() -> int:
        return 1

    assert await once.call("q", work) == 1
    assert await once.call("q", work) == 1
    assert exporter.get_finished_spans() == ()

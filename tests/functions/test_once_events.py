"""The function guard tells operators what the middleware tells them, for the same story:
the same outcome counted, the same log events at the same levels, the same outcome on
the call's span and the same store spans under it.

One scenario is played twice, once as HTTP requests through the middleware and once as
``Once`` calls, each step observed in both: executed, replayed, a key reused with other
arguments, a key still running, a failed run released, the store down at the claim, and
the store failing the release of a failed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Once, Outcome, idempotent
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.functions.once import InProgress, KeyReused
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.stores.base import NewClaim, Record
from tests.observability.otel_memory import attributes, in_memory_exporter

pytestmark = pytest.mark.anyio


class _Faulty(MemoryStore):
    """A MemoryStore whose claim or release fails while its flag is set."""

    def __init__(self) -> None:
        super().__init__()
        self.claim_down = False
        self.release_down = False

    async def insert(self, new: NewClaim) -> Record | None:
        if self.claim_down:
            raise StoreError("the database did not answer")
        return await super().insert(new)

    async def release(self, key: str, token: str) -> bool:
        if self.release_down:
            raise StoreError("the database did not answer")
        return await super().release(key, token)


class Pay(BaseModel):
    order: int


class _Sink:
    def __init__(self) -> None:
        self.seen: list[Outcome] = []

    def observe(self, route: str, outcome: Outcome) -> None:
        self.seen.append(outcome)


class Seen(NamedTuple):
    """What one step showed an operator."""

    outcomes: list[str]
    events: list[tuple[str, str, str | None, str | None]]  # event, level, outcome, phase
    span_outcome: str | None
    store_spans: list[str]


class _Effect:
    """The work both guards protect: held at a gate, or failing, on demand."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.fail = False

    async def __call__(self, order: int) -> dict[str, int]:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("downstream failed")
        return {"order": order}


Step = Callable[[str, int], Coroutine[Any, Any, None]]


async def _story(
    store: _Faulty,
    effect: _Effect,
    step: Step,
    sink: _Sink,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    guard_span: Callable[[Any], bool],
) -> list[Seen]:
    """Play the scenario through ``step`` (one call or request); what each step showed."""
    seen: list[Seen] = []

    async def observe(action: Callable[[], Awaitable[None]]) -> None:
        sink.seen.clear()
        exporter.clear()
        caplog.clear()
        await action()
        spans = exporter.get_finished_spans()
        guard = [s for s in spans if guard_span(s)]
        assert len(guard) == 1, [s.name for s in spans]
        parent = guard[0].context.span_id
        children = sorted(
            s.name for s in spans
            if s.parent is not None and s.parent.span_id == parent
            and s.name.startswith("idempotency ")
        )  # fmt: skip
        events = [
            (r.event, r.levelname, getattr(r, "outcome", None), getattr(r, "phase", None))
            for r in caplog.records
            if r.name == "asgi_idempotency" and hasattr(r, "event")
        ]
        outcome = attributes(guard[0]).get("idempotency.outcome")
        seen.append(Seen([o.value for o in sink.seen], events, outcome, children))

    await observe(lambda: step("k-1", 1))  # executed
    await observe(lambda: step("k-1", 1))  # replayed
    await observe(lambda: step("k-1", 2))  # mismatch

    effect.gate = asyncio.Event()
    effect.entered.clear()
    holder = asyncio.create_task(step("k-2", 1))
    await effect.entered.wait()
    await observe(lambda: step("k-2", 1))  # in progress
    effect.gate.set()
    effect.gate = None
    await holder

    effect.fail = True
    await observe(lambda: step("k-3", 1))  # released
    store.release_down = True
    await observe(lambda: step("k-4", 1))  # released; the release itself failed
    store.release_down, effect.fail = False, False

    store.claim_down = True
    await observe(lambda: step("k-5", 1))  # store unavailable at the claim
    store.claim_down = False
    return seen


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return in_memory_exporter()


async def test_once_shows_operators_what_the_middleware_shows_for_the_same_story(
    exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_idempotency")

    # -- HTTP: one route, the effect behind the middleware --------------------------
    http_store, http_effect, http_sink = _Faulty(), _Effect(), _Sink()
    app = FastAPI()

    @app.post("/pay")
    @idempotent(required=True)
    async def pay(body: Pay) -> Any:
        try:
            return await http_effect(body.order)
        except RuntimeError:
            return JSONResponse({"error": "downstream failed"}, status_code=500)

    app.add_middleware(
        IdempotencyMiddleware, store=http_store, principal=ANONYMOUS, metrics=http_sink
    )
    transport = httpx.ASGITransport(app=OpenTelemetryMiddleware(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

        async def request(key: str, order: int) -> None:
            headers = {"Idempotency-Key": key}
            await client.post("/pay", json={"order": order}, headers=headers)

        def server_span(span: Any) -> bool:
            return span.kind is trace.SpanKind.SERVER and "idempotency.outcome" in attributes(span)

        http = await _story(
            http_store, http_effect, request, http_sink, exporter, caplog, server_span
        )

    # -- Once: the same effect as a guarded function ------------------------------
    once_store, once_effect, once_sink = _Faulty(), _Effect(), _Sink()
    once = Once(once_store, namespace="billing.pay", metrics=once_sink)

    async def charge(order: int) -> dict[str, int]:
        return await once_effect(order)

    async def call(key: str, order: int) -> None:
        # The guard's answers are raised to the caller where the middleware sends them;
        # which one each step got is what the comparison below checks.
        with contextlib.suppress(InProgress, KeyReused, RuntimeError, StoreError):
            await once.call(key, charge, order)

    def once_span(span: Any) -> bool:
        return bool(span.name == "once billing.pay")

    functions = await _story(once_store, once_effect, call, once_sink, exporter, caplog, once_span)

    steps = [
        "executed", "replayed", "mismatch", "in_progress", "released",
        "release failed", "store down",
    ]  # fmt: skip
    assert [s.outcomes for s in http] == [
        ["executed"], ["replayed"], ["mismatch"], ["in_progress"], ["released"],
        ["released"], ["store_unavailable"],
    ]  # fmt: skip
    for name, h, f in zip(steps, http, functions, strict=True):
        assert f == h, name
    # The events themselves, so that both stay what docs/operations.md lists.
    assert [s.events for s in http] == [
        [],
        [("idempotency.replay", "INFO", "replayed", None)],
        [("idempotency.mismatch", "INFO", "mismatch", None)],
        [],
        [],
        [("idempotency.store_error", "ERROR", None, "release")],
        [("idempotency.store_error", "ERROR", "store_unavailable", "claim")],
    ]

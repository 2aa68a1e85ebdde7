"""The function guard counts its calls where the middleware counts requests: one outcome
per call in the same sink (the Prometheus counter, its namespace in the route label),
store latency and take-overs; and its own in-process snapshot."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Once, Outcome, idempotent
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.functions.once import InProgress, KeyReused
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.observability.prometheus import PrometheusMetrics
from asgi_idempotency.stores.base import NewClaim

pytestmark = pytest.mark.anyio


def _count(registry: CollectorRegistry, route: str, outcome: str) -> float | None:
    return registry.get_sample_value(
        "idempotency_requests_total", {"route": route, "outcome": outcome}
    )


async def test_calls_and_requests_share_one_counter_told_apart_by_the_route_label() -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    store = MemoryStore()
    once = Once(store, namespace="billing.charge", metrics=metrics)

    async def charge(order: int) -> int:
        return order

    app = FastAPI()

    @app.post("/orders/{order}/pay", status_code=201)
    @idempotent(required=True)
    async def pay(order: int) -> int:
        return await once.call(f"charge-{order}", charge, order)

    app.add_middleware(IdempotencyMiddleware, store=store, principal=ANONYMOUS, metrics=metrics)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        await c.post("/orders/7/pay", headers={"Idempotency-Key": "a"})
        await c.post("/orders/7/pay", headers={"Idempotency-Key": "b"})
    assert _count(registry, "/orders/{order}/pay", "executed") == 2
    assert _count(registry, "billing.charge", "executed") == 1
    assert _count(registry, "billing.charge", "replayed") == 1
    with pytest.raises(KeyReused):
        await once.call("charge-7", charge, 8)
    assert _count(registry, "billing.charge", "mismatch") == 1
    # Store latency per operation, under the same store label as the middleware's.
    claims = {"operation": "claim", "store": "MemoryStore"}
    assert registry.get_sample_value("idempotency_store_seconds_count", claims) == 2 + 3
    snapshot = once.snapshot()
    assert snapshot.counts == {
        ("billing.charge", Outcome.EXECUTED): 1,
        ("billing.charge", Outcome.REPLAYED): 1,
        ("billing.charge", Outcome.MISMATCH): 1,
    }
    assert snapshot.replay_rate() == pytest.approx(1 / 3)


async def test_in_progress_released_and_store_unavailable_are_counted() -> None:
    registry = CollectorRegistry()
    once = Once(MemoryStore(), namespace="jobs.sync", metrics=PrometheusMetrics(registry))
    entered, leave = asyncio.Event(), asyncio.Event()

    async def slow() -> int:
        entered.set()
        await leave.wait()
        return 1

    running = asyncio.create_task(once.call("s", slow))
    await entered.wait()
    with pytest.raises(InProgress):
        await once.call("s", slow)
    leave.set()
    assert await running == 1
    assert _count(registry, "jobs.sync", "in_progress") == 1

    async def broken() -> None:
        raise RuntimeError("downstream failed")

    with pytest.raises(RuntimeError):
        await once.call("b", broken)
    assert _count(registry, "jobs.sync", "released") == 1

    class Down(MemoryStore):
        async def insert(self, new: NewClaim) -> None:
            raise StoreError("the database did not answer")

    down = Once(Down(), namespace="jobs.sync", metrics=PrometheusMetrics(registry))
    with pytest.raises(StoreError):
        await down.call("d", slow)
    assert _count(registry, "jobs.sync", "store_unavailable") == 1


def test_a_namespace_cannot_pass_for_a_route_template() -> None:
    with pytest.raises(ValueError, match="must not start with '/'"):
        Once(MemoryStore(), namespace="/orders")
    once = Once(MemoryStore())
    with pytest.raises(ValueError, match="must not start with '/'"):
        once(key=str, namespace="/orders")

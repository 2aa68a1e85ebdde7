"""Every middleware counts its outcomes in process, with no metrics argument."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Outcome
from tests.apps import guarded

pytestmark = pytest.mark.anyio


async def pay(request: Request) -> JSONResponse:
    return JSONResponse(await request.json(), status_code=201)


async def test_counts_outcomes_by_default_and_reports_rates() -> None:
    app = guarded(MemoryStore(), [Route("/pay", pay, methods=["POST"])])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        key = {"Idempotency-Key": "k-1"}
        assert (await client.post("/pay", json={"a": 1}, headers=key)).status_code == 201
        assert (await client.post("/pay", json={"a": 1}, headers=key)).status_code == 201
        assert (await client.post("/pay", json={"a": 2}, headers=key)).status_code == 422
        assert (await client.post("/pay", json={"a": 3})).status_code == 201  # no key
    guard: Any = app.middleware_stack  # built on the first request
    while not isinstance(guard, IdempotencyMiddleware):
        guard = guard.app
    snapshot = guard.snapshot()
    assert snapshot.counts == {
        ("/pay", Outcome.EXECUTED): 1,
        ("/pay", Outcome.REPLAYED): 1,
        ("/pay", Outcome.MISMATCH): 1,
        ("/pay", Outcome.UNGUARDED): 1,
    }
    assert snapshot.replay_rate() == pytest.approx(1 / 3)
    assert snapshot.conflict_rate() == pytest.approx(1 / 3)

"""Transactional mode with the wiring the README recommends: ``from_dependency`` and a
handler that takes ``session: AsyncSession = Depends(get_session)``.

The claim is made once FastAPI has resolved the auth dependency, in the transaction the
handler's session writes through: a 401 of the app's own or a validation 422 is never
claimed, each caller's key is its own, and the record commits with the handler's write.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, HTTPException
from fastapi.security import APIKeyHeader
from pydantic import BaseModel
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from asgi_idempotency import IdempotencyMiddleware, SQLStore, idempotent
from asgi_idempotency.integrations.transactional import get_session
from asgi_idempotency.ops.demo import refunds
from asgi_idempotency.principals import from_dependency
from tests.helpers.serving import run_uvicorn
from tests.integrations.test_transactional import record_rows, refund_rows

pytestmark = [pytest.mark.anyio]

API_KEYS = {"key-acme": "acme", "key-globex": "globex"}
api_key = APIKeyHeader(name="X-API-Key", auto_error=False)


def current_client(key: str | None = Depends(api_key)) -> str:
    if key not in API_KEYS:
        raise HTTPException(401, "unknown API key")  # the app's own 401, its own body
    return API_KEYS[key]


class RefundIn(BaseModel):
    amount: int
    fail: bool = False


def app_of(store: SQLStore, calls: list[str]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware, store=store, principal=from_dependency(current_client)
    )

    @app.post("/orders/{order_id}/refunds", status_code=201)
    @idempotent(required=True, transactional=True)
    async def refund(
        order_id: str,
        body: RefundIn,
        client: str = Depends(current_client),
        session: AsyncSession = Depends(get_session),
    ) -> dict[str, Any]:
        calls.append(client)
        refund_id = f"r{len(calls)}"
        await session.execute(
            insert(refunds).values(id=refund_id, order_id=order_id, amount=body.amount)
        )
        if body.fail:
            raise RuntimeError("the provider failed after the write")
        return {"refund_id": refund_id, "client": client}

    return app


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://t"
    )


def headers(key: str, api: str = "key-acme") -> dict[str, str]:
    return {"Idempotency-Key": key, "X-API-Key": api}


async def test_the_write_and_the_record_commit_together(tx_store: SQLStore) -> None:
    calls: list[str] = []
    async with client(app_of(tx_store, calls)) as c:
        first = await c.post("/orders/1/refunds", json={"amount": 5}, headers=headers("k"))
        again = await c.post("/orders/1/refunds", json={"amount": 5}, headers=headers("k"))
        other = await c.post("/orders/1/refunds", json={"amount": 6}, headers=headers("k"))
    assert first.status_code == 201, first.text
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
    assert other.headers["content-type"] == "application/problem+json"
    assert calls == ["acme"]
    assert await refund_rows(tx_store) == 1
    assert [r.status for r in await record_rows(tx_store)] == ["completed"]


async def test_the_apps_own_401_and_a_validation_422_are_never_claimed(
    tx_store: SQLStore,
) -> None:
    calls: list[str] = []
    async with client(app_of(tx_store, calls)) as c:
        bad_token = await c.post(
            "/orders/1/refunds", json={"amount": 5}, headers=headers("k", api="stolen")
        )
        invalid = await c.post("/orders/1/refunds", json={"amount": "five"}, headers=headers("k"))
        assert await record_rows(tx_store) == []
        fixed = await c.post("/orders/1/refunds", json={"amount": 5}, headers=headers("k"))
    assert bad_token.status_code == 401
    assert bad_token.json() == {"detail": "unknown API key"}  # the app's answer, not ours
    assert invalid.status_code == 422
    assert invalid.json()["detail"][0]["loc"] == ["body", "amount"]  # FastAPI's, not ours
    assert fixed.status_code == 201, fixed.text
    assert calls == ["acme"]
    assert await refund_rows(tx_store) == 1


async def test_two_callers_with_one_key_get_one_row_each(tx_store: SQLStore) -> None:
    calls: list[str] = []
    async with client(app_of(tx_store, calls)) as c:
        acme = await c.post("/orders/1/refunds", json={"amount": 5}, headers=headers("k"))
        globex = await c.post(
            "/orders/1/refunds", json={"amount": 5}, headers=headers("k", api="key-globex")
        )
    assert acme.status_code == globex.status_code == 201
    assert acme.json()["client"] == "acme"
    assert globex.json()["client"] == "globex"
    assert sorted(calls) == ["acme", "globex"]
    assert await refund_rows(tx_store) == 2
    assert len(await record_rows(tx_store)) == 2


async def test_a_raise_rolls_back_the_write_and_the_claim(tx_store: SQLStore) -> None:
    calls: list[str] = []
    async with client(app_of(tx_store, calls)) as c:
        failed = await c.post(
            "/orders/1/refunds", json={"amount": 5, "fail": True}, headers=headers("k")
        )
        assert await refund_rows(tx_store) == 0
        assert await record_rows(tx_store) == []
        retried = await c.post(
            "/orders/1/refunds", json={"amount": 5, "fail": True}, headers=headers("k")
        )
    assert failed.status_code == retried.status_code == 500
    assert calls == ["acme", "acme"]  # released: the retry ran again
    assert await refund_rows(tx_store) == 0


@pytest.mark.slow
async def test_a_worker_killed_after_its_write_leaves_nothing_and_the_retry_runs_once(
    tx_url: str, tx_store: SQLStore, tmp_path: Path
) -> None:
    """uvicorn serving the README's wiring is SIGKILLed between the handler's insert and
    its answer: the database rolls back the write with the claim; the retry answers 409
    at most until the dead transaction is gone, then runs once (201), then replays."""
    written = tmp_path / "written"
    env = {"IDEMPOTENCY_TEST_TX_URL": tx_url, "IDEMPOTENCY_TEST_WRITTEN": str(written)}
    body = {"amount": 4500, "after": 30}
    h = headers("kill-1")
    with run_uvicorn(
        "tests.integrations.tx_dependency_app:app", env=env, log_dir=tmp_path
    ) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            pending = asyncio.create_task(c.post("/orders/1/refunds", json=body, headers=h))
            async with asyncio.timeout(20):
                while not written.exists():  # polled: another process writes it
                    assert not pending.done(), (await pending).text  # answered: no crash
                    await asyncio.sleep(0.05)
            server.kill(signal.SIGKILL)
            with pytest.raises(httpx.TransportError):
                await pending
    assert await refund_rows(tx_store) == 0
    statuses: list[int] = []
    body["after"] = 0
    with run_uvicorn(
        "tests.integrations.tx_dependency_app:app", env=env, log_dir=tmp_path
    ) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
            async with asyncio.timeout(20):
                while True:
                    got = await c.post("/orders/1/refunds", json=body, headers=h)
                    statuses.append(got.status_code)
                    if got.status_code != 409:
                        break
                    await asyncio.sleep(0.05)
            replay = await c.post("/orders/1/refunds", json=body, headers=h)
    assert got.status_code == 201, got.text
    assert set(statuses[:-1]) <= {409}
    assert replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == got.content
    assert await refund_rows(tx_store) == 1

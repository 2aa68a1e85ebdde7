"""The README's examples run as written."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select

pytestmark = pytest.mark.anyio


def _load(name: str, monkeypatch: pytest.MonkeyPatch, url: str) -> ModuleType:
    monkeypatch.setenv("IDEMPOTENCY_DATABASE_URL", url)
    sys.modules.pop(name, None)
    return importlib.import_module(name)


@pytest.mark.postgres
async def test_fastapi_transactional_example(monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    from asgi_idempotency import SQLStore
    from asgi_idempotency.ops.demo import refunds
    from tests.conftest import truncate

    store = SQLStore(pg_url)
    await truncate(store)
    mod = _load("examples.fastapi_transactional", monkeypatch, pg_url)
    app: FastAPI = mod.app
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c,
        ):
            first = await c.post(
                "/orders/1/refunds", json={"amount": 5}, headers={"Idempotency-Key": "t1"}
            )
            again = await c.post(
                "/orders/1/refunds", json={"amount": 5}, headers={"Idempotency-Key": "t1"}
            )
        async with store.engine.connect() as conn:
            rows = (await conn.execute(select(func.count()).select_from(refunds))).scalar_one()
    finally:
        await store.close()
    assert first.status_code == 201, first.text
    assert again.content == first.content
    assert rows == 1

"""Storms: many copies of one request at once run the handler exactly once."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest

from asgi_idempotency import SQLStore
from asgi_idempotency.ops.demo import count_refunds
from tests.conftest import TinyFactory
from tests.helpers.serving import run_uvicorn

pytestmark = pytest.mark.anyio


def _check_storm(responses: list[httpx.Response]) -> Counter[int]:
    statuses = Counter(r.status_code for r in responses)
    created = [r for r in responses if r.status_code == 201]
    first = [r for r in created if r.headers.get("idempotent-replayed") != "true"]
    assert len(first) == 1, statuses
    # Everything else is an immediate 409 or a byte-identical replay of the winner.
    assert set(statuses) <= {201, 409, 422}, statuses
    for r in created:
        assert r.content == first[0].content
    return statuses


@pytest.mark.postgres
async def test_storm_of_one_request_runs_once(pg_store: SQLStore, tiny: TinyFactory) -> None:
    t = tiny(pg_store)
    async with t.client() as c:

        async def one() -> httpx.Response:
            return await c.post("/pay", json={"amount": 4500}, headers={"Idempotency-Key": "storm"})

        responses = await asyncio.gather(*(one() for _ in range(100)))
    statuses = _check_storm(list(responses))
    assert statuses[422] == 0
    assert t.calls == {"pay": 1}


@pytest.mark.postgres
async def test_storm_with_two_bodies_runs_once_and_the_loser_gets_422(
    pg_store: SQLStore, tiny: TinyFactory
) -> None:
    t = tiny(pg_store)
    async with t.client() as c:

        async def one(amount: int) -> httpx.Response:
            return await c.post("/pay", json={"amount": amount}, headers={"Idempotency-Key": "two"})

        responses = await asyncio.gather(*(one(100 + i % 2) for i in range(100)))
    statuses = _check_storm(list(responses))
    winner_amount = next(r for r in responses if r.status_code == 201).json()["echo"]["amount"]
    for r, i in zip(responses, range(100), strict=True):
        if 100 + i % 2 != winner_amount:
            assert r.status_code == 422
    assert statuses[422] == 50
    assert t.calls == {"pay": 1}


async def _http_storm(base_url: str, n: int, delay: float) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as c:

        async def one() -> httpx.Response:
            return await c.post(
                "/orders/9/refunds",
                json={"amount": 4500, "delay": delay},
                headers={"Idempotency-Key": "multi-worker-storm"},
            )

        return list(await asyncio.gather(*(one() for _ in range(n))))


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ],
)
async def test_storm_across_four_uvicorn_workers(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue(f"{'pg' if kind == 'postgres' else kind}_url")
    store = SQLStore(url)
    if kind != "sqlite":  # a database shared by the run: start from empty tables
        from tests.conftest import truncate

        await truncate(store)
    try:
        with run_uvicorn(
            "asgi_idempotency.ops.demo:app",
            env={"IDEMPOTENCY_DEMO_DATABASE_URL": url},
            log_dir=tmp_path,
            workers=4,
        ) as server:
            responses = await _http_storm(server.base_url, 100, delay=0.3)
            statuses = _check_storm(responses)
            log = server.log.read_text()
        assert statuses[422] == 0
        assert await count_refunds(store) == 1
        assert "database is locked" not in log
        assert "Traceback" not in log
    finally:
        await store.close()

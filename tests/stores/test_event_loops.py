"""Every store serves successive event loops: FastAPI's ``TestClient(app)`` used without ``with``.

Starlette's sync ``TestClient`` outside a ``with`` block runs each request on an event
loop of its own (an anyio portal per request), closed once the request is answered.
A store's connections belong to the loop that opened them, so each store opens new
ones on a new loop and closes the old ones on their own loop as it shuts down: the
second request is a replay, the handler ran once, no connection is left open on the
server and nothing warns (``ResourceWarning`` is an error here, as every warning).
"""

from __future__ import annotations

import asyncio
import gc
import uuid
import warnings
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import MemoryStore, Policy, SQLStore
from asgi_idempotency.stores.base import Store
from tests.apps import guarded
from tests.conftest import PgServer, _prepare

with warnings.catch_warnings():
    # Starlette asks for httpx2 instead of httpx; the client works the same with either.
    warnings.filterwarnings("ignore", "Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

KINDS = [
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("postgres_batched", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]


def _app(store: Store, calls: list[int]) -> Starlette:
    async def pay(request: Request) -> Response:
        calls.append(1)
        return JSONResponse({"paid": len(calls)}, status_code=201)

    return guarded(store, [Route("/pay", pay, methods=["POST"])], policies={"POST /pay": Policy()})


@pytest.fixture(scope="module")
def loops_pg(pg_server: PgServer) -> Iterator[str]:
    """A database of this module's own, so that its open connections can be counted."""
    with pg_server.database("idem_loops") as url:
        _prepare(url)
        yield url


def _pg_backends(url: str) -> int:
    async def count() -> int:
        engine = create_async_engine(url, poolclass=None)
        try:
            async with engine.connect() as conn:
                query = text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                return int((await conn.execute(query)).scalar_one())
        finally:
            await engine.dispose()

    return asyncio.run(count())


def _store(kind: str, request: pytest.FixtureRequest) -> Store:
    from asgi_idempotency.stores.redis import RedisStore

    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return SQLStore(request.getfixturevalue("sqlite_url"))
    if kind.startswith("postgres"):
        return SQLStore(request.getfixturevalue("loops_pg"), batching=kind == "postgres_batched")
    return RedisStore(request.getfixturevalue("redis_url"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_test_client_without_with_replays_on_every_store(
    kind: str, request: pytest.FixtureRequest
) -> None:
    store = _store(kind, request)
    calls: list[int] = []
    client = TestClient(_app(store, calls))  # as FastAPI's docs write it: no `with`
    key = {"Idempotency-Key": f"pay-{uuid.uuid4().hex}"}

    first = client.post("/pay", json={"amount": 10}, headers=key)
    second = client.post("/pay", json={"amount": 10}, headers=key)
    third = client.post("/pay", json={"amount": 10}, headers=key)

    assert first.status_code == 201, first.text
    assert "idempotent-replayed" not in first.headers
    for again in (second, third):
        assert again.status_code == 201, again.text
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()
    assert calls == [1]  # the handler ran once
    if kind.startswith("postgres"):
        # Each request's loop closed its connections as it shut down.
        assert _pg_backends(request.getfixturevalue("loops_pg")) == 0
    asyncio.run(store.close())  # from yet another loop: nothing of the old ones to close
    gc.collect()  # anything left unclosed would warn now, inside the test


@pytest.mark.parametrize("kind", KINDS)
def test_asyncio_run_twice_on_one_store(kind: str, request: pytest.FixtureRequest) -> None:
    # The same without Starlette: a script that calls asyncio.run once per step.
    from asgi_idempotency.core import lifecycle
    from asgi_idempotency.stores.base import utcnow

    store = _store(kind, request)
    key = uuid.uuid4().hex * 2

    async def claim() -> lifecycle.Claim:
        now = utcnow()
        return await lifecycle.claim(
            store, key, "h", uuid.uuid4().hex,
            now=now, lease=Policy().lease, ttl=Policy().ttl,
        )  # fmt: skip

    assert asyncio.run(claim()).owned
    assert not asyncio.run(claim()).owned  # the first claim is seen from a new loop

    async def close() -> None:
        await store.close()

    asyncio.run(close())
    gc.collect()

"""Dead pooled Postgres connections cost no answer, batched or not, in transactions too.

Issue 33, item 13.

Real Postgres, the real middleware over ASGI: the hot path's connections are warmed by
requests, then a second connection ``pg_terminate_backend``s every idle backend of the
store's database, and the next requests are answered as if nothing had happened. And
statements whose connection was cut after they committed (a loopback proxy,
:mod:`tests.helpers.pgfaults`) are answered as they landed.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.engine import make_url
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import ClaimOutcome, Policy, RecordStatus, SQLStore
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.integrations.transactional import get_session
from asgi_idempotency.ops.demo import refunds
from tests.apps import guarded
from tests.conftest import TinyFactory, emptied
from tests.helpers.pgfaults import FaultProxy
from tests.stores.test_batching import RESPONSE, TTL, k, tok
from tests.stores.test_batching_safety import (
    batched_store,
    claim,
    connection,
    now,
    proxied,
    rows,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

REQUESTS = 40
ROUNDS = 8

# Every idle backend of the store's database but the asker's own; asked from a second
# connection, as an operator (or a pooler, or idle_session_timeout) would end them.
_TERMINATE_IDLE = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'idle'"
)


async def _terminate_idle(pg_url: str) -> int:
    async with connection(pg_url) as admin:
        return int(await admin.fetchval(_TERMINATE_IDLE))


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_idle_connections_terminated_by_the_server_cost_no_answer(
    pg_url: str, tiny: TinyFactory, batching: bool
) -> None:
    async with emptied(SQLStore(pg_url, batching=batching)) as store:
        app = tiny(store, principal=ANONYMOUS)
        async with app.client() as client:

            async def post(key: str) -> int:
                response = await client.post("/pay", json={}, headers={"Idempotency-Key": key})
                return response.status_code

            # Whether the driver has read a connection's end by the next statement is a
            # race; a few rounds make meeting a dead connection certain.
            for _ in range(ROUNDS):
                # Warm the hot path: several connections open, idle between statements.
                warm = await asyncio.gather(*(post(uuid.uuid4().hex) for _ in range(REQUESTS)))
                assert set(warm) == {201}
                assert await _terminate_idle(pg_url) >= 1
                keys = [uuid.uuid4().hex for _ in range(REQUESTS)]
                answers = await asyncio.gather(*(post(key) for key in keys))
                assert answers == [201] * REQUESTS
                # And each was recorded: a retry replays, the handler ran once per key.
                ran = app.calls["pay"]
                replays = await asyncio.gather(*(post(key) for key in keys))
                assert replays == [201] * REQUESTS
                assert app.calls["pay"] == ran


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_a_statement_whose_answer_was_lost_is_answered_as_it_landed(
    pg_url: str, batching: bool
) -> None:
    """A claim, a completion and a take-over each commit, then their connection is cut
    before the answer arrives: each is sent once more and answered as its first attempt
    landed (never a 409 against its own claim, a lost completion or a lost take-over)."""
    url = make_url(pg_url)
    async with (
        FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy,
        batched_store(proxied(pg_url, proxy.port), batching=batching) as store,
    ):
        await claim(store, k("warm"))  # connected, prepared
        token = tok()
        proxy.cut_after("INSERT")
        assert (await claim(store, k("a"), token=token)).outcome is ClaimOutcome.CLAIMED
        proxy.cut_after("SET status='completed'")
        assert await store.complete(k("a"), token, RESPONSE, now=now(), ttl=TTL)
        await claim(store, k("b"), lease=timedelta(milliseconds=1))
        await asyncio.sleep(0.01)  # that claim's lease is over: the next takes it over
        proxy.cut_after("SET request_hash")
        assert (await claim(store, k("b"))).outcome is ClaimOutcome.TAKEN_OVER
        assert proxy.cuts == 3
    found = await rows(pg_url)
    assert found[k("a")] == (RecordStatus.COMPLETED.value, token)


# Transactional requests each hold a connection of the store's pool for the request.
TX_REQUESTS = 20


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_idle_connections_terminated_cost_a_transactional_route_no_answer(
    pg_url: str, batching: bool
) -> None:
    """The transaction's connection comes from the pool unpinged: when the claim, its
    first statement, finds it dead, the transaction opens again on a fresh one, and the
    handler writes through that one."""
    runs: list[str] = []

    async def refund(request: Request) -> Response:
        runs.append(request.headers["idempotency-key"])
        await get_session(request).execute(
            insert(refunds).values(id=uuid.uuid4().hex, order_id="1", amount=1)
        )
        return JSONResponse({"n": len(runs)}, status_code=201)

    async with emptied(SQLStore(pg_url, batching=batching)) as store:
        app = guarded(
            store,
            [Route("/refunds", refund, methods=["POST"])],
            policies={"POST /refunds": Policy(required=True, transactional=True)},
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def post(key: str) -> int:
                response = await client.post("/refunds", json={}, headers={"Idempotency-Key": key})
                return response.status_code

            for _ in range(ROUNDS):
                warm = await asyncio.gather(*(post(uuid.uuid4().hex) for _ in range(TX_REQUESTS)))
                assert set(warm) == {201}
                assert await _terminate_idle(pg_url) >= 1
                keys = [uuid.uuid4().hex for _ in range(TX_REQUESTS)]
                answers = await asyncio.gather(*(post(key) for key in keys))
                assert answers == [201] * TX_REQUESTS
                ran = len(runs)
                replays = await asyncio.gather(*(post(key) for key in keys))
                assert replays == [201] * TX_REQUESTS
                assert len(runs) == ran
        # Each run's write committed with its record, once: none on a connection given up.
        assert len(set(runs)) == len(runs)
        async with store.engine.connect() as conn:
            written = (await conn.execute(select(func.count()).select_from(refunds))).scalar_one()
        assert written == len(runs)

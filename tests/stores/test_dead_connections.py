"""Dead pooled Postgres connections cost no answer, batched or not (issue 33, item 13).

Real Postgres, the real middleware over ASGI: the hot path's connections are warmed by
requests, then a second connection ``pg_terminate_backend``s every idle backend of the
store's database, and the next requests are answered as if nothing had happened.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from asgi_idempotency import SQLStore
from asgi_idempotency.principals import ANONYMOUS
from tests.conftest import TinyFactory, emptied
from tests.stores.test_batching_safety import connection

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

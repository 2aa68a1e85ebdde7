"""SQLite honours ``command_timeout``: a locked database answers 503 after it, not later."""

from __future__ import annotations

import sqlite3
import time

import pytest

from asgi_idempotency import SQLStore
from tests.conftest import TinyFactory

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("prepared", [True, False], ids=["hot-path", "first-start"])
async def test_a_locked_database_answers_503_within_command_timeout(
    sqlite_url: str, tiny: TinyFactory, prepared: bool
) -> None:
    # hot-path: the claim waits on the store's own connection thread; first-start: the
    # store's check at the first request waits on one of the engine's connections.
    store = SQLStore(sqlite_url, command_timeout=0.5)
    if prepared:
        await store.prepare()
    app = tiny(store)
    path = sqlite_url.removeprefix("sqlite+aiosqlite:///")
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another process holding the write lock
        async with app.client() as client:
            started = time.monotonic()
            locked = await client.post("/pay", json={}, headers={"Idempotency-Key": "k-1"})
            waited = time.monotonic() - started
            assert locked.status_code == 503
            assert waited < 2.0  # the busy timeout was command_timeout (0.5 s), not 10 s
            holder.execute("ROLLBACK")
            retried = await client.post("/pay", json={}, headers={"Idempotency-Key": "k-1"})
            assert retried.status_code == 201
        assert app.calls == {"pay": 1}
    finally:
        holder.close()
        await store.close()

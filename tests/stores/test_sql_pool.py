"""The Postgres hot path's own connection keeping: bounded, fair, leak-free, and shared.

These are the one-statement-per-request driver's (``batching=False``, whatever
the ``batching`` argument says); the batched driver runs on top of it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from sqlalchemy import text

from asgi_idempotency import ClaimOutcome, SQLStore, StoreError
from asgi_idempotency.core import lifecycle
from asgi_idempotency.stores.sql.postgres import PostgresDriver
from tests.conftest import emptied, truncate

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

NOW = datetime(2026, 12, 1, tzinfo=UTC)


@pytest.fixture
async def small(pg_url: str) -> AsyncIterator[SQLStore]:
    async with emptied(SQLStore(pg_url, pool_size=2, command_timeout=5, batching=False)) as store:
        yield store


async def claim(store: SQLStore, key: str) -> ClaimOutcome:
    claim = await lifecycle.claim(store,
        key, "h", uuid.uuid4().hex, now=NOW, lease=timedelta(seconds=30),
        ttl=timedelta(hours=1),
    )  # fmt: skip
    return claim.outcome


def held(store: SQLStore) -> int:
    return cast(PostgresDriver, store._driver)._held  # the Postgres path's own count


async def test_many_concurrent_statements_share_a_bounded_set(small: SQLStore) -> None:
    outcomes = await asyncio.gather(*(claim(small, f"{i:064d}") for i in range(60)))
    assert outcomes == [ClaimOutcome.CLAIMED] * 60
    assert held(small) <= 2
    assert small.engine.pool.checkedout() <= 2  # type: ignore[attr-defined]  # QueuePool's, not Pool's


async def test_cancelled_statements_leak_no_connection(small: SQLStore) -> None:
    tasks = [asyncio.ensure_future(claim(small, f"c{i:063d}")) for i in range(30)]
    await asyncio.sleep(0.005)
    for task in tasks[::2]:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.1)  # cancelled connections are returned in tasks of their own
    assert held(small) <= 2
    outcomes = await asyncio.gather(*(claim(small, f"d{i:063d}") for i in range(30)))
    assert outcomes == [ClaimOutcome.CLAIMED] * 30


async def test_the_rest_of_the_pool_stays_free_for_other_work(small: SQLStore) -> None:
    # Saturate the hot path, then open the connections a transactional request would.
    storm = asyncio.gather(*(claim(small, f"e{i:063d}") for i in range(40)))
    async with small.engine.connect() as a, small.engine.connect() as b:
        assert (await a.execute(text("SELECT 1"))).scalar_one() == 1
        assert (await b.execute(text("SELECT 1"))).scalar_one() == 1
    assert set(await storm) == {ClaimOutcome.CLAIMED}


async def test_a_wait_for_a_busy_pool_ends_at_the_timeout_and_leaks_nothing(pg_url: str) -> None:
    store = SQLStore(pg_url, pool_size=1, command_timeout=1, batching=False)
    await truncate(store)
    blocked_key = f"b{0:063d}"
    try:
        # An uncommitted insert of the same key makes a claim of it wait on the row lock
        # until command_timeout. Two such claims keep the one hot-path connection busy
        # for two timeouts in a row (FIFO), so a third claim waits in vain.
        async with store.engine.connect() as blocker:
            await blocker.begin()
            await blocker.execute(
                text(
                    "INSERT INTO idempotency_records (key, request_hash, status, token, "
                    "created_at, locked_until, expires_at) "
                    "VALUES (:k, 'h', 'in_progress', 't', now(), now(), now() + interval '1 h')"
                ),
                {"k": blocked_key},
            )
            holders = [asyncio.ensure_future(claim(store, blocked_key))]
            await asyncio.sleep(0.3)  # the second holder gets the connection as the first ends
            holders.append(asyncio.ensure_future(claim(store, blocked_key)))
            await asyncio.sleep(0.2)
            started = asyncio.get_running_loop().time()
            with pytest.raises(StoreError, match="no connection free within 1"):
                await claim(store, f"w{0:063d}")
            waited = asyncio.get_running_loop().time() - started
            assert 0.9 <= waited < 2.5
            for holder in holders:  # each blocked statement ends at command_timeout
                with pytest.raises(StoreError):
                    await holder
            await blocker.rollback()
        assert held(store) <= 1
        assert await claim(store, f"x{0:063d}") is ClaimOutcome.CLAIMED
    finally:
        await store.close()


@pytest.mark.parametrize("timeout", [0, -1.0, None])
def test_command_timeout_must_be_positive(pg_url: str, timeout: Any) -> None:
    with pytest.raises(ValueError, match="command_timeout"):
        SQLStore(pg_url, command_timeout=timeout)

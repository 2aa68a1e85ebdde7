"""The Postgres hot path's own connection keeping: bounded, fair, leak-free, and shared."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from asgi_idempotency import ClaimOutcome, SQLStore
from tests.conftest import truncate

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

NOW = datetime(2026, 12, 1, tzinfo=UTC)


@pytest.fixture
async def small(pg_url: str) -> AsyncIterator[SQLStore]:
    store = SQLStore(pg_url, pool_size=2, command_timeout=5)
    await truncate(store)
    try:
        yield store
    finally:
        await store.close()


async def claim(store: SQLStore, key: str) -> ClaimOutcome:
    claim = await store.claim(
        key, "h", uuid.uuid4().hex, now=NOW, locked_until=NOW + timedelta(seconds=30),
        expires_at=NOW + timedelta(hours=1),
    )  # fmt: skip
    return claim.outcome


def held(store: SQLStore) -> int:
    return store._driver._held  # type: ignore[attr-defined]


async def test_many_concurrent_statements_share_a_bounded_set(small: SQLStore) -> None:
    outcomes = await asyncio.gather(*(claim(small, f"{i:064d}") for i in range(60)))
    assert outcomes == [ClaimOutcome.CLAIMED] * 60
    assert held(small) <= 2
    assert small.engine.pool.checkedout() <= 2  # type: ignore[attr-defined]


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

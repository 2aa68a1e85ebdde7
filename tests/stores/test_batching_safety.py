"""Batching on Postgres, tried adversarially: what one request per statement never suffered.

Each test here broke the batched store once (issue 26): a key held by an open
transaction, a statement given up on that committed later, batches locking rows in
their own orders, dead pooled connections, and cancellations at every point of a
claim's life. Real Postgres throughout: lock holders are real second connections
(asyncpg), dead connections are ``pg_terminate_backend``, and faults on the wire come
from a loopback proxy (:mod:`tests.pgfaults`).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from asgi_idempotency import SQLStore, StoredResponse, lifecycle
from asgi_idempotency.errors import StoreError
from asgi_idempotency.lifecycle import Claim
from asgi_idempotency.stores.base import NewClaim
from asgi_idempotency.stores.postgres_batched import BatchingPostgresDriver
from tests.conftest import truncate
from tests.pgfaults import FaultProxy

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=24)
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id":1}')
# Short, so that a test that waits for it fails fast; long against a lock wait.
COMMAND_TIMEOUT = 3.0


def tok() -> str:
    return uuid.uuid4().hex


def k(name: str) -> str:
    """A 64-character key, as the middleware's scoped keys are (sha256 hex)."""
    return hashlib.sha256(name.encode()).hexdigest()


def now() -> datetime:
    return datetime.now(UTC)


async def claim(
    store: SQLStore,
    key: str,
    h: str = "h1",
    token: str | None = None,
    orphaned: Callable[[NewClaim], object] | None = None,
    lease: timedelta = LEASE,
) -> Claim:
    t = now()
    return await lifecycle.claim(
        store, key, h, token or tok(), now=t, locked_until=t + lease, expires_at=t + TTL,
        orphaned=orphaned,
    )  # fmt: skip


def driver(store: SQLStore) -> BatchingPostgresDriver:
    d = store._driver
    assert isinstance(d, BatchingPostgresDriver)
    return d


def dsn(pg_url: str) -> str:
    return make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)


def proxied(pg_url: str, port: int) -> str:
    url = make_url(pg_url).set(host="127.0.0.1", port=port, query={"ssl": "disable"})
    return url.render_as_string(hide_password=False)


@asynccontextmanager
async def batched_store(url: str, **kwargs: Any) -> AsyncIterator[SQLStore]:
    kwargs.setdefault("command_timeout", COMMAND_TIMEOUT)
    store = SQLStore(url, batching=kwargs.pop("batching", True), **kwargs)
    await truncate(store)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def batched(pg_url: str) -> AsyncIterator[SQLStore]:
    async with batched_store(pg_url) as store:
        yield store


@asynccontextmanager
async def connection(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn(pg_url))
    try:
        yield conn
    finally:
        await conn.close()


INSERT_HELD = (
    "INSERT INTO idempotency_records (key, request_hash, status, token, created_at, "
    "locked_until, expires_at) VALUES ($1, 'holder', 'in_progress', 'holder', now(), "
    "now() + interval '1 hour', now() + interval '1 day')"
)


async def rows(pg_url: str) -> dict[str, tuple[str, str]]:
    """Every committed row: key -> (status, token), read on a connection of its own."""
    async with connection(pg_url) as conn:
        found = await conn.fetch("SELECT key, status, token FROM idempotency_records")
    return {r["key"]: (r["status"], r["token"]) for r in found}


async def timed(coro: Awaitable[Any]) -> tuple[float, Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        result = await coro
    except StoreError as exc:
        result = exc
    return loop.time() - start, result


# ---------------------------------------------------------------------------------------
# 2. A statement the store gave up on (503) never commits behind the client's back.

SLOW_TRIGGER = """
CREATE OR REPLACE FUNCTION idem_test_slow_insert() RETURNS trigger AS $$
BEGIN
    IF NEW.request_hash = 'slow' THEN PERFORM pg_sleep(%s); END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER idem_test_slow BEFORE INSERT ON idempotency_records
    FOR EACH ROW EXECUTE FUNCTION idem_test_slow_insert();
"""


@asynccontextmanager
async def slow_inserts(pg_url: str, seconds: float) -> AsyncIterator[None]:
    """Inserts of rows with request_hash 'slow' take ``seconds`` (a stalled server, say)."""
    async with connection(pg_url) as conn:
        await conn.execute(SLOW_TRIGGER % seconds)
    try:
        yield
    finally:
        async with connection(pg_url) as conn:
            await conn.execute(
                "DROP TRIGGER idem_test_slow ON idempotency_records;"
                "DROP FUNCTION idem_test_slow_insert()"
            )


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "per-request"])
async def test_a_claim_answered_503_never_commits_later(pg_url: str, batching: bool) -> None:
    # The store gives up at command_timeout and answers 503; the driver's cancel request
    # is lost on the way (the proxy drops it, as a late one would be). The statement must
    # not commit afterwards: the retries would get 409 for a lease, nothing having run.
    url = make_url(pg_url)
    timeout = 1.0
    async with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        proxy.drop_cancels = True
        async with (
            batched_store(proxied(pg_url, proxy.port), command_timeout=timeout,
                          batching=batching) as store,
            slow_inserts(pg_url, timeout * 2),
        ):  # fmt: skip
            keys = [k("slow"), *(k(f"s{i}") for i in range(4))]
            results = await asyncio.gather(
                *(
                    timed(claim(store, key, "slow" if i == 0 else "h1"))
                    for i, key in enumerate(keys)
                )
            )
            slow_answer = results[0][1]
            assert isinstance(slow_answer, StoreError), slow_answer
            await asyncio.sleep(timeout * 2.5)  # past the stalled insert's end
            left = await rows(pg_url)
            # Every request that got 503 finds its key free on retry.
            for key, (_, answer) in zip(keys, results, strict=True):
                if isinstance(answer, StoreError):
                    assert key not in left, "a 503'd claim committed after its answer"


# ---------------------------------------------------------------------------------------
# 4. Dead pooled connections cost nobody an answer.


async def _terminate_others(pg_url: str) -> int:
    async with connection(pg_url) as admin:
        return int(
            await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )


async def test_completions_after_the_server_closed_idle_connections_all_land(
    pg_url: str, batched: SQLStore
) -> None:
    tokens = {k(f"p{i}"): tok() for i in range(16)}
    # Warm the hot path: several connections checked out and idle in the driver.
    await asyncio.gather(*(claim(batched, key, token=t) for key, t in tokens.items()))
    await asyncio.gather(
        *(batched.renew(key, t, locked_until=now() + LEASE) for key, t in tokens.items())
    )
    assert await _terminate_others(pg_url) >= 1
    await asyncio.sleep(0.2)  # the driver has read each connection's end
    expires = now() + TTL
    answers = await asyncio.gather(
        *(batched.complete(key, t, RESPONSE, expires_at=expires) for key, t in tokens.items()),
        return_exceptions=True,
    )
    assert answers == [True] * len(tokens)

"""Retention: bounded prune batches, the background pruner, stats, and a million-row prune."""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from asgi_idempotency import MemoryStore, SQLStore
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.lifecycle import ClaimOutcome, claim
from asgi_idempotency.http.asgi import Message
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.ops.retention import (
    Pruner,
    PruningMiddleware,
    count_expired,
    prune_all,
    table_stats,
)
from asgi_idempotency.stores.base import Store, StoredResponse
from tests.conftest import StoreClock, backdate

pytestmark = pytest.mark.anyio

NOW = datetime.now(UTC).replace(microsecond=0)
HASH = "f" * 64


async def put(store: Store, key: str, *, age: timedelta, ttl: timedelta, done: bool = True) -> None:
    """A record claimed ``age`` before NOW, kept ``ttl`` (expired when ttl <= age)."""
    t0 = NOW - age
    token = uuid.uuid4().hex
    claim_ = await claim(store, key, HASH, token, now=t0, lease=timedelta(seconds=30), ttl=ttl)
    assert claim_.owned
    if done:
        response = StoredResponse(201, ((b"content-type", b"application/json"),), b"{}")
        assert await store.complete(key, token, response, now=t0, ttl=ttl)
    if StoreClock(store).shared:
        # Written now, at the store's own time: aged to have been written at t0.
        record = await store.get(key)
        assert record is not None
        await backdate(store, key, record.created_at - t0)


def k(name: str) -> str:
    return name.ljust(64, "0")


async def fill_small(store: Store, *, expired: int, live: int) -> None:
    for i in range(expired):
        await put(
            store, k(f"e{i}"), age=timedelta(hours=2), ttl=timedelta(hours=1), done=i % 2 == 0
        )
    for i in range(live):
        await put(store, k(f"l{i}"), age=timedelta(minutes=5), ttl=timedelta(hours=1))


async def test_prune_all_deletes_every_expired_row_in_bounded_batches(store: Store) -> None:
    await fill_small(store, expired=7, live=3)
    batches: list[int] = []
    pruned = await prune_all(
        store, batch_size=3, now=NOW, progress=lambda done, batch: batches.append(batch)
    )
    assert pruned == 7
    assert batches == [3, 3, 1]  # an unbounded DELETE would show as one batch of 7
    assert await count_expired(store, now=NOW) == 0
    for i in range(3):
        assert await store.get(k(f"l{i}")) is not None
    for i in range(7):
        assert await store.get(k(f"e{i}")) is None


async def test_dry_run_counts_and_deletes_nothing(store: Store) -> None:
    await fill_small(store, expired=4, live=2)
    assert await prune_all(store, now=NOW, dry_run=True) == 4
    assert await count_expired(store, now=NOW) == 4
    assert await store.get(k("e0")) is not None


async def test_max_batches_bounds_a_run(store: Store) -> None:
    await fill_small(store, expired=5, live=0)
    assert await prune_all(store, batch_size=2, now=NOW, max_batches=2) == 4
    assert await count_expired(store, now=NOW) == 1


async def test_prune_all_rejects_a_zero_batch() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        await prune_all(MemoryStore(), batch_size=0)


@pytest.mark.postgres
async def test_a_prune_skips_a_row_another_transaction_holds_and_deletes_the_rest(
    pg_store: SQLStore,
) -> None:
    await fill_small(pg_store, expired=4, live=1)
    held = k("e0")
    async with pg_store.engine.connect() as other:
        # What a transactional take-over of an expired key holds while its handler runs.
        await other.execute(
            text("SELECT 1 FROM idempotency_records WHERE key = :key FOR UPDATE"), {"key": held}
        )
        # Skipped, not waited on: a prune that waited would block until this rolls back.
        deleted = await asyncio.wait_for(pg_store.prune(now=NOW, batch_size=1000), timeout=10)
        assert deleted == 3
        assert await pg_store.get(held) is not None
        await other.rollback()
    assert await pg_store.prune(now=NOW, batch_size=1000) == 1
    assert await pg_store.get(held) is None
    assert await count_expired(pg_store, now=NOW) == 0
    assert await pg_store.get(k("l0")) is not None


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def sql_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """The SQL stores only, each empty (stats read the table; the memory store has none)."""
    store = SQLStore(
        request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url")
    )
    try:
        async with store.engine.begin() as conn:
            await conn.execute(text("DELETE FROM idempotency_records"))
        yield store
    finally:
        await store.close()


async def test_table_stats(sql_store: SQLStore) -> None:
    store = sql_store
    await fill_small(store, expired=3, live=2)
    # A live in-progress claim, and one whose lease ended (abandoned).
    await put(store, k("running"), age=timedelta(seconds=1), ttl=timedelta(hours=1), done=False)
    await put(store, k("abandoned"), age=timedelta(minutes=10), ttl=timedelta(hours=1), done=False)
    stats = await table_stats(store, now=NOW)
    assert dict(stats.live) == {"completed": 2, "in_progress": 2}
    assert stats.expired == 3
    assert stats.abandoned == 1
    assert stats.total == 7
    assert stats.oldest_in_progress == NOW - timedelta(minutes=10)


class FailingStore(MemoryStore):
    async def prune(self, *, now: datetime | None = None, batch_size: int = 1000) -> int:
        raise StoreError("down")


async def test_background_pruner_prunes_and_survives_store_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    await fill_small(store, expired=5, live=1)
    async with Pruner(store, interval=0.05, batch_size=2, clock=lambda: NOW) as pruner:
        for _ in range(500):
            if pruner.runs >= 1:
                break
            await asyncio.sleep(0.01)
        assert pruner.pruned == 5
        assert await count_expired(store, now=NOW) == 0
        await fill_small(store, expired=2, live=0)
        pruner.wake()
        for _ in range(500):
            if pruner.pruned == 7:
                break
            await asyncio.sleep(0.01)
        assert pruner.pruned == 7
    assert await store.get(k("l0")) is not None

    caplog.set_level(logging.WARNING, logger="asgi_idempotency")
    async with Pruner(FailingStore(), interval=0.01) as failing:
        for _ in range(500):
            if failing.runs >= 3:
                break
            await asyncio.sleep(0.01)
        assert failing.runs >= 3  # kept going
    failures = [r for r in caplog.records if r.getMessage().startswith("idempotency.prune_failed ")]
    assert len(failures) >= 3
    assert failures[0].__dict__["error"] == "StoreError"
    assert "error=StoreError detail=" in failures[0].getMessage()  # readable without a formatter


@pytest.mark.parametrize("how", ["PruningMiddleware", "IdempotencyMiddleware(prune_interval=)"])
async def test_pruning_middleware_runs_the_pruner_for_the_lifespan(how: str) -> None:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    from asgi_idempotency import IdempotencyMiddleware

    store = MemoryStore()
    await fill_small(store, expired=3, live=1)
    middleware = (
        Middleware(PruningMiddleware, store=store, interval=3600)
        if how == "PruningMiddleware"
        else Middleware(
            IdempotencyMiddleware, store=store, principal=ANONYMOUS, prune_interval=3600
        )
    )
    app = Starlette(middleware=[middleware])

    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()

    async def receive() -> Message:
        return await inbox.get()

    async def send(message: Message) -> None:
        await outbox.put(message)

    assert await count_expired(store) == 3
    task = asyncio.ensure_future(
        app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    )
    await inbox.put({"type": "lifespan.startup"})
    assert (await asyncio.wait_for(outbox.get(), 5))["type"] == "lifespan.startup.complete"
    for _ in range(500):  # the first run starts at once
        if await count_expired(store) == 0:
            break
        await asyncio.sleep(0.01)
    assert await count_expired(store) == 0
    await inbox.put({"type": "lifespan.shutdown"})
    assert (await asyncio.wait_for(outbox.get(), 5))["type"] == "lifespan.shutdown.complete"
    await asyncio.wait_for(task, 5)
    assert [t for t in asyncio.all_tasks() if t.get_name() == "asgi-idempotency-pruner"] == []


# --- a million expired rows on Postgres -------------------------------------------------

ROWS = 1_000_000
LIVE_ROWS = 5_000

# Keys like real ones (64 hex chars, random order); expiries spread over the past day.
FILL = """
INSERT INTO idempotency_records
    (key, request_hash, status, token, created_at, locked_until, expires_at,
     response_status, response_headers, response_body)
SELECT h || h, repeat('f', 64),
       CASE WHEN i % 10 = 0 THEN 'in_progress' ELSE 'completed' END,
       h, ts - interval '2 days', ts - interval '2 days',
       CASE WHEN i <= :expired
            THEN ts - interval '1 hour' - (i % 86400) * interval '1 second'
            ELSE ts + interval '1 day' END,
       CASE WHEN i % 10 = 0 THEN NULL ELSE 201 END,
       CASE WHEN i % 10 = 0 THEN NULL ELSE '[]'::bytea END,
       CASE WHEN i % 10 = 0 THEN NULL ELSE '{"id": 1}'::bytea END
FROM (SELECT i, md5(i::text) AS h, now() AS ts FROM generate_series(1, :total) AS i) AS g
"""


def fill_key(i: int) -> str:
    import hashlib

    h = hashlib.md5(str(i).encode()).hexdigest()  # the same key FILL gave row i
    return h + h


async def bulk_fill(url: str) -> None:
    """Load the rows with the indexes dropped, then rebuild them: one transaction.

    Inserting a million random keys into live btrees takes minutes on a small
    machine; building the indexes afterwards takes seconds. DDL is transactional
    in Postgres, so a failure leaves the schema as it was.
    """
    bulk = SQLStore(url, command_timeout=300)
    try:
        async with bulk.engine.begin() as conn:
            await conn.execute(text("TRUNCATE idempotency_records"))
            pkey = (
                await conn.execute(
                    text(
                        "SELECT conname FROM pg_constraint "
                        "WHERE conrelid = 'idempotency_records'::regclass AND contype = 'p'"
                    )
                )
            ).scalar_one()
            indexes = (
                await conn.execute(
                    text(
                        "SELECT indexname, indexdef FROM pg_indexes "
                        "WHERE tablename = 'idempotency_records' AND indexname <> :pkey"
                    ),
                    {"pkey": pkey},
                )
            ).all()
            await conn.execute(text(f'ALTER TABLE idempotency_records DROP CONSTRAINT "{pkey}"'))
            for name, _ in indexes:
                await conn.execute(text(f'DROP INDEX "{name}"'))
            await conn.execute(text(FILL), {"expired": ROWS, "total": ROWS + LIVE_ROWS})
            await conn.execute(
                text(f'ALTER TABLE idempotency_records ADD CONSTRAINT "{pkey}" PRIMARY KEY (key)')
            )
            for _, definition in indexes:
                await conn.execute(text(definition))
        async with bulk.engine.connect() as conn:
            await conn.execute(text("ANALYZE idempotency_records"))
            await conn.commit()
    finally:
        await bulk.close()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


@pytest.mark.postgres
@pytest.mark.slow
async def test_claims_keep_answering_while_a_million_expired_rows_are_pruned(
    pg_url: str, pg_store: SQLStore, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.perf_counter()
    await bulk_fill(pg_url)
    filled = time.perf_counter() - started
    now = datetime.now(UTC)
    assert await count_expired(pg_store, now=now) == ROWS

    # The index serves prune's lookup when expired rows are the few (the steady state).
    # (With every row expired, a sequential scan with LIMIT is the cheaper plan, rightly.)
    async with pg_store.engine.connect() as conn:
        plan = "\n".join(
            row[0]
            for row in await conn.execute(
                text(
                    "EXPLAIN SELECT ctid FROM idempotency_records WHERE expires_at <= :cutoff "
                    "LIMIT 1000 FOR UPDATE SKIP LOCKED"
                ),
                {"cutoff": now - timedelta(hours=24, minutes=59)},
            )
        )
    assert "ix_idempotency_records_expires_at" in plan, plan

    # Distinct expired rows to claim again while the prune runs (at most 2 x 100,000 / 10).
    expired_picks = iter(random.Random(5).sample(range(1, ROWS + 1), 20_000))
    taken_over: list[str] = []

    async def one_claim(latencies: list[float]) -> None:
        t = datetime.now(UTC)
        # Mostly new keys; every tenth an expired key, which claims as new: a takeover
        # racing the prune, which it must win and survive.
        revive = len(latencies) % 10 == 9
        key = fill_key(next(expired_picks)) if revive else uuid.uuid4().hex + uuid.uuid4().hex
        begin = time.perf_counter()
        claim_ = await claim(
            pg_store,
            key,
            HASH,
            uuid.uuid4().hex,
            now=t,
            lease=timedelta(seconds=30),
            ttl=timedelta(hours=1),
        )
        latencies.append(time.perf_counter() - begin)
        assert claim_.outcome is ClaimOutcome.CLAIMED
        if revive:
            taken_over.append(key)

    async def claims_until(latencies: list[float], stop: asyncio.Event, limit: int) -> None:
        for _ in range(limit):  # bounded even if ``stop`` never comes
            if stop.is_set():
                return
            await one_claim(latencies)

    before: list[float] = []
    done_before = asyncio.Event()
    await asyncio.gather(*(claims_until(before, done_before, 200) for _ in range(2)))

    during: list[float] = []
    prune_done = asyncio.Event()
    prune_store = SQLStore(pg_url, command_timeout=60)
    batches: list[int] = []
    try:
        prune_started = time.perf_counter()

        async def prune() -> int:
            try:
                return await prune_all(
                    prune_store,
                    batch_size=5000,
                    now=now,
                    progress=lambda done, batch: batches.append(batch),
                )
            finally:
                prune_done.set()

        prune_task = asyncio.ensure_future(prune())
        await asyncio.gather(*(claims_until(during, prune_done, 100_000) for _ in range(2)))
        pruned = await prune_task
        prune_seconds = time.perf_counter() - prune_started
    finally:
        await prune_store.close()

    assert pruned >= ROWS - len(taken_over)
    assert max(batches) <= 5000
    assert await count_expired(pg_store, now=now) == 0
    assert len(during) >= 100, "claims stalled while prune ran"
    for key in taken_over:  # taken over mid-prune: live again, and kept
        record = await pg_store.get(key)
        assert record is not None
        assert record.expires_at > now
    async with pg_store.engine.connect() as conn:
        left = (await conn.execute(text("SELECT count(*) FROM idempotency_records"))).scalar_one()
    assert left == LIVE_ROWS + len(before) + len(during)  # every claimed key is live and kept

    with capsys.disabled():
        print(
            f"\n[retention] filled {ROWS:,} expired rows in {filled:.1f}s; "
            f"pruned {pruned:,} in {prune_seconds:.1f}s ({len(batches)} batches of <= 5000, "
            f"{pruned / prune_seconds:,.0f} rows/s)\n"
            f"[retention] claim latency before prune: p50 {pct(before, 0.5):.1f} ms, "
            f"p99 {pct(before, 0.99):.1f} ms (n={len(before)}); "
            f"during prune: p50 {pct(during, 0.5):.1f} ms, p99 {pct(during, 0.99):.1f} ms "
            f"(n={len(during)}, max {max(during) * 1000:.0f} ms, "
            f"mean {statistics.fmean(during) * 1000:.1f} ms)"
        )
    async with pg_store.engine.begin() as conn:
        await conn.execute(text("TRUNCATE idempotency_records"))


async def test_the_lifespan_recipe_prunes_a_fresh_sqlite_store_without_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The documented recipe starts the pruner in the app's own lifespan, before the
    middleware has created the SQLite table: its first run must not fail."""
    caplog.set_level(logging.WARNING, logger="asgi_idempotency")
    store = SQLStore(f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}")
    try:
        async with Pruner(store, interval=3600) as pruner:
            for _ in range(500):
                if pruner.runs >= 1:
                    break
                await asyncio.sleep(0.01)
            assert pruner.runs >= 1
    finally:
        await store.close()
    assert not [r for r in caplog.records if "prune_failed" in r.getMessage()]

"""SQLite operations queued together run in one transaction, and every guarantee holds.

Each test holds the connection thread on a gate, queues its operations behind it (so
that the thread takes them as one batch), opens the gate, and checks each answer and
what was committed. sqlite3's trace hook shows the transaction.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from asgi_idempotency import SQLStore, StoreError
from asgi_idempotency.core.lifecycle import Claim, ClaimOutcome, claim
from asgi_idempotency.stores.base import NewClaim, StoredResponse
from asgi_idempotency.stores.sql.sqlite import ConnectionThread, SQLiteDriver

pytestmark = pytest.mark.anyio

NOW = datetime.now(UTC)
LEASE, TTL = timedelta(seconds=30), timedelta(hours=1)
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b"{}")
WAIT = 10  # seconds any one answer may take before the test fails rather than hangs


@pytest.fixture
async def store(sqlite_url: str) -> AsyncIterator[SQLStore]:
    sql = SQLStore(sqlite_url)
    try:
        yield sql
    finally:
        await sql.close()


class Held:
    """The store's connection thread, held on a gate; the statements it ran, traced."""

    def __init__(self, thread: ConnectionThread) -> None:
        self.thread = thread
        self.gate = threading.Event()
        self.statements: list[str] = []
        self._blocker: asyncio.Future[Any] | None = None

    async def hold(self) -> None:
        assert self.thread._conn is not None
        await self.thread._execute(self.thread._conn.set_trace_callback, self.statements.append)
        started = threading.Event()

        def block() -> None:
            started.set()
            self.gate.wait(WAIT)

        self._blocker = asyncio.ensure_future(self.thread._execute(block))
        await self._until(started.is_set)  # the thread runs it: what comes next queues

    async def _until(self, ready: Callable[[], bool]) -> None:
        for _ in range(5000):
            if ready():
                return
            await asyncio.sleep(0.001)
        raise AssertionError("the connection thread never got there")

    async def behind(self, *ops: Awaitable[Any]) -> list[asyncio.Task[Any]]:
        """Start ``ops``; return once all of them wait in the thread's queue."""
        tasks = [asyncio.ensure_future(op) for op in ops]
        await self._until(lambda: self.thread._jobs.qsize() >= len(tasks))
        return tasks

    async def release(self) -> None:
        self.gate.set()
        assert self._blocker is not None
        await asyncio.wait_for(self._blocker, WAIT)

    def verbs(self) -> list[str]:
        return [s.split(None, 1)[0].upper() for s in self.statements if not s.startswith("PRAGMA")]


async def held(store: SQLStore) -> Held:
    driver = store._driver
    assert isinstance(driver, SQLiteDriver)
    h = Held(await driver._connection())
    await h.hold()
    return h


def claim_of(store: SQLStore, key: str, token: str, request_hash: str = "h") -> Awaitable[Any]:
    return claim(store, key, request_hash, token, now=NOW, lease=LEASE, ttl=TTL)


async def outcomes(tasks: list[asyncio.Task[Any]]) -> list[Any]:
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)
    return [d if isinstance(d, BaseException) else d.outcome for d in done]


async def keys(store: SQLStore) -> list[str]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(text("SELECT key FROM idempotency_records ORDER BY key"))
        return [row[0] for row in rows]


async def test_queued_claims_share_one_transaction(store: SQLStore) -> None:
    h = await held(store)
    tasks = await h.behind(*(claim_of(store, f"k{i}", f"t{i}") for i in range(5)))
    await h.release()
    assert await outcomes(tasks) == [ClaimOutcome.CLAIMED] * 5
    assert h.verbs() == ["BEGIN", *["INSERT"] * 5, "COMMIT"]
    assert await keys(store) == [f"k{i}" for i in range(5)]


async def test_a_burst_commits_in_batches_of_at_most_max_batch(sqlite_url: str) -> None:
    store = SQLStore(sqlite_url, max_batch=3)
    try:
        await _burst_of_seven(store)
    finally:
        await store.close()


async def _burst_of_seven(store: SQLStore) -> None:
    h = await held(store)
    tasks = await h.behind(*(claim_of(store, f"k{i}", f"t{i}") for i in range(7)))
    await h.release()
    assert await outcomes(tasks) == [ClaimOutcome.CLAIMED] * 7
    batch = ["BEGIN", *["INSERT"] * 3, "COMMIT"]
    assert h.verbs() == [*batch, *batch, "INSERT"]  # the last one, alone, needs no BEGIN


async def test_the_same_key_twice_in_one_batch_is_claimed_once(store: SQLStore) -> None:
    h = await held(store)
    tasks = await h.behind(
        claim_of(store, "same", "t1"),
        claim_of(store, "same", "t2"),
        claim_of(store, "same", "t3", request_hash="other"),
    )
    await h.release()
    assert await outcomes(tasks) == [
        ClaimOutcome.CLAIMED,
        ClaimOutcome.IN_PROGRESS,
        ClaimOutcome.MISMATCH,
    ]
    assert h.verbs()[0] == "BEGIN"
    assert h.verbs()[-1] == "COMMIT"
    record = await store.get("same")
    assert record is not None
    assert record.token == "t1"


async def test_a_failing_statement_fails_only_its_own_request(store: SQLStore) -> None:
    h = await held(store)
    bad = NewClaim("bad", None, "tb", NOW, LEASE, TTL)  # type: ignore[arg-type]  # NOT NULL
    tasks = await h.behind(
        claim_of(store, "a", "ta"),
        store.insert(bad),
        claim_of(store, "c", "tc"),
    )
    await h.release()
    first, failed, last = await asyncio.wait_for(
        asyncio.gather(*tasks, return_exceptions=True), WAIT
    )
    assert isinstance(first, Claim)
    assert isinstance(last, Claim)
    assert first.outcome is ClaimOutcome.CLAIMED
    assert last.outcome is ClaimOutcome.CLAIMED
    assert isinstance(failed, StoreError)
    assert "NOT NULL" in str(failed)
    assert "ROLLBACK" in h.verbs()  # the batch was tried, rolled back, and run again singly
    assert await keys(store) == ["a", "c"]


async def test_a_failed_commit_fails_the_whole_batch_and_leaves_nothing(store: SQLStore) -> None:
    driver = store._driver
    assert isinstance(driver, SQLiteDriver)
    h = Held(await driver._connection())
    conn = h.thread._conn
    assert conn is not None
    for sql in (
        "PRAGMA foreign_keys=ON",
        "CREATE TEMP TABLE parent (id INTEGER PRIMARY KEY)",
        "CREATE TEMP TABLE child"
        " (pid INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)",
    ):
        await h.thread._execute(conn.execute, sql)
    await h.hold()
    tasks = await h.behind(
        claim_of(store, "x", "tx"),
        h.thread._execute(conn.execute, "INSERT INTO child VALUES (42)"),  # fails at COMMIT
        claim_of(store, "y", "ty"),
    )
    await h.release()
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)
    assert isinstance(done[0], StoreError)
    assert isinstance(done[2], StoreError)
    assert "FOREIGN KEY" in str(done[0])
    assert h.verbs()[-2:] == ["COMMIT", "ROLLBACK"]
    assert await keys(store) == []  # none left claimed without an owner
    assert (await claim_of(store, "x", "tx2")).outcome is ClaimOutcome.CLAIMED  # it goes on


async def test_a_cancelled_waiter_leaves_the_rest_of_its_batch_alone(store: SQLStore) -> None:
    h = await held(store)
    tasks = await h.behind(
        claim_of(store, "p", "tp"),
        claim_of(store, "q", "tq"),
        claim_of(store, "r", "tr"),
    )
    tasks[1].cancel()
    await h.release()
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)
    assert isinstance(done[1], asyncio.CancelledError)
    assert isinstance(done[0], Claim)
    assert isinstance(done[2], Claim)
    assert [done[0].outcome, done[2].outcome] == [ClaimOutcome.CLAIMED] * 2
    # The cancelled claim was never sent, so no row waits for an owner that left.
    assert await keys(store) == ["p", "r"]
    assert await store.complete("p", "tp", RESPONSE, now=NOW, ttl=TTL)


async def test_completions_queued_together_commit_together(store: SQLStore) -> None:
    for i in range(3):
        assert (await claim_of(store, f"c{i}", f"t{i}")).outcome is ClaimOutcome.CLAIMED
    h = await held(store)
    tasks = await h.behind(
        *(store.complete(f"c{i}", f"t{i}", RESPONSE, now=NOW, ttl=TTL) for i in range(3)),
        store.complete("c0", "wrong-token", RESPONSE, now=NOW, ttl=TTL),
    )
    await h.release()
    done = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
    assert done == [True, True, True, False]
    assert h.verbs() == ["BEGIN", *["UPDATE"] * 4, "COMMIT"]

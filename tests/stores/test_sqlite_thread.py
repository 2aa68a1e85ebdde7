"""The SQLite hot path's connection thread: it stops when the store closes, errors are
translated, a broken connection is replaced, and an in-memory database still works."""

from __future__ import annotations

import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from asgi_idempotency import SQLStore, StoreError
from asgi_idempotency.core.lifecycle import ClaimOutcome, claim
from asgi_idempotency.stores.sql.sqlite import ConnectionThread, EngineSQLiteDriver, SQLiteDriver

pytestmark = pytest.mark.anyio

NOW = datetime.now(UTC)
THREAD_NAME = "asgi-idempotency-sqlite"


async def _claim(store: SQLStore, key: str, token: str = "t") -> ClaimOutcome:
    got = await claim(
        store, key, "h", token,
        now=NOW, lease=timedelta(seconds=30), ttl=timedelta(hours=1),
    )  # fmt: skip
    return got.outcome


def _ours() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _thread(store: SQLStore) -> ConnectionThread:
    driver = store._driver
    assert isinstance(driver, SQLiteDriver)
    assert driver._thread is not None
    return driver._thread


async def test_closing_the_store_stops_its_thread(sqlite_url: str) -> None:
    before = _ours()
    store = SQLStore(sqlite_url)
    try:
        assert await _claim(store, "a") is ClaimOutcome.CLAIMED
        thread = _thread(store).thread
        assert thread.is_alive()
        assert _ours() == [*before, thread]
    finally:
        await store.close()
    assert not thread.is_alive()
    assert _ours() == before


async def test_a_passed_engine_stays_open_and_the_thread_still_stops(sqlite_url: str) -> None:
    before = _ours()
    engine = create_async_engine(sqlite_url)
    try:
        store = SQLStore(engine)
        assert await _claim(store, "b") is ClaimOutcome.CLAIMED
        await store.close()
        assert _ours() == before
        # The caller's engine still works, and sees the row the hot path wrote.
        again = SQLStore(engine)
        try:
            assert await again.get("b") is not None
        finally:
            await again.close()
    finally:
        await engine.dispose()


async def test_a_store_that_was_never_used_closes_without_a_thread(sqlite_url: str) -> None:
    before = _ours()
    store = SQLStore(sqlite_url)
    await store.close()
    assert _ours() == before


async def test_a_sqlite_error_becomes_a_store_error(tmp_path: Path) -> None:
    store = SQLStore(f"sqlite+aiosqlite:///{tmp_path / 'no-table.db'}")  # no create_all
    try:
        with pytest.raises(StoreError, match="OperationalError: no such table") as caught:
            await _claim(store, "c")
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
    finally:
        await store.close()


async def test_a_broken_connection_is_replaced(sqlite_url: str) -> None:
    before = _ours()
    store = SQLStore(sqlite_url)
    try:
        assert await _claim(store, "d") is ClaimOutcome.CLAIMED
        first = _thread(store)
        await first.close()  # as if the connection had died under the store
        assert await _claim(store, "e") is ClaimOutcome.CLAIMED
        assert _thread(store) is not first
        assert not first.thread.is_alive()
        assert await _claim(store, "d", token="u") is ClaimOutcome.IN_PROGRESS
    finally:
        await store.close()
    assert _ours() == before


async def test_an_in_memory_database_runs_through_the_engine() -> None:
    before = _ours()
    store = SQLStore("sqlite://")
    try:
        assert isinstance(store._driver, EngineSQLiteDriver)
        await store.create_all()
        assert await _claim(store, "f") is ClaimOutcome.CLAIMED
        record = await store.get("f")  # Core sees what the hot path wrote: one database
        assert record is not None
        assert await _claim(store, "f", token="u") is ClaimOutcome.IN_PROGRESS
        assert _ours() == before
    finally:
        await store.close()

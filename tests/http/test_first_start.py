"""First start: SQLite creates its table by itself; Postgres checks the operator's migrations.

On the embedded SQLite default the table is created at lifespan startup, or on the
first guarded request of an app served without lifespan, safely under several
processes starting at once. On Postgres nothing is created: a missing table or
migration head fails lifespan startup, or answers 503, with a message that names the
table and ``asgi-idempotency migrate --database-url ...``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, Policy, SQLStore
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.migrations import VERSION_TABLE, head
from asgi_idempotency.stores.sql.schema import metadata
from tests.conftest import PgServer
from tests.helpers.lifespan import start

pytestmark = pytest.mark.anyio

SCRIPT = Path(sys.executable).parent / "asgi-idempotency"
FIX = "asgi-idempotency migrate --database-url"


def guarded_app(store: SQLStore, events: list[str] | None = None, **kwargs: Any) -> Starlette:
    async def pay(request: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        if events is not None:
            events.append("app startup")
        yield
        if events is not None:
            events.append("app shutdown")

    return Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies={"POST /pay": Policy(required=True)},
                **{"principal": ANONYMOUS, **kwargs},
            )
        ],
        lifespan=lifespan,
    )


def client(app: Any) -> httpx.AsyncClient:
    # httpx's ASGITransport sends no lifespan: the app as served with --lifespan off.
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


# --- SQLite: created on first start -------------------------------------------------


async def test_sqlite_table_is_created_at_lifespan_startup(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    store = SQLStore(f"sqlite+aiosqlite:///{path}")
    app = guarded_app(store)
    try:
        answer, stop = await start(app)
        assert answer["type"] == "lifespan.startup.complete", answer
        assert {"idempotency_records", VERSION_TABLE} <= tables(path)
        async with client(app) as c:
            first = await c.post("/pay", json={}, headers={"Idempotency-Key": "k"})
            again = await c.post("/pay", json={}, headers={"Idempotency-Key": "k"})
        await stop()
    finally:
        await store.close()
    assert first.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    with sqlite3.connect(path) as conn:
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [(head(),)]


async def test_sqlite_table_is_created_on_first_use_without_lifespan(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    store = SQLStore(f"sqlite+aiosqlite:///{path}")
    try:
        async with client(guarded_app(store)) as c:
            first = await c.post("/pay", json={}, headers={"Idempotency-Key": "k"})
            again = await c.post("/pay", json={}, headers={"Idempotency-Key": "k"})
    finally:
        await store.close()
    assert first.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotency_records" in tables(path)


def _start_worker(url: str, barrier: Any, results: Any) -> None:
    """One process's first start: prepare the store, then claim a key of its own."""

    async def go() -> str:
        store = SQLStore(url)
        try:
            barrier.wait()  # every process starts at the same moment
            await store.prepare()
            async with client(guarded_app(store)) as c:
                r = await c.post("/pay", json={}, headers={"Idempotency-Key": uuid_key()})
            return str(r.status_code)
        finally:
            await store.close()

    try:
        results.put(asyncio.run(go()))
    except BaseException as exc:
        results.put(f"{type(exc).__name__}: {exc}")


def uuid_key() -> str:
    import uuid

    return uuid.uuid4().hex


@pytest.mark.slow
def test_several_processes_starting_at_once_on_one_fresh_file(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    url = f"sqlite+aiosqlite:///{path}"
    processes = 6
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [
        ctx.Process(target=_start_worker, args=(url, barrier, results)) for _ in range(processes)
    ]
    for w in workers:
        w.start()
    answers = [results.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    assert answers == ["201"] * processes
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency_records").fetchone() == (processes,)
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [(head(),)]


# --- Postgres: the operator's schema, checked -----------------------------------------


@pytest.fixture
def empty_pg(pg_server: PgServer) -> Iterator[str]:
    with pg_server.database("idem_first") as url:
        yield url


def _run(coro: Any) -> Any:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _table_only(url: str) -> None:
    """The records table without any recorded migration (a hand-made or old schema)."""
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
    finally:
        await engine.dispose()


def migrate(url: str) -> None:
    done = subprocess.run(
        [str(SCRIPT), "migrate", "--database-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


async def _startup_failure(url: str) -> tuple[str, list[str]]:
    store = SQLStore(url)
    events: list[str] = []
    try:
        answer, stop = await start(guarded_app(store, events))
        await stop()
    finally:
        await store.close()
    assert answer["type"] == "lifespan.startup.failed", answer
    return answer["message"], events


@pytest.mark.postgres
async def test_postgres_without_the_table_fails_startup_naming_the_fix(empty_pg: str) -> None:
    message, events = await _startup_failure(empty_pg)
    assert "idempotency_records table does not exist" in message
    assert FIX in message
    assert events == ["app startup", "app shutdown"]  # the app's own clean-up ran


@pytest.mark.postgres
async def test_postgres_table_without_the_migration_head_fails_startup(empty_pg: str) -> None:
    await _table_only(empty_pg)
    message, _ = await _startup_failure(empty_pg)
    assert "idempotency_records" in message
    assert VERSION_TABLE in message
    assert FIX in message


@pytest.mark.postgres
async def test_postgres_after_migrate_starts_and_serves(empty_pg: str) -> None:
    await _table_only(empty_pg)  # a table the migrations did not make: migrate adopts it
    await asyncio.to_thread(migrate, empty_pg)
    store = SQLStore(empty_pg)
    app = guarded_app(store)
    try:
        answer, stop = await start(app)
        assert answer["type"] == "lifespan.startup.complete", answer
        async with client(app) as c:
            r = await c.post("/pay", json={}, headers={"Idempotency-Key": "k"})
        await stop()
    finally:
        await store.close()
    assert r.status_code == 201, r.text


@pytest.mark.postgres
async def test_postgres_without_lifespan_answers_503_naming_the_fix_and_logs_once(
    empty_pg: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = SQLStore(empty_pg)
    caplog.set_level(logging.ERROR, logger="asgi_idempotency")
    try:
        async with client(guarded_app(store, retry_after=0.2)) as c:
            answers = [
                await c.post("/pay", json={}, headers={"Idempotency-Key": f"k{i}"})
                for i in range(5)
            ]
            await asyncio.sleep(0.3)  # past retry_after: the next request checks again
            await asyncio.to_thread(migrate, empty_pg)
            healed = await c.post("/pay", json={}, headers={"Idempotency-Key": "k"})
    finally:
        await store.close()
    for r in answers:
        assert r.status_code == 503
        assert r.headers["content-type"] == "application/problem+json"
        assert "retry-after" in r.headers
        detail = r.json()["detail"]
        assert "idempotency_records table does not exist" in detail
        assert FIX in detail
    logged = [rec for rec in caplog.records if "idempotency.not_ready" in rec.getMessage()]
    assert len(logged) == 1, [rec.getMessage() for rec in logged]
    assert FIX in logged[0].getMessage()
    assert healed.status_code == 201, healed.text  # migrating heals a running app


@pytest.mark.postgres
async def test_postgres_unreachable_at_startup_does_not_stop_the_app(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = SQLStore("postgresql+asyncpg://postgres@127.0.0.1:9/x", command_timeout=2)
    caplog.set_level(logging.ERROR, logger="asgi_idempotency")
    app = guarded_app(store)
    try:
        answer, stop = await start(app)
        async with client(app) as c:
            r = await c.post("/pay", json={}, headers={"Idempotency-Key": "k"})
        await stop()
    finally:
        await store.close()
    assert answer["type"] == "lifespan.startup.complete"  # an outage is not a deployment error
    assert r.status_code == 503
    assert any("idempotency.not_ready" in rec.getMessage() for rec in caplog.records)


@pytest.mark.postgres
async def test_the_check_costs_nothing_once_passed(pg_url: str) -> None:
    store = SQLStore(pg_url)
    calls = 0
    real = store.prepare

    async def counting() -> None:
        nonlocal calls
        calls += 1
        await real()

    store.prepare = counting  # type: ignore[method-assign]
    try:
        app = guarded_app(store)
        answer, stop = await start(app)
        assert answer["type"] == "lifespan.startup.complete"
        async with client(app) as c:
            for i in range(3):
                r = await c.post("/pay", json={}, headers={"Idempotency-Key": f"c{i}-{id(c)}"})
                assert r.status_code == 201, r.text
        await stop()
    finally:
        await store.close()
    assert calls == 1


@pytest.mark.postgres
async def test_migrate_refuses_a_foreign_table_of_the_same_name(empty_pg: str) -> None:
    from sqlalchemy import text

    engine = create_async_engine(empty_pg)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE idempotency_records (id integer PRIMARY KEY)"))
    finally:
        await engine.dispose()
    done = await asyncio.to_thread(
        subprocess.run,
        [str(SCRIPT), "migrate", "--database-url", empty_pg],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    assert "was not created by these migrations" in done.stderr
    assert "Traceback" not in done.stderr


async def test_a_burst_of_first_requests_shares_one_check(tmp_path: Path) -> None:
    store = SQLStore(f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}")
    calls = 0
    real = store.prepare

    async def slow() -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.2)  # every request of the burst arrives during the check
        await real()

    store.prepare = slow  # type: ignore[method-assign]
    try:
        async with client(guarded_app(store)) as c:
            answers = await asyncio.gather(
                *(c.post("/pay", json={}, headers={"Idempotency-Key": f"b{i}"}) for i in range(10))
            )
    finally:
        await store.close()
    assert [r.status_code for r in answers] == [201] * 10
    assert calls == 1

"""Transactional mode: the handler's writes and the record commit together, or neither does."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event, func, insert, select, text
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy, SQLStore, idempotent
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.integrations.transactional import get_connection, get_session
from asgi_idempotency.ops.demo import kill_after_write, refunds
from tests.apps import guarded
from tests.conftest import truncate
from tests.helpers.serving import run_uvicorn

pytestmark = [pytest.mark.anyio]

TX = Policy(required=True, transactional=True)
IDLE_IN_TRANSACTION = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE state LIKE 'idle in transaction%' AND datname = current_database()"
)


async def refund_rows(store: SQLStore) -> int:
    async with store.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(refunds))).scalar_one())


async def record_rows(store: SQLStore) -> list[Any]:
    async with store.engine.connect() as conn:
        return list(await conn.execute(text("SELECT status FROM idempotency_records")))


def tx_app(
    store: SQLStore,
    calls: list[str],
    failures: list[str] | None = None,
    *,
    entered: asyncio.Event | None = None,
    mode: Any = "enforce",
) -> Starlette:
    """``failures`` scripts how the next calls fail, so a retry can send the same body.

    ``entered`` is set by every call once it is inside the handler.
    """
    failures = failures if failures is not None else []

    async def refund(request: Request) -> Response:
        body = await request.json()
        body.setdefault("mode", failures.pop(0) if failures else "ok")
        calls.append(body["mode"])
        if entered is not None:
            entered.set()
        session = get_session(request)
        await session.execute(
            insert(refunds).values(id=f"r{len(calls)}", order_id="1", amount=body["amount"])
        )
        if body.get("mode") == "raise":
            raise RuntimeError("failed after writing")
        if body.get("mode") == "500":
            return JSONResponse({"error": "downstream"}, status_code=500)
        if body.get("mode") == "cut":
            # The database connection dies between the handler's write and the commit.
            pg = store.dialect == "postgresql"
            own_id = "SELECT pg_backend_pid()" if pg else "SELECT CONNECTION_ID()"
            pid = (await get_connection(request).execute(text(own_id))).scalar_one()
            async with store.engine.connect() as other:
                if pg:
                    await other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
                else:
                    await other.execute(text(f"KILL {int(pid)}"))
                await other.commit()
        if body.get("wait"):
            await asyncio.sleep(body["wait"])
        return JSONResponse({"refund": f"r{len(calls)}"}, status_code=201)

    return guarded(
        store,
        [Route("/refunds", refund, methods=["POST"])],
        policies={"POST /refunds": TX},
        mode=mode,
    )


def client(app: Starlette, **kw: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", **kw)


async def test_success_commits_the_write_and_the_record_together(tx_store: SQLStore) -> None:
    calls: list[str] = []
    async with client(tx_app(tx_store, calls)) as c:
        first = await c.post("/refunds", json={"amount": 5}, headers={"Idempotency-Key": "a"})
        again = await c.post("/refunds", json={"amount": 5}, headers={"Idempotency-Key": "a"})
        other = await c.post("/refunds", json={"amount": 6}, headers={"Idempotency-Key": "a"})
    assert first.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
    assert calls == ["ok"]
    assert await refund_rows(tx_store) == 1
    assert [r.status for r in await record_rows(tx_store)] == ["completed"]


@pytest.mark.parametrize("mode", ["raise", "500"])
async def test_failure_after_writing_leaves_nothing_and_the_retry_succeeds(
    tx_store: SQLStore, mode: str
) -> None:
    calls: list[str] = []
    key = {"Idempotency-Key": "b"}
    async with client(tx_app(tx_store, calls, failures=[mode])) as c:
        if mode == "raise":
            with pytest.raises(RuntimeError):
                await c.post("/refunds", json={"amount": 5}, headers=key)
        else:
            assert (await c.post("/refunds", json={"amount": 5}, headers=key)).status_code == 500
        assert await refund_rows(tx_store) == 0
        assert await record_rows(tx_store) == []
        retry = await c.post("/refunds", json={"amount": 5}, headers=key)
    assert retry.status_code == 201
    assert calls == [mode, "ok"]
    assert await refund_rows(tx_store) == 1


async def test_report_mode_runs_a_retry_whose_writes_commit_alone(tx_store: SQLStore) -> None:
    """Report mode: the retry of a completed key runs again (as unguarded), in a
    transaction of its own whose writes commit without touching the record."""
    calls: list[str] = []
    key = {"Idempotency-Key": "rep"}
    async with client(tx_app(tx_store, calls, mode="report")) as c:
        first = await c.post("/refunds", json={"amount": 5}, headers=key)
        again = await c.post("/refunds", json={"amount": 5}, headers=key)
    assert (first.status_code, again.status_code) == (201, 201)
    assert "idempotent-replayed" not in again.headers
    assert calls == ["ok", "ok"]
    assert await refund_rows(tx_store) == 2
    assert [r.status for r in await record_rows(tx_store)] == ["completed"]


async def test_connection_cut_mid_handler_rolls_back_and_answers_503(tx_store: SQLStore) -> None:
    calls: list[str] = []
    async with client(tx_app(tx_store, calls)) as c:
        cut = await c.post(
            "/refunds", json={"amount": 5, "mode": "cut"}, headers={"Idempotency-Key": "c"}
        )
        assert cut.status_code == 503
        assert cut.headers["content-type"] == "application/problem+json"
        assert await refund_rows(tx_store) == 0
        assert await record_rows(tx_store) == []
        retry = await c.post("/refunds", json={"amount": 5}, headers={"Idempotency-Key": "c"})
    assert retry.status_code == 201
    assert await refund_rows(tx_store) == 1


async def test_storm_never_waits_on_the_first_requests_lock(tx_store: SQLStore) -> None:
    calls: list[str] = []
    entered = asyncio.Event()
    async with client(tx_app(tx_store, calls, entered=entered)) as c:

        async def one() -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = await c.post(
                "/refunds", json={"amount": 5, "wait": 1.5}, headers={"Idempotency-Key": "s"}
            )
            return r, time.monotonic() - t0

        first = asyncio.create_task(one())
        await asyncio.wait_for(entered.wait(), 5)  # the first holds its claim, in its handler
        dups = await asyncio.gather(*(one() for _ in range(30)))
        mismatch = await c.post("/refunds", json={"amount": 6}, headers={"Idempotency-Key": "s"})
        winner, _ = await first
    assert winner.status_code == 201
    assert all(r.status_code == 409 for r, _ in dups)
    assert (
        max(elapsed for _, elapsed in dups) < 1.0
    )  # answered at once, not after the 1.5 s handler
    assert (
        mismatch.status_code == 409
    )  # a different body while in flight: its claim is not visible yet
    assert calls == ["ok"]
    assert await refund_rows(tx_store) == 1


async def test_round_trips_of_a_transactional_first_request(tx_store: SQLStore) -> None:
    """Postgres: BEGIN, claim (lock folded in), the handler's one insert, complete, COMMIT."""
    await tx_store.prepare()  # the one-time schema check, as lifespan startup would run it
    seen: list[str] = []
    sync_engine = tx_store.engine.sync_engine

    def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement.split()[0].upper())

    def on_begin(conn: Any) -> None:
        seen.append("BEGIN")

    def on_commit(conn: Any) -> None:
        seen.append("COMMIT")

    event.listen(sync_engine, "before_cursor_execute", on_execute)
    event.listen(sync_engine, "begin", on_begin)
    event.listen(sync_engine, "commit", on_commit)
    try:
        async with client(tx_app(tx_store, [])) as c:
            await c.post("/refunds", json={"amount": 5}, headers={"Idempotency-Key": "rt"})
            first = list(seen)
            seen.clear()
            await c.post("/refunds", json={"amount": 5}, headers={"Idempotency-Key": "rt"})
            replay = list(seen)
    finally:
        event.remove(sync_engine, "before_cursor_execute", on_execute)
        event.remove(sync_engine, "begin", on_begin)
        event.remove(sync_engine, "commit", on_commit)
    if tx_store.dialect == "postgresql":
        assert first == ["BEGIN", "WITH", "INSERT", "UPDATE", "COMMIT"]
        assert replay == ["BEGIN", "WITH"]  # then ROLLBACK as the connection returns to the pool
    else:
        # MariaDB: BEGIN sends nothing (the claim begins the transaction), and the claim
        # (SET STATEMENT ... FOR INSERT ... RETURNING) returns the row it met.
        assert first == ["BEGIN", "SET", "INSERT", "UPDATE", "COMMIT"]
        assert replay == ["BEGIN", "SET"]


def test_refused_at_start_up_on_other_stores() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await Response()(scope, receive, send)

    with pytest.raises(ValueError, match="needs SQLStore on Postgres"):
        IdempotencyMiddleware(
            app, store=MemoryStore(), principal=ANONYMOUS, policies={"POST /x": TX}
        )


async def test_decorated_transactional_route_fails_lifespan_startup_on_sqlite(
    sqlite_url: str,
) -> None:
    @idempotent(transactional=True)
    async def endpoint(request: Request) -> Response:
        return Response()

    store = SQLStore(sqlite_url)
    app = guarded(store, [Route("/x", endpoint, methods=["POST"])])
    sent: list[Message] = []
    messages = iter([{"type": "lifespan.startup"}])

    async def receive() -> Message:
        return next(messages)

    async def send(message: Message) -> None:
        sent.append(message)

    try:
        # Reported to the server, then raised, as Starlette's own failing startup does.
        with pytest.raises(ValueError, match="transactional"):
            await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    finally:
        await store.close()
    assert sent[0]["type"] == "lifespan.startup.failed"
    assert "needs SQLStore on Postgres" in sent[0]["message"]


async def _kill_after_write(tx_url: str, *, transactional: bool) -> tuple[int, int]:
    store = SQLStore(tx_url)
    await truncate(store)
    await store.close()
    return await kill_after_write(tx_url, transactional=transactional, say=lambda _: None)


@pytest.mark.slow
async def test_sigkill_after_write_transactional_leaves_nothing_and_retry_runs_once(
    tx_url: str, tmp_path: Path
) -> None:
    after_kill, final = await _kill_after_write(tx_url, transactional=True)
    assert after_kill == 0
    assert final == 1


@pytest.mark.slow
async def test_sigkill_after_write_default_mode_duplicates_after_the_lease(
    tx_url: str, tmp_path: Path
) -> None:
    after_kill, final = await _kill_after_write(tx_url, transactional=False)
    assert after_kill == 1  # the effect committed on its own
    assert final == 2  # the abandoned claim was taken over and the refund ran again


@pytest.mark.slow
async def test_transactional_storm_across_four_workers(tx_url: str, tmp_path: Path) -> None:
    store = SQLStore(tx_url)
    from tests.conftest import truncate

    await truncate(store)
    env = {"IDEMPOTENCY_DEMO_DATABASE_URL": tx_url, "IDEMPOTENCY_DEMO_TRANSACTIONAL": "1"}
    try:
        with run_uvicorn(
            "asgi_idempotency.ops.demo:app", env=env, log_dir=tmp_path, workers=4
        ) as server:
            async with httpx.AsyncClient(
                base_url=server.base_url, timeout=30, limits=httpx.Limits(max_connections=100)
            ) as c:

                async def one() -> httpx.Response:
                    return await c.post(
                        "/orders/3/refunds",
                        json={"amount": 1, "delay": 0.3},
                        headers={"Idempotency-Key": "tx-storm"},
                    )

                responses = await asyncio.gather(*(one() for _ in range(100)))
        statuses = Counter(r.status_code for r in responses)
        fresh = [
            r for r in responses if r.status_code == 201 and "idempotent-replayed" not in r.headers
        ]
        assert len(fresh) == 1, statuses
        assert set(statuses) <= {201, 409}, statuses
        assert await refund_rows(store) == 1
    finally:
        await store.close()

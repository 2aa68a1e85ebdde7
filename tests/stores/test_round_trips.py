"""Round trips per outcome, pinned (not timed): the store's cost model from DESIGN.md.

Postgres is counted on the wire, through a loopback proxy that reads the frontend
protocol (``tests.helpers.pgwire``): one ``Sync`` or simple ``Query`` is one round trip,
whatever the driver or SQLAlchemy do above it, BEGIN and COMMIT included. SQLite is
counted as calls to its connection thread (its round trip) and, through sqlite3's
trace hook, as the statements the library ran.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from asgi_idempotency import SQLStore
from tests.conftest import Tiny, TinyFactory
from tests.helpers import pgwire

pytestmark = pytest.mark.anyio


async def _drive(
    tiny_app: Tiny, reset: Callable[[], list[Any]], run: str = "a"
) -> dict[str, list[Any]]:
    """Run every outcome of DESIGN.md's table once; return what each cost.

    ``reset`` returns what was counted since its last call and starts afresh.
    """
    seen: dict[str, list[Any]] = {}
    key = {"Idempotency-Key": f"rt-{run}"}
    async with tiny_app.client() as c:

        async def measure(name: str, request: Any, status: int) -> None:
            reset()
            r = await request
            assert r.status_code == status, (name, r.status_code, r.text)
            await asyncio.sleep(0)  # let shielded completions and callbacks settle
            seen[name] = reset()

        await measure("fresh", c.post("/pay", json={"amount": 1}, headers=key), 201)
        await measure("replay", c.post("/pay", json={"amount": 1}, headers=key), 201)
        await measure("mismatch_422", c.post("/pay", json={"amount": 2}, headers=key), 422)
        fail_key = {"Idempotency-Key": f"rt-{run}-fail"}
        await measure("released_500", c.post("/fail/500", headers=fail_key), 500)
        await measure("unguarded_no_key", c.post("/pay", json={"amount": 1}), 201)
        await measure("unguarded_get", c.get("/pay"), 200)

        wait_key = {"Idempotency-Key": f"rt-{run}-wait"}
        first = asyncio.create_task(c.post("/pay", json={"wait": True}, headers=wait_key))
        await asyncio.wait_for(tiny_app.entered.wait(), 5)  # the first is inside its handler
        await measure("in_flight_409", c.post("/pay", json={"wait": True}, headers=wait_key), 409)
        tiny_app.gate.set()
        assert (await first).status_code == 201
    return seen


@pytest.fixture
async def wire(pg_url: str) -> AsyncIterator[pgwire.WireCounter]:
    url = make_url(pg_url)
    async with pgwire.WireCounter(url.host or "127.0.0.1", url.port or 5432) as counter:
        yield counter


def _proxied(pg_url: str, port: int) -> str:
    url = make_url(pg_url).set(host="127.0.0.1", port=port, query={"ssl": "disable"})
    return url.render_as_string(hide_password=False)


@pytest.mark.postgres
@pytest.mark.parametrize("batching", [False, True], ids=["per-request", "batched"])
async def test_postgres_round_trips_per_outcome(
    pg_url: str, pg_store: SQLStore, wire: pgwire.WireCounter, tiny: TinyFactory, batching: bool
) -> None:
    # pg_store empties the tables; the store under test talks through the proxy, with
    # one pooled connection so that its statements are prepared once, in the warm-up.
    # Batched, one request at a time is a batch of one: the same one-row statements.
    store = SQLStore(_proxied(pg_url, wire.port), pool_size=1, batching=batching)
    try:
        await _drive(tiny(store), wire.reset, "warm-up")  # connect, introspect, prepare
        seen = await _drive(tiny(store), wire.reset, "counted")
    finally:
        await store.close()

    trips = {name: len(rts) for name, rts in seen.items()}
    verbs = {name: [rt.verbs for rt in rts] for name, rts in seen.items()}
    assert trips == {
        "fresh": 2,
        "replay": 1,
        "mismatch_422": 1,
        "released_500": 2,
        "unguarded_no_key": 0,
        "unguarded_get": 0,
        "in_flight_409": 1,
    }, verbs
    assert verbs["fresh"] == [["WITH"], ["UPDATE"]]  # claim, complete
    assert verbs["released_500"] == [["WITH"], ["DELETE"]]  # claim, release
    for name in ("replay", "mismatch_422", "in_flight_409"):
        assert verbs[name] == [["WITH"]], name  # the claim returns the row in the way
    every = [rt for rts in seen.values() for rt in rts]
    assert not any(v in ("BEGIN", "COMMIT", "ROLLBACK") for rt in every for v in rt.verbs)
    assert not any(rt.prepared for rt in every)  # prepared once per connection, then reused
    assert all(len(rt.executed) == 1 for rt in every)  # one statement per round trip


@pytest.mark.postgres
async def test_the_wire_counter_sees_transactions(pg_url: str, wire: pgwire.WireCounter) -> None:
    """The counter is not blind to what the budget forbids: Core's BEGIN/COMMIT show up."""
    store = SQLStore(_proxied(pg_url, wire.port), pool_size=1)
    try:
        async with store.engine.begin() as conn:
            await conn.execute(text("SELECT 1"))
        wire.reset()
        async with store.engine.begin() as conn:
            await conn.execute(text("SELECT 1"))
        verbs = [v for rt in wire.reset() for v in rt.verbs]
    finally:
        await store.close()
    assert verbs == ["BEGIN", "SELECT", "COMMIT"]


async def test_sqlite_round_trips_per_outcome(sqlite_url: str, tiny: TinyFactory) -> None:
    """SQLite: one call to the connection thread per operation; a replay runs two statements."""
    store = SQLStore(sqlite_url)
    hops: list[str] = []
    statements: list[str] = []
    try:
        driver = await store._driver._connection()  # type: ignore[attr-defined]  # SQLiteDriver's
        raw_execute = driver._execute

        async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            hops.append(fn.__name__)
            return await raw_execute(fn, *args, **kwargs)

        await raw_execute(driver._conn.set_trace_callback, statements.append)
        driver._execute = counted

        def reset() -> list[Any]:
            out = [(list(hops), [s.split(None, 1)[0].upper() for s in statements])]
            hops.clear()
            statements.clear()
            return out

        seen = await _drive(tiny(store), reset)
    finally:
        await store.close()

    assert seen == {
        "fresh": [(["_sqlite_claim", "_sqlite_rowcount"], ["INSERT", "UPDATE"])],
        "replay": [(["_sqlite_claim"], ["INSERT", "SELECT"])],
        "mismatch_422": [(["_sqlite_claim"], ["INSERT", "SELECT"])],
        "released_500": [(["_sqlite_claim", "_sqlite_rowcount"], ["INSERT", "DELETE"])],
        "unguarded_no_key": [([], [])],
        "unguarded_get": [([], [])],
        "in_flight_409": [(["_sqlite_claim"], ["INSERT", "SELECT"])],
    }

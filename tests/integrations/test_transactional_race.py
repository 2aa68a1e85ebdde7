"""Transactional claims against a rival whose commit lands inside the claim statement
(Postgres), and against a rival holding the key's row (MariaDB).

The interleaving of the issue, driven rather than hoped for: a claim statement takes
its snapshot, a rival's write to the same key commits, and only then does the claim's
``INSERT ... ON CONFLICT`` meet the rival's row. The rival here is a raw asyncpg
connection that writes the key's row (the first run's writes beside it) in a
transaction it holds open. It takes no advisory lock, so the claim statement takes
its snapshot and the lock, then waits, as every insert does, for the transaction
that holds an uncommitted row with its key. The test sees that wait in ``pg_locks``,
commits the rival, and the claim resumes: its conflict check sees the committed row,
its snapshot does not. A rival transactional claim that commits between another's
snapshot and its lock leaves that claim in the same place; the wait only holds the
moment open for as long as the test needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy import event, insert
from sqlalchemy.engine import make_url

from asgi_idempotency import SQLStore, StoredResponse
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.ops.demo import refunds
from tests.conftest import truncate
from tests.integrations.test_transactional import client, refund_rows, tx_app

pytestmark = [pytest.mark.anyio]

KEY = {"Idempotency-Key": "race"}
BODY = {"amount": 5}
RIVAL_TOKEN = "a" * 32
COLUMNS = (
    "key, request_hash, status, token, created_at, locked_until, expires_at,"
    " response_status, response_headers, response_body"
)


def _dsn(pg_url: str) -> str:
    return make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
async def rival(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of its own, outside the store's pool: the other writer."""
    conn = await asyncpg.connect(_dsn(pg_url))
    try:
        yield conn
    finally:
        await conn.close()


async def _probe(
    store: SQLStore, rival: asyncpg.Connection
) -> tuple[httpx.Response, asyncpg.Record]:
    """The request's own stored row (its scoped key, fingerprint and response), by running
    it once; then both tables are emptied for the race."""
    async with client(tx_app(store, [])) as c:
        first = await c.post("/refunds", json=BODY, headers=KEY)
    assert first.status_code == 201
    row = await rival.fetchrow(f"SELECT {COLUMNS} FROM idempotency_records")
    assert row is not None
    await truncate(store)
    return first, row


@contextmanager
def _statements(store: SQLStore) -> Iterator[list[str]]:
    """The first word of every statement the store's engine runs meanwhile."""
    seen: list[str] = []

    def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement.split()[0].upper())

    sync_engine = store.engine.sync_engine
    event.listen(sync_engine, "before_cursor_execute", on_execute)
    try:
        yield seen
    finally:
        event.remove(sync_engine, "before_cursor_execute", on_execute)


async def _while_waited_on(rival: asyncpg.Connection, request: Awaitable[Any]) -> Any:
    """Start ``request``; once a backend waits for ``rival``'s open transaction, commit
    it; return what ``request`` answers."""
    task = asyncio.ensure_future(request)
    pid = rival.get_server_pid()
    waited_on = (
        "SELECT count(*) > 0 FROM pg_locks WHERE NOT granted AND $1 = ANY(pg_blocking_pids(pid))"
    )
    try:
        async with asyncio.timeout(10):
            while not await rival.fetchval(waited_on, pid):
                assert not task.done(), "the claim did not wait for the rival's row"
                await asyncio.sleep(0.005)
    except BaseException:
        task.cancel()
        raise
    await rival.execute("COMMIT")
    return await task


def _rival_row(probe: asyncpg.Record, status: str) -> tuple[Any, ...]:
    """The probe's row as a rival's: its own token, a live lease, in progress or completed."""
    now = datetime.now(UTC)
    completed = status == "completed"
    return (
        probe["key"],
        probe["request_hash"],
        status,
        RIVAL_TOKEN,
        now,
        now + timedelta(hours=1),
        now + timedelta(days=1),
        probe["response_status"] if completed else None,
        probe["response_headers"] if completed else None,
        probe["response_body"] if completed else None,
    )


async def _first_run_writes(rival: asyncpg.Connection) -> None:
    await rival.execute("INSERT INTO demo_refunds (id, order_id, amount) VALUES ('first', '1', 5)")


async def _assert_not_run_again(
    store: SQLStore, answer: httpx.Response, first: httpx.Response, status: str, calls: list[str]
) -> None:
    """The claim saw the rival's row: 409 while it runs, its replay once it completed; the
    handler did not run, and the first run's writes are the only ones."""
    seen = {
        "handler runs": len(calls),
        "refund rows": await refund_rows(store),
        "status": answer.status_code,
        "replayed": answer.headers.get("idempotent-replayed"),
    }
    if status == "in_progress":
        assert seen == {"handler runs": 0, "refund rows": 1, "status": 409, "replayed": None}
    else:
        assert seen == {
            "handler runs": 0, "refund rows": 1, "status": first.status_code, "replayed": "true"
        }  # fmt: skip
        assert answer.content == first.content


@pytest.mark.postgres
@pytest.mark.parametrize("status", ["in_progress", "completed"])
async def test_a_rival_insert_committed_after_the_claims_snapshot_is_seen(
    pg_store: SQLStore, rival: asyncpg.Connection, status: str
) -> None:
    """The rival inserts the key's row: the claim's snapshot has no row, its insert a conflict."""
    first, probe = await _probe(pg_store, rival)
    await rival.execute("BEGIN")
    await rival.execute(
        f"INSERT INTO idempotency_records ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8,"
        " $9, $10)",
        *_rival_row(probe, status),
    )
    await _first_run_writes(rival)
    calls: list[str] = []
    async with client(tx_app(pg_store, calls)) as c:
        with _statements(pg_store) as statements:
            answer = await _while_waited_on(rival, c.post("/refunds", json=BODY, headers=KEY))
    await _assert_not_run_again(pg_store, answer, first, status, calls)
    assert statements == ["WITH", "WITH"]  # the claim, asked again once: no other cost


@pytest.mark.postgres
@pytest.mark.parametrize("status", ["in_progress", "completed"])
async def test_a_rival_take_over_committed_after_the_claims_snapshot_is_seen(
    pg_store: SQLStore, rival: asyncpg.Connection, status: str
) -> None:
    """The key's row has expired; the rival takes it over: the claim's snapshot holds the
    expired row, which the claim would take over in turn on the rival's."""
    first, probe = await _probe(pg_store, rival)
    expired = datetime.now(UTC) - timedelta(seconds=1)
    await rival.execute(
        f"INSERT INTO idempotency_records ({COLUMNS}) VALUES ($1, $2, 'completed', $3, $4, $4,"
        " $4, $5, $6, $7)",
        probe["key"], probe["request_hash"], probe["token"], expired,
        probe["response_status"], probe["response_headers"], probe["response_body"],
    )  # fmt: skip
    row = _rival_row(probe, status)
    await rival.execute("BEGIN")
    await rival.execute(
        "UPDATE idempotency_records SET status = $2, token = $3, created_at = $4,"
        " locked_until = $5, expires_at = $6, response_status = $7, response_headers = $8,"
        " response_body = $9 WHERE key = $1",
        row[0], *row[2:],
    )  # fmt: skip
    await _first_run_writes(rival)
    calls: list[str] = []
    async with client(tx_app(pg_store, calls)) as c:
        with _statements(pg_store) as statements:
            answer = await _while_waited_on(rival, c.post("/refunds", json=BODY, headers=KEY))
    await _assert_not_run_again(pg_store, answer, first, status, calls)
    assert statements == ["WITH", "UPDATE", "WITH"]  # claim, failed swap, claim again


@pytest.mark.postgres
@pytest.mark.parametrize("row", ["the rival's", "none"])
async def test_commit_refuses_when_the_record_is_not_its_claim(
    pg_store: SQLStore, rival: asyncpg.Connection, row: str
) -> None:
    """A transaction whose claim is not the row must not commit the handler's writes.

    A claim that holds its row keeps it locked until it commits, so no other
    connection can take it away; only a claim answered wrongly (the defect above)
    reaches the commit without its row. That is what this stages: the rival's claim
    committed first, or no row at all, and a commit in the name of a token that
    never won it.
    """
    key = "k" * 64
    now = datetime.now(UTC)
    if row == "the rival's":
        await rival.execute(
            f"INSERT INTO idempotency_records ({COLUMNS}) VALUES ($1, 'h', 'in_progress', $2,"
            " $3, $4, $5, NULL, NULL, NULL)",
            key, RIVAL_TOKEN, now, now + timedelta(hours=1), now + timedelta(days=1),
        )  # fmt: skip
    async with pg_store.transaction() as tx:
        await tx.state.session.execute(insert(refunds).values(id="second", order_id="1", amount=5))
        with pytest.raises(StoreError):
            await tx.commit(
                key, "b" * 32, StoredResponse(201, (), b"{}"), now=now, ttl=timedelta(days=1)
            )
    assert await refund_rows(pg_store) == 0
    left = [tuple(r) for r in await rival.fetch("SELECT token, status FROM idempotency_records")]
    assert left == ([(RIVAL_TOKEN, "in_progress")] if row == "the rival's" else [])


# MariaDB. The claim never waits for a rival (mariadb.py): a row another transaction
# holds, inserted or taken over and not committed yet, answers 409 at once, and once
# the rival commits, the claim sees its row. The rival is a raw asyncmy connection.


@pytest.fixture
async def mrival(mariadb_url: str) -> AsyncIterator[Any]:
    """A MariaDB connection of its own, outside the store's pool, in a transaction."""
    import asyncmy

    u = make_url(mariadb_url)
    conn = await asyncmy.connect(
        host=u.host, port=u.port or 3306, user=u.username, password=u.password or "",
        database=u.database, autocommit=False,
    )  # fmt: skip
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
async def mstore(mariadb_url: str) -> AsyncIterator[SQLStore]:
    from tests.conftest import emptied

    async with emptied(SQLStore(mariadb_url)) as store:
        yield store


async def _m(rival: Any, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    async with rival.cursor() as cur:
        await cur.execute(sql, args)
        return list(await cur.fetchall())


async def _mprobe(store: SQLStore, rival: Any) -> tuple[httpx.Response, tuple[Any, ...]]:
    async with client(tx_app(store, [])) as c:
        first = await c.post("/refunds", json=BODY, headers=KEY)
    assert first.status_code == 201
    [row] = await _m(rival, f"SELECT {MCOLUMNS} FROM idempotency_records")
    await rival.commit()  # ends the read's snapshot
    await truncate(store)
    return first, row


def _mrow(probe: tuple[Any, ...], status: str) -> tuple[Any, ...]:
    now = datetime.now(UTC).replace(tzinfo=None)  # DATETIME(6) in UTC
    completed = status == "completed"
    return (
        probe[0], probe[1], status, RIVAL_TOKEN, now,
        now + timedelta(hours=1), now + timedelta(days=1),
        *(probe[7:] if completed else (None, None, None)),
    )  # fmt: skip


MCOLUMNS = COLUMNS.replace("key,", "`key`,", 1)  # a reserved word in MariaDB
_MINSERT = f"INSERT INTO idempotency_records ({MCOLUMNS}) VALUES ({', '.join(['%s'] * 10)})"


@pytest.mark.mariadb
@pytest.mark.parametrize("status", ["in_progress", "completed"])
@pytest.mark.parametrize("rival_write", ["insert", "take-over"])
async def test_mariadb_a_rival_holding_the_row_answers_409_at_once_then_its_row(
    mstore: SQLStore, mrival: Any, status: str, rival_write: str
) -> None:
    first, probe = await _mprobe(mstore, mrival)
    row = _mrow(probe, status)
    if rival_write == "take-over":
        expired = datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=1)
        await _m(mrival, _MINSERT, *probe[:4], expired, expired, expired, *probe[7:])
        await mrival.commit()
        await _m(
            mrival,
            "UPDATE idempotency_records SET status = %s, token = %s, created_at = %s,"
            " locked_until = %s, expires_at = %s, response_status = %s, response_headers = %s,"
            " response_body = %s WHERE `key` = %s",
            *row[2:], row[0],
        )  # fmt: skip
    else:
        await _m(mrival, _MINSERT, *row)
    await _m(mrival, "INSERT INTO demo_refunds (id, order_id, amount) VALUES ('first', '1', 5)")
    calls: list[str] = []
    async with client(tx_app(mstore, calls)) as c:
        started = asyncio.get_running_loop().time()
        held = await c.post("/refunds", json=BODY, headers=KEY)
        waited = asyncio.get_running_loop().time() - started
        await mrival.commit()
        after = await c.post("/refunds", json=BODY, headers=KEY)
    # Not after the session's lock wait (command_timeout, 5 s): the claim waits for nothing.
    assert (held.status_code, calls) == (409, [])
    assert waited < 2.0
    await _assert_not_run_again(mstore, after, first, status, calls)


@pytest.mark.mariadb
@pytest.mark.parametrize("row", ["the rival's", "none"])
async def test_mariadb_commit_refuses_when_the_record_is_not_its_claim(
    mstore: SQLStore, mrival: Any, row: str
) -> None:
    """As on Postgres: a commit in the name of a token that does not own the row
    rolls the handler's writes back."""
    key = "k" * 64
    now = datetime.now(UTC)
    if row == "the rival's":
        naive = now.replace(tzinfo=None)
        await _m(
            mrival, _MINSERT, key, "h", "in_progress", RIVAL_TOKEN, naive,
            naive + timedelta(hours=1), naive + timedelta(days=1), None, None, None,
        )  # fmt: skip
        await mrival.commit()
    async with mstore.transaction() as tx:
        await tx.state.session.execute(insert(refunds).values(id="second", order_id="1", amount=5))
        with pytest.raises(StoreError):
            await tx.commit(
                key, "b" * 32, StoredResponse(201, (), b"{}"), now=now, ttl=timedelta(days=1)
            )
    assert await refund_rows(mstore) == 0
    left = await _m(mrival, "SELECT token, status FROM idempotency_records")
    assert left == ([(RIVAL_TOKEN, "in_progress")] if row == "the rival's" else [])

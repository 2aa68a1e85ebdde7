"""MariaDB (and MySQL) through SQLStore: what the contract suite does not pin down.

The contract suite runs on MariaDB through the ``store`` fixture; here are the
dialect's own promises: the URLs, the schema that migrations build (equal to the
one ``create_all`` builds, types included), round trips on the wire, values
INSERT IGNORE would have truncated, and the server-side timeouts that turn a
blocked statement into a 503 that never commits afterwards.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import httpx
import pytest
from sqlalchemy import text

from asgi_idempotency import SQLStore, StoredResponse
from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.errors import SchemaMissing, StoreError
from asgi_idempotency.core.lifecycle import ClaimOutcome
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.ops import cli
from asgi_idempotency.stores.base import NewClaim
from asgi_idempotency.stores.sql.mysql import MySQLDriver
from tests.conftest import MariaDBServer, TinyFactory, emptied
from tests.reliability.support import TcpProxy
from tests.stores.test_round_trips import _drive

pytestmark = [pytest.mark.anyio, pytest.mark.mariadb]

T0 = datetime(2026, 12, 4, 12, 0, 0, 123456, tzinfo=UTC)  # microseconds on purpose
LEASE = timedelta(seconds=30)
TTL = timedelta(hours=24)


def tok() -> str:
    return uuid.uuid4().hex


@pytest.fixture
async def mstore(mariadb_url: str) -> AsyncIterator[SQLStore]:
    async with emptied(SQLStore(mariadb_url)) as store:
        yield store


@pytest.fixture
def empty_db(mariadb_server: MariaDBServer) -> Iterator[str]:
    with mariadb_server.database("idem_empty") as url:
        yield url


def _create_table(server: MariaDBServer, url: str) -> str:
    name = url.rsplit("/", 1)[1]
    [(_, ddl)] = server._run("SHOW CREATE TABLE idempotency_records", database=name)
    return str(ddl)


async def test_migrate_builds_the_schema_create_all_builds(
    mariadb_server: MariaDBServer,
    mariadb_url: str,
    empty_db: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The mysql+asyncmy spelling, as an operator would type it, on a MariaDB server.
    mysql_url = empty_db.replace("mariadb+asyncmy://", "mysql+asyncmy://")
    assert await asyncio.to_thread(cli.main, ["migrate", "--database-url", mysql_url]) == 0
    migrated = _create_table(mariadb_server, empty_db)
    assert migrated == _create_table(mariadb_server, mariadb_url)  # create_all's
    # What alembic's type comparison does not look at (fractional seconds), pinned.
    for column in ("created_at", "locked_until", "expires_at"):
        assert f"`{column}` datetime(6) NOT NULL" in migrated
    for column, width in (("key", 64), ("request_hash", 64), ("token", 32)):
        assert f"`{column}` char({width}) CHARACTER SET ascii COLLATE ascii_bin NOT NULL" in (
            migrated
        )
    assert "`response_body` longblob" in migrated
    store = SQLStore(mysql_url)
    try:
        assert store.dialect == "mysql"
        await store.prepare()  # the table and the head are there: nothing to say
    finally:
        await store.close()


async def test_prepare_on_an_unmigrated_database_names_the_fix(empty_db: str) -> None:
    store = SQLStore(empty_db)
    try:
        with pytest.raises(SchemaMissing, match="asgi-idempotency migrate") as caught:
            await store.prepare()
    finally:
        await store.close()
    assert "On MariaDB/MySQL the schema is the operator's" in str(caught.value)


@pytest.mark.parametrize("scheme", ["mariadb+asyncmy", "mysql+asyncmy", "mariadb", "mysql"])
async def test_both_spellings_serve_and_set_the_server_side_limits(
    mariadb_server: MariaDBServer, mariadb_url: str, scheme: str
) -> None:
    name = mariadb_url.rsplit("/", 1)[1]
    store = SQLStore(mariadb_server.url(name, scheme=scheme), command_timeout=2.5)
    try:
        assert store.dialect == ("mariadb" if scheme.startswith("mariadb") else "mysql")
        async with store.engine.connect() as conn:
            limits = (
                await conn.execute(text("SELECT @@max_statement_time, @@innodb_lock_wait_timeout"))
            ).one()
        assert (float(limits[0]), int(limits[1])) == (2.5, 3)
        key = f"spelling-{scheme}"
        t = tok()
        claimed = await lifecycle.claim(store, key, "h", t, now=T0, lease=LEASE, ttl=TTL)
        assert claimed.outcome is ClaimOutcome.CLAIMED
        assert await store.release(key, t)
        reason = store.transactions_unavailable
        if store.dialect == "mariadb":  # transactional mode: MariaDB's URLs only
            assert reason is None
        else:
            assert reason is not None
            assert store.dialect in reason
    finally:
        await store.close()


async def test_microseconds_and_large_bodies_survive(mstore: SQLStore) -> None:
    key, t = "m" * 64, tok()
    lease = LEASE + timedelta(microseconds=7)  # the server adds it to its own time
    await lifecycle.claim(mstore, key, "h", t, now=T0, lease=lease, ttl=TTL)
    seen = await mstore.get(key)
    assert seen is not None
    assert seen.locked_until - seen.created_at == lease
    # The take-over's compare-and-swap matches the lease to the microsecond.
    later = T0 + LEASE + timedelta(microseconds=1)
    taker = NewClaim(key, "h", tok(), later, LEASE, TTL)
    assert await mstore.replace(seen, taker)
    body = bytes(range(256)) * 8192  # 2 MiB: past BLOB's 64 KiB
    response = StoredResponse(201, ((b"content-type", b"application/octet-stream"),), body)
    assert await mstore.complete(key, taker.token, response, now=later, ttl=TTL)
    stored = await mstore.get(key)
    assert stored is not None
    assert stored.response == response


@pytest.mark.parametrize(
    ("key", "request_hash", "token"),
    [
        ("k" * 65, "h", "t" * 32),
        ("k" * 64, "h" * 65, "t"),
        ("k", "h", "t" * 33),
        ("k\u00e9", "h", "t"),
    ],
)
async def test_what_insert_ignore_would_truncate_is_refused(
    mstore: SQLStore, key: str, request_hash: str, token: str
) -> None:
    with pytest.raises(StoreError, match="at most"):
        await lifecycle.claim(mstore, key, request_hash, token, now=T0, lease=LEASE, ttl=TTL)
    async with mstore.engine.connect() as conn:
        count = (await conn.execute(text("SELECT COUNT(*) FROM idempotency_records"))).scalar()
    assert count == 0


async def test_a_statement_blocked_on_a_row_lock_is_a_store_error_and_never_commits(
    mariadb_url: str, mstore: SQLStore
) -> None:
    key, owner = "l" * 64, tok()
    await lifecycle.claim(mstore, key, "h", owner, now=T0, lease=LEASE, ttl=TTL)
    impatient = SQLStore(mariadb_url, command_timeout=0.5)
    blocker = await mstore.engine.connect()
    try:
        await blocker.begin()
        await blocker.execute(
            text("SELECT 1 FROM idempotency_records WHERE `key` = :k FOR UPDATE"), {"k": key}
        )
        started = time.monotonic()
        with pytest.raises(StoreError) as caught:
            await impatient.renew(key, owner, now=T0, lease=2 * LEASE)
        waited = time.monotonic() - started
        # The server gave up by itself (max_statement_time, under the 1 s lock wait
        # timeout and the client's 1.5 s read timeout): the connection is still good.
        assert waited < 1.4, waited
        assert "max_statement_time" in str(caught.value)
        assert "'" + key not in str(caught.value)
        await blocker.rollback()
        assert await impatient.renew(key, owner, now=T0, lease=3 * LEASE)
    finally:
        await blocker.close()
        await impatient.close()
    record = await mstore.get(key)
    assert record is not None
    assert record.read_at is not None
    # The last renewal's lease, on the server's clock: the abandoned one never landed.
    assert record.locked_until - record.read_at > 2.5 * LEASE


async def test_an_unreachable_server_is_a_store_error(refused_url: str) -> None:
    port = refused_url.rsplit(":", 1)[1]
    store = SQLStore(f"mariadb+asyncmy://root@127.0.0.1:{port}/nowhere", command_timeout=1)
    try:
        with pytest.raises(StoreError):
            await lifecycle.claim(store, "k", "h", tok(), now=T0, lease=LEASE, ttl=TTL)
    finally:
        await store.close()


async def test_round_trips_per_outcome(
    mariadb_url: str, mstore: SQLStore, tiny: TinyFactory
) -> None:
    """On the wire: one statement per round trip; the claim returns the row in its way
    from the same statement (INSERT ... ON DUPLICATE KEY UPDATE ... RETURNING)."""
    proxy = TcpProxy("127.0.0.1", 3306)
    store = SQLStore(proxy.url_for(mariadb_url), pool_size=1)

    def reset() -> list[int]:
        trips, proxy.round_trips = proxy.round_trips, 0
        return [trips]

    try:
        await _drive(tiny(store), reset, "warm-up")  # connect, autocommit on, prepare
        seen = await _drive(tiny(store), reset, "counted")
    finally:
        await store.close()
        proxy.close()
    assert {name: trips for name, [trips] in seen.items()} == {
        "fresh": 2,  # INSERT (returning the row inserted), UPDATE
        "replay": 1,  # INSERT (returning the row in the way)
        "mismatch_422": 1,
        "released_500": 2,  # INSERT, DELETE
        "unguarded_no_key": 0,
        "unguarded_get": 0,
        "in_flight_409": 1,
    }


async def test_round_trips_on_a_mysql_url_keep_insert_ignore_then_select(
    mariadb_server: MariaDBServer, mariadb_url: str, mstore: SQLStore, tiny: TinyFactory
) -> None:
    """A mysql+asyncmy:// URL speaks what MySQL has: INSERT IGNORE, then SELECT when in the way."""
    proxy = TcpProxy("127.0.0.1", 3306)
    mysql_url = mariadb_url.replace("mariadb+asyncmy://", "mysql+asyncmy://", 1)
    store = SQLStore(proxy.url_for(mysql_url), pool_size=1)

    def reset() -> list[int]:
        trips, proxy.round_trips = proxy.round_trips, 0
        return [trips]

    try:
        await _drive(tiny(store), reset, "warm-up")
        seen = await _drive(tiny(store), reset, "counted")
    finally:
        await store.close()
        proxy.close()
    assert {name: trips for name, [trips] in seen.items()} == {
        "fresh": 2, "replay": 2, "mismatch_422": 2, "released_500": 2,
        "unguarded_no_key": 0, "unguarded_get": 0, "in_flight_409": 2,
    }  # fmt: skip


async def test_hot_path_connections_never_go_back_to_the_pool_in_autocommit(
    mariadb_url: str,
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.pool import AsyncAdaptedQueuePool

    engine = create_async_engine(mariadb_url, poolclass=AsyncAdaptedQueuePool, pool_size=2)
    store = SQLStore(engine)  # the caller's engine: the pool outlives the store
    try:
        key, t = "p" * 64, tok()
        await lifecycle.claim(store, key, "h", t, now=T0, lease=LEASE, ttl=TTL)
        await store.close()
        async with engine.connect() as conn:
            await conn.execute(text("DELETE FROM idempotency_records WHERE `key` = :k"), {"k": key})
            await conn.rollback()  # a pooled autocommit connection would have deleted it
            left = (
                await conn.execute(
                    text("SELECT COUNT(*) FROM idempotency_records WHERE `key` = :k"), {"k": key}
                )
            ).scalar()
            await conn.execute(text("DELETE FROM idempotency_records WHERE `key` = :k"), {"k": key})
            await conn.commit()
        assert left == 1
    finally:
        await engine.dispose()


async def test_a_deadlock_is_a_store_error(mariadb_url: str, mstore: SQLStore) -> None:
    """InnoDB's own example: two inserts wait on a third's uncommitted row, which rolls back.

    Both then hold a shared lock on the key and want an exclusive one: InnoDB kills
    one (1213). That claim is a StoreError (the client gets 503 and retries); the
    other claims the key.
    """
    key = "d" * 64
    stores = [SQLStore(mariadb_url) for _ in range(2)]
    blocker = await mstore.engine.connect()
    try:
        await blocker.begin()
        await blocker.execute(
            text(
                "INSERT INTO idempotency_records (`key`, request_hash, status, token, created_at,"
                " locked_until, expires_at) VALUES (:k, 'h', 'in_progress', 't', :t, :t, :t)"
            ),
            {"k": key, "t": T0.replace(tzinfo=None)},
        )

        async def one(store: SQLStore) -> lifecycle.Claim:
            return await lifecycle.claim(store, key, "h", tok(), now=T0, lease=LEASE, ttl=TTL)

        racers = [asyncio.create_task(one(s)) for s in stores]
        async with mstore.engine.connect() as watcher:  # both wait on the blocker's row

            async def waiting() -> int:
                # This database's waits only: other test workers share the server.
                query = (
                    "SELECT COUNT(*) FROM information_schema.innodb_trx t"
                    " JOIN information_schema.processlist p ON p.ID = t.trx_mysql_thread_id"
                    " WHERE t.trx_state = 'LOCK WAIT' AND p.DB = DATABASE()"
                )
                return int((await watcher.execute(text(query))).scalar_one())

            # InnoDB refreshes this table only when it was last read over 0.1 s ago.
            for _ in range(40):
                await asyncio.sleep(0.15)
                if await waiting() == 2:
                    break
            assert await waiting() == 2
        await blocker.rollback()
        results = await asyncio.gather(*racers, return_exceptions=True)
    finally:
        await blocker.close()
        await asyncio.gather(*(s.close() for s in stores))
    errors = [r for r in results if isinstance(r, BaseException)]
    claims = [r for r in results if isinstance(r, lifecycle.Claim)]
    assert [c.outcome for c in claims] == [ClaimOutcome.CLAIMED], results
    assert len(errors) == 1
    assert isinstance(errors[0], StoreError)
    assert "1213" in str(errors[0])


# The hot path's connection keeping (PostgresDriver's) on asyncmy connections.


async def _claim_new(store: SQLStore, key: str) -> ClaimOutcome:
    claim = await lifecycle.claim(store, key, "h", tok(), now=T0, lease=LEASE, ttl=TTL)
    return claim.outcome


@pytest.fixture
async def small(mariadb_url: str) -> AsyncIterator[SQLStore]:
    async with emptied(SQLStore(mariadb_url, pool_size=2, command_timeout=5)) as store:
        yield store


def _held(store: SQLStore) -> int:
    return cast(MySQLDriver, store._driver)._held


async def test_many_concurrent_statements_share_a_bounded_set(small: SQLStore) -> None:
    outcomes = await asyncio.gather(*(_claim_new(small, f"{i:064d}") for i in range(60)))
    assert outcomes == [ClaimOutcome.CLAIMED] * 60
    assert _held(small) <= 2
    assert small.engine.pool.checkedout() <= 2  # type: ignore[attr-defined]  # QueuePool's


async def test_cancelled_statements_leak_no_connection(small: SQLStore) -> None:
    tasks = [asyncio.ensure_future(_claim_new(small, f"c{i:063d}")) for i in range(30)]
    await asyncio.sleep(0.005)
    for task in tasks[::2]:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.1)  # cancelled connections are closed in tasks of their own
    assert _held(small) <= 2
    outcomes = await asyncio.gather(*(_claim_new(small, f"d{i:063d}") for i in range(30)))
    assert outcomes == [ClaimOutcome.CLAIMED] * 30
    # Nothing cancelled went back to SQLAlchemy's pool: the hot path holds what is out.
    assert small.engine.pool.checkedout() == _held(small)  # type: ignore[attr-defined]


async def test_the_rest_of_the_pool_stays_free_for_other_work(small: SQLStore) -> None:
    storm = asyncio.gather(*(_claim_new(small, f"e{i:063d}") for i in range(40)))
    async with small.engine.connect() as a, small.engine.connect() as b:
        assert (await a.execute(text("SELECT 1"))).scalar_one() == 1
        assert (await b.execute(text("SELECT 1"))).scalar_one() == 1
    assert set(await storm) == {ClaimOutcome.CLAIMED}


# When the server hangs or drops the connection: a 503, then recovery by itself.


async def test_a_server_that_hangs_is_a_store_error_within_command_timeout_and_a_second(
    mariadb_url: str, mstore: SQLStore
) -> None:
    proxy = TcpProxy("127.0.0.1", 3306)
    store = SQLStore(proxy.url_for(mariadb_url), command_timeout=1, pool_size=1)
    try:
        assert await _claim_new(store, "w" * 64) is ClaimOutcome.CLAIMED  # connected
        proxy.stall()
        started = time.monotonic()
        with pytest.raises(StoreError, match="TimeoutError: no answer"):
            await _claim_new(store, "x" * 64)
        assert time.monotonic() - started < 3  # command_timeout + the 1 s margin
        proxy.restore()
        assert await _claim_new(store, "y" * 64) is ClaimOutcome.CLAIMED  # a new connection
    finally:
        proxy.restore()
        await store.close()
        proxy.close()


async def test_a_connection_killed_while_idle_costs_no_statement(mstore: SQLStore) -> None:
    assert await _claim_new(mstore, "a" * 64) is ClaimOutcome.CLAIMED
    idle = cast(MySQLDriver, mstore._driver)._idle  # the hot path's kept connection
    assert len(idle) == 1
    thread_id = int(cast(Any, idle[0].driver_connection).thread_id())
    async with mstore.engine.connect() as admin:
        await admin.execute(text(f"KILL CONNECTION {thread_id}"))
    # The claim meets the dead connection, which is dropped; it is sent once more on
    # a new one (a claim may run twice: it recognises its own row).
    assert await _claim_new(mstore, "b" * 64) is ClaimOutcome.CLAIMED
    assert await _claim_new(mstore, "c" * 64) is ClaimOutcome.CLAIMED


async def test_a_connection_killed_after_the_claim_committed_costs_no_answer(
    mariadb_server: MariaDBServer, mariadb_url: str, tiny: TinyFactory
) -> None:
    """The claim ran and committed, its answer never reached the store, and the
    connection was then ``KILL``ed: the claim is sent again on a new connection, meets
    its own row and is answered as claimed (as on Postgres), not 503 then 409 for a
    lease. The proxy only holds the answer back; the KILL is the server's own."""
    proxy = TcpProxy(mariadb_server.host, mariadb_server.port)
    try:
        async with emptied(SQLStore(proxy.url_for(mariadb_url))) as store:
            app = tiny(store, principal=ANONYMOUS)
            async with app.client() as client:

                async def pay(key: str) -> httpx.Response:
                    return await client.post("/pay", json={}, headers={"Idempotency-Key": key})

                assert (await pay("warm")).status_code == 201  # connected, prepared
                idle = cast(MySQLDriver, store._driver)._idle
                assert len(idle) == 1  # the connection the next claim runs on
                thread_id = int(cast(Any, idle[0].driver_connection).thread_id())
                proxy.lose_next_answer()
                request = asyncio.ensure_future(pay("k"))
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while not proxy.answers_lost:  # the server answered: the claim committed
                    assert loop.time() < deadline, "the claim never reached the server"
                    await asyncio.sleep(0.01)
                async with store.engine.connect() as admin:
                    await admin.execute(text(f"KILL CONNECTION {thread_id}"))
                first = await request
                assert first.status_code == 201
                replay = await pay("k")
        assert replay.status_code == 201
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json() == first.json()
        assert app.calls["pay"] == 2  # warm, and k once
    finally:
        proxy.close()


async def test_the_hot_path_bounds_its_operations_and_core_keeps_the_read_timeout(
    mstore: SQLStore,
) -> None:
    # With a read_timeout asyncmy waits for every read through asyncio.wait_for and
    # skips its fast path for prepared statements; the hot path bounds each operation
    # itself, and SQLAlchemy's own connections keep the driver's backstop.
    assert await _claim_new(mstore, "r" * 64) is ClaimOutcome.CLAIMED
    idle = cast(MySQLDriver, mstore._driver)._idle
    assert idle
    assert all(cast(Any, f.driver_connection)._read_timeout is None for f in idle)
    async with mstore.engine.connect() as core:
        raw = await core.get_raw_connection()
        assert cast(Any, raw.driver_connection)._read_timeout is not None


def test_a_transactional_policy_on_a_mysql_url_is_refused_naming_the_mariadb_url(
    mariadb_url: str,
) -> None:
    """MariaDB's transactional claim bounds its lock waits with SET STATEMENT, which MySQL
    lacks: a mysql+asyncmy:// URL (whatever the server) is refused at construction."""
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

    from asgi_idempotency import IdempotencyMiddleware, Policy

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await Response()(scope, receive, send)

    policies = {"POST /x": Policy(transactional=True)}
    mysql_url = mariadb_url.replace("mariadb+asyncmy://", "mysql+asyncmy://", 1)
    store = SQLStore(mysql_url)  # never used: nothing to close on a loop
    with pytest.raises(ValueError, match="needs SQLStore on Postgres or MariaDB") as caught:
        IdempotencyMiddleware(app, store=store, principal=ANONYMOUS, policies=policies)
    assert "SQLStore on mysql does not hold the claim" in str(caught.value)
    assert "use a mariadb+asyncmy:// URL" in str(caught.value)
    # The same server through a mariadb+asyncmy:// URL serves them.
    IdempotencyMiddleware(app, store=SQLStore(mariadb_url), principal=ANONYMOUS, policies=policies)


async def test_create_all_from_many_processes_at_once_records_the_head_once(
    mariadb_server: MariaDBServer, empty_db: str
) -> None:
    from asgi_idempotency.migrations import VERSION_TABLE, head

    stores = [SQLStore(empty_db) for _ in range(6)]  # as six workers starting together
    try:
        await asyncio.gather(*(s.create_all() for s in stores))
        await asyncio.gather(*(s.prepare() for s in stores))
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    name = empty_db.rsplit("/", 1)[1]
    assert mariadb_server._run(f"SELECT version_num FROM {VERSION_TABLE}", database=name) == [
        (head(),)
    ]


def test_a_mariadb_url_refuses_a_server_older_than_10_5_naming_the_mysql_url() -> None:
    """The mariadb+asyncmy:// claim is INSERT ... RETURNING (MariaDB 10.5+): an older
    server is refused at startup (prepare), not answered 503 on every request."""
    from asgi_idempotency.stores.sql.mariadb import server_problem

    problem = server_problem((10, 4, 32, "MariaDB"))
    assert problem is not None
    assert "MariaDB 10.4.32" in problem
    assert "mysql+asyncmy://" in problem
    assert server_problem((10, 5, 0)) is None
    assert server_problem((11, 4, 2)) is None
    assert server_problem(None) is None  # not connected yet: nothing known


async def test_prepare_passes_on_this_server(mariadb_url: str) -> None:
    store = SQLStore(mariadb_url)
    try:
        await store.prepare()
        assert store.engine.dialect.server_version_info is not None
    finally:
        await store.close()

"""Shared fixtures: every store through one parametrised fixture, a real Postgres, real servers.

Postgres comes from ``IDEMPOTENCY_TEST_DATABASE_URL`` when set, else a server on
127.0.0.1:5432 (user postgres), else a throwaway server started from local
binaries by pytest-postgresql. Each run creates and drops a database of its own: each
pytest-xdist worker does (session fixtures are per worker), named with the worker's id.
If no Postgres can be had, Postgres tests fail (never skip) and say how to get one.
MariaDB likewise: ``IDEMPOTENCY_TEST_MARIADB_URL``, else root on 127.0.0.1:3306.
"""

from __future__ import annotations

import asyncio
import glob
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, settings
from pytest_postgresql import factories
from pytest_postgresql.janitor import DatabaseJanitor
from sqlalchemy import text
from sqlalchemy.engine import make_url

from asgi_idempotency import MemoryStore, SQLStore
from asgi_idempotency.stores.base import Store
from asgi_idempotency.testing import StoreClock as StoreClock  # where tests import it from
from tests.apps import Tiny as Tiny  # where tests imported it from
from tests.apps import TinyFactory as TinyFactory
from tests.apps import tiny_app
from tests.timing import UNIT as UNIT  # importing it sets StoreClock.shared_unit for the suite

if TYPE_CHECKING:  # the redis extra is optional: imported where a Redis test runs
    from asgi_idempotency.stores.redis import RedisStore

# In CI (.ci/run exports CI=true) every run draws the same examples, so a red build is
# the code's doing and reproduces, never a new seed's; and no example database is
# written, as a fresh clone would only throw it away. Recent Hypothesis loads a built-in
# profile like this one when it sees CI; ours says so here, for every version that
# pyproject.toml admits. Loaded on import, before the test modules build their own
# settings objects on top of it.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,  # a shared CI machine's pauses are not the code's
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
if os.environ.get("CI"):
    settings.load_profile("ci")

# The pytest-xdist worker this process is ("gw0", "gw1", ...; "main" without xdist). Every
# resource the run creates on a shared server (databases, queues, streams) carries it, so
# workers never share one and a leftover names the worker that left it.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")


def worker_name(prefix: str, sep: str = "_") -> str:
    """A name of this worker's own on a shared server: ``{prefix}_{worker}_{random}``.

    Databases take ``_``; RabbitMQ queues and NATS streams take ``sep="-"``.
    """
    return sep.join((prefix, WORKER, uuid.uuid4().hex[:12]))


NO_POSTGRES = (
    "PostgreSQL is required for these tests and none could be reached or started. "
    "Start one with `docker compose up -d` (see README), or set "
    "IDEMPOTENCY_TEST_DATABASE_URL=postgresql+asyncpg://user@host:port/db."
)


NO_MARIADB = (
    "MariaDB is required for the tests marked mariadb and none could be reached. "
    "Start the local server with `service mariadb start` (or `mysqld_safe &`), or "
    "`docker compose up -d mariadb`, or set "
    "IDEMPOTENCY_TEST_MARIADB_URL=mariadb+asyncmy://user:password@host:port; "
    "deselect them with -m 'not mariadb'."
)

NO_RABBITMQ = (
    "RabbitMQ is required for the tests marked rabbitmq and none could be reached on "
    "{where}. Start it with `rabbitmq-server -detached` (as .ci/run does), or set "
    "IDEMPOTENCY_TEST_AMQP_URL=amqp://user:password@host:port/; "
    "deselect them with -m 'not rabbitmq'."
)

NO_NATS = (
    "NATS with JetStream is required for the tests marked nats and none could be reached "
    "on {where}. Start it with `nats-server -js -a 127.0.0.1 -p 4222 &` (as .ci/run does), "
    "or set IDEMPOTENCY_TEST_NATS_URL=nats://host:port; deselect them with -m 'not nats'."
)


def _pg_ctl() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return found[-1] if found else None


# A throwaway server from local binaries: the last resort when nothing is listening.
pg_throwaway_proc = factories.postgresql_proc(executable=_pg_ctl())


# Tests that must not share the machine with each other: real uvicorn workers under
# load, app servers under libfaketime's skewed clocks, bounds on how long an answer takes.
# They form one group that one worker runs one after another (the other workers run the
# rest meanwhile); the group shares that worker's demo servers (session fixtures). Node id
# prefixes, as the scheduler sees only node ids.
SERIAL_GROUP = "real-processes"
SERIAL = (
    "tests/reliability/",
    "tests/stores/test_mariadb.py::test_a_statement_blocked_on_a_row_lock_is_a_store_error",
    "tests/stores/test_sqlite_timeout.py::test_a_locked_database_answers_503_within_command",
    "tests/stores/test_redis.py::test_a_hung_server_is_a_store_error_within_the_command_timeout",
    "tests/stores/test_sql_pool.py::test_a_wait_for_a_busy_pool_ends_at_the_timeout",
    "tests/ops/test_cli_newcomer.py::test_prune_pauses_between_batches_never_after_the_last",
    "tests/integrations/test_transactional_race.py::test_mariadb_a_rival_holding_the_row_answers",
    "tests/ops/test_serving.py",  # four uvicorn workers: a loaded machine drops connections
)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (the default, pyproject.toml), with :data:`SERIAL` as one group.

    pytest-xdist's own loadgroup reads ``xdist_group`` marks by renaming node ids, which
    pytest 9 no longer lets it do (every test then runs wherever it lands): the scheduler
    here groups by node id instead, and still honours ``@group`` ids where xdist sets them.
    """
    if config.getoption("dist") != "loadgroup":
        return None
    # pytest-xdist ships no type information (no py.typed): its scheduler is Any here.
    from xdist.scheduler import LoadGroupScheduling  # type: ignore[import-untyped]

    class Scheduling(LoadGroupScheduling):  # type: ignore[misc]  # subclassing an Any
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(SERIAL):
                return SERIAL_GROUP
            return str(super()._split_scope(nodeid))

    return Scheduling(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    """With IDEMPOTENCY_REQUIRE_POSTGRES (or _MARIADB) set, a run without their tests fails."""
    required = os.environ.get("IDEMPOTENCY_REQUIRE_POSTGRES")
    if (
        required
        and session.items
        and not any(i.get_closest_marker("postgres") for i in session.items)
    ):
        raise pytest.UsageError(
            "IDEMPOTENCY_REQUIRE_POSTGRES is set but no Postgres test was selected"
        )
    if (
        os.environ.get("IDEMPOTENCY_REQUIRE_MARIADB")
        and session.items
        and not any(i.get_closest_marker("mariadb") for i in session.items)
    ):
        raise pytest.UsageError(
            "IDEMPOTENCY_REQUIRE_MARIADB is set but no MariaDB test was selected"
        )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass(frozen=True)
class PgServer:
    host: str
    port: int
    user: str
    password: str | None

    @contextmanager
    def database(self, prefix: str) -> Iterator[str]:
        """An empty database of its own on this server, dropped afterwards; yields its URL."""
        dbname = worker_name(prefix)
        with DatabaseJanitor(
            user=self.user, host=self.host, port=self.port, dbname=dbname, password=self.password
        ):
            yield self.url(dbname)

    def url(self, dbname: str) -> str:
        auth = self.user if not self.password else f"{self.user}:{self.password}"
        return f"postgresql+asyncpg://{auth}@{self.host}:{self.port}/{dbname}"


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> PgServer:
    env = os.environ.get("IDEMPOTENCY_TEST_DATABASE_URL")
    if env:
        u = make_url(env)
        return PgServer(u.host or "127.0.0.1", u.port or 5432, u.username or "postgres", u.password)
    if _reachable("127.0.0.1", 5432):
        return PgServer("127.0.0.1", 5432, "postgres", None)
    try:
        proc = request.getfixturevalue("pg_throwaway_proc")
    except Exception as exc:  # any failure to start one ends in the same advice
        pytest.fail(f"{NO_POSTGRES} ({type(exc).__name__}: {exc})", pytrace=False)
    return PgServer(proc.host, int(proc.port), proc.user, proc.password or None)


@pytest.fixture(scope="session")
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """A ``postgresql+asyncpg`` URL of a database created for this test run, with the schema."""
    with pg_server.database("idem_test") as url:
        _prepare(url)
        yield url


def _prepare(url: str) -> None:
    """Create the schema; in a thread of its own, as callers may already run a loop."""
    from concurrent.futures import ThreadPoolExecutor

    from asgi_idempotency.ops.demo import prepare

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, prepare(url)).result()


async def truncate(store: SQLStore) -> None:
    async with store.engine.begin() as conn:
        if store.dialect == "postgresql":
            await conn.execute(text("TRUNCATE idempotency_records, demo_refunds"))
        else:
            await conn.execute(text("DELETE FROM idempotency_records"))
            await conn.execute(text("DELETE FROM demo_refunds"))


@asynccontextmanager
async def emptied(store: SQLStore) -> AsyncIterator[SQLStore]:
    """``store`` with its tables emptied first, and closed afterwards."""
    await truncate(store)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path / 'idempotency.db'}"
    _prepare(url)
    return url


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis server for the run: ``IDEMPOTENCY_TEST_REDIS_URL``, else one of our own."""
    from tests.helpers.redis_servers import NO_REDIS, start_server

    env = os.environ.get("IDEMPOTENCY_TEST_REDIS_URL")
    if env:
        yield env
        return
    try:
        server = start_server(tmp_path_factory.mktemp("redis"))
    except Exception as exc:  # any failure to start one ends in the same advice
        pytest.fail(f"{NO_REDIS} ({type(exc).__name__}: {exc})", pytrace=False)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis Cluster: ``IDEMPOTENCY_TEST_REDIS_CLUSTER``, else 3 + 3 nodes of our own."""
    from tests.helpers.redis_servers import NO_REDIS, start_cluster

    env = os.environ.get("IDEMPOTENCY_TEST_REDIS_CLUSTER")
    if env:
        yield env if "://" in env else f"redis+cluster://{env}"
        return
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    except Exception as exc:
        pytest.fail(f"{NO_REDIS} ({type(exc).__name__}: {exc})", pytrace=False)
    try:
        yield cluster.url
    finally:
        cluster.stop()


async def redis_store(url: str) -> Store:
    """A :class:`RedisStore` on ``url``, its server (every primary) flushed first."""
    from asgi_idempotency.stores.redis import RedisStore

    store = RedisStore(url)
    await store.client.flushall()
    return store


@dataclass(frozen=True)
class MariaDBServer:
    """A MariaDB (or MySQL) server the tests may create databases on."""

    host: str
    port: int
    user: str
    password: str | None

    def _run(self, sql: str, database: str | None = None) -> list[tuple[Any, ...]]:
        """Run one statement with asyncmy, on a loop of its own (callers may run one)."""
        from concurrent.futures import ThreadPoolExecutor

        import asyncmy  # the mysql extra, installed with dev

        async def go() -> list[tuple[Any, ...]]:
            conn = await asyncmy.connect(
                host=self.host,
                port=self.port,
                user=self.user,
                password=self.password or "",
                database=database,
                connect_timeout=3,
            )
            try:
                async with conn.cursor() as cursor:
                    await cursor.execute(sql)
                    return list(await cursor.fetchall())
            finally:
                await conn.ensure_closed()

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, go()).result()

    @contextmanager
    def database(self, prefix: str) -> Iterator[str]:
        """An empty database of its own on this server, dropped afterwards; yields its URL."""
        dbname = worker_name(prefix)
        self._run(f"CREATE DATABASE `{dbname}`")
        try:
            yield self.url(dbname)
        finally:
            self._run(f"DROP DATABASE IF EXISTS `{dbname}`")

    def url(self, dbname: str, scheme: str = "mariadb+asyncmy") -> str:
        auth = self.user if not self.password else f"{self.user}:{self.password}"
        return f"{scheme}://{auth}@{self.host}:{self.port}/{dbname}"


@pytest.fixture(scope="session")
def mariadb_server() -> MariaDBServer:
    env = os.environ.get("IDEMPOTENCY_TEST_MARIADB_URL")
    u = make_url(env or "mariadb+asyncmy://root@127.0.0.1:3306")
    server = MariaDBServer(u.host or "127.0.0.1", u.port or 3306, u.username or "root", u.password)
    try:
        server._run("SELECT 1")
    except Exception as exc:  # any failure to reach it ends in the same advice
        pytest.fail(f"{NO_MARIADB} ({type(exc).__name__}: {exc})", pytrace=False)
    return server


@pytest.fixture(scope="session")
def mariadb_url(mariadb_server: MariaDBServer) -> Iterator[str]:
    """A ``mariadb+asyncmy`` URL of a database created for this test run, with the schema."""
    with mariadb_server.database("idem_test") as url:
        _prepare(url)
        yield url


def _broker_url(env: str, default: str, advice: str) -> str:
    from urllib.parse import urlsplit

    url = os.environ.get(env) or default
    parts = urlsplit(url)
    if not _reachable(parts.hostname or "127.0.0.1", parts.port or 0):
        where = f"{parts.hostname}:{parts.port}"
        pytest.fail(advice.format(where=where), pytrace=False)
    return url


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """RabbitMQ: ``IDEMPOTENCY_TEST_AMQP_URL``, else guest on 127.0.0.1:5672; fails if down."""
    return _broker_url(
        "IDEMPOTENCY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/", NO_RABBITMQ
    )


@pytest.fixture(scope="session")
def nats_url() -> str:
    """NATS with JetStream: ``IDEMPOTENCY_TEST_NATS_URL``, else 127.0.0.1:4222; fails if down."""
    return _broker_url("IDEMPOTENCY_TEST_NATS_URL", "nats://127.0.0.1:4222", NO_NATS)


STORE_KINDS = [
    "memory",
    # The lifecycle suite's fake (tests/helpers/scripted_store.py), held to the same contract.
    "fake",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    # The same Postgres store with natural batching (SQLStore(batching=True)).
    pytest.param("postgres_batched", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("redis_cluster", marks=pytest.mark.redis),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
]


@asynccontextmanager
async def open_store(request: pytest.FixtureRequest, kind: str) -> AsyncIterator[Store]:
    """An empty store of ``kind`` (one of :data:`STORE_KINDS`), closed afterwards."""
    if kind == "memory":
        yield MemoryStore()
        return
    if kind == "fake":
        from tests.helpers.scripted_store import ScriptedStore

        yield ScriptedStore()
        return
    if kind.startswith("redis"):
        fixture = "redis_cluster_url" if kind == "redis_cluster" else "redis_url"
        redis = await redis_store(request.getfixturevalue(fixture))
        try:
            yield redis
        finally:
            await redis.close()
        return
    postgres = kind in ("postgres", "postgres_batched")
    fixture = "pg_url" if postgres else "mariadb_url" if kind == "mariadb" else "sqlite_url"
    url = request.getfixturevalue(fixture)
    async with emptied(SQLStore(url, batching=BATCHING[kind])) as sql:
        yield sql


# Each SQL kind's batching argument: Postgres both ways, the others their default.
BATCHING: dict[str, bool | None] = {
    "postgres": False,
    "postgres_batched": True,
    "sqlite": None,
    "mariadb": None,
}


@pytest.fixture(params=["redis", "redis_cluster"])
async def rstore(request: pytest.FixtureRequest) -> AsyncIterator[RedisStore]:
    """A :class:`RedisStore` on one server and on the cluster, for Redis-only tests."""
    from asgi_idempotency.stores.redis import RedisStore

    async with open_store(request, request.param) as opened:
        assert isinstance(opened, RedisStore)
        yield opened


@pytest.fixture(params=STORE_KINDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """Every store kind, each empty: the contract suite and each store's own tests.

    The folders of the suites above the store (tests/http, tests/functions,
    tests/observability) override it with :data:`APP_KINDS`.
    """
    async with open_store(request, request.param) as opened:
        yield opened


# The kinds the suites above the store run on: the store contract already holds every
# kind to the same rules (tests/stores/test_contract_every_store.py), so the HTTP,
# function-guard and integration suites need one store of each family: in process,
# SQL on the server's clock (Postgres), and Redis.
APP_KINDS = [
    "memory",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]


async def app_store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """The ``store`` fixture of the folders above the store: one of :data:`APP_KINDS`.

    ``store = pytest.fixture(params=APP_KINDS, name="store")(app_store)`` in a folder's
    conftest.
    """
    async with open_store(request, request.param) as opened:
        yield opened


@pytest.fixture(params=STORE_KINDS)
async def each_store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """Every store kind, for a test above the store that is about each store's own
    behaviour (cyclic garbage left by a store's code, say) where ``store`` is narrowed."""
    async with open_store(request, request.param) as opened:
        yield opened


async def backdate(store: Store, key: str, by: timedelta) -> None:
    """Move a record's times ``by`` into the past, as if written that long ago.

    A shared store writes every record at its own time: a test that needs old records
    (for the CLI's stats, say) writes them now and ages them here, behind the store.
    """
    from asgi_idempotency.stores.codec import epoch_us
    from asgi_idempotency.stores.redis import RedisStore
    from asgi_idempotency.stores.sql.schema import records

    record = await store.get(key)
    assert record is not None
    times = {
        "created_at": record.created_at - by,
        "locked_until": record.locked_until - by,
        "expires_at": record.expires_at - by,
    }
    if isinstance(store, SQLStore):
        async with store.engine.begin() as conn:
            await conn.execute(records.update().where(records.c.key == key).values(**times))
    elif isinstance(store, RedisStore):
        fields: dict[str | bytes, int | str] = {
            name: epoch_us(value) for name, value in zip("cle", times.values(), strict=True)
        }
        await store.client.hset(store._key(key), mapping=fields)  # type: ignore[arg-type]  # an invariant Mapping
    else:
        raise TypeError(f"cannot backdate a record of {type(store).__name__}")


@pytest.fixture
async def pg_store(pg_url: str) -> AsyncIterator[SQLStore]:
    async with emptied(SQLStore(pg_url)) as sql:
        yield sql


# The SQL backends with transactional mode.
TX_KINDS = [
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
]


@pytest.fixture(params=TX_KINDS)
def tx_url(request: pytest.FixtureRequest) -> str:
    """The URL of each SQL backend with transactional mode, its schema and demo table made."""
    return str(request.getfixturevalue("pg_url" if request.param == "postgres" else "mariadb_url"))


@pytest.fixture
async def tx_store(tx_url: str) -> AsyncIterator[SQLStore]:
    """An emptied store on each SQL backend with transactional mode."""
    async with emptied(SQLStore(tx_url)) as sql:
        yield sql


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A loopback base URL that refuses connections (a ``ConnectError``: nothing is sent).

    Its port stays bound, never listening, for the whole test, so no other process
    can start listening there meanwhile.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def tiny() -> TinyFactory:
    """Factory: ``tiny(store, **middleware_kwargs)`` → :class:`tests.apps.Tiny` (see there)."""
    return tiny_app

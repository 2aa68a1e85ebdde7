"""Redis in HA setups: the Sentinel URL, READONLY from a demoted master, WAIT on a fresh
primary. (The failover under traffic: tests/reliability/test_failover_redis.py.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.sentinel import SentinelConnectionPool

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.ops import cli
from asgi_idempotency.stores.base import NewClaim
from asgi_idempotency.stores.redis import RedisStore
from asgi_idempotency.stores.registry import kind_of
from asgi_idempotency.stores.urls import redact

from ..helpers.redis_sentinels import SentinelGroup, start_group
from ..helpers.redis_servers import RedisServer, start_server
from ..reliability.failover import effect_app
from ..reliability.support import TcpProxy

URL = "redis+sentinel://app:hunter2@127.0.0.1:1,127.0.0.1:2/mymaster/3"


def _claim() -> NewClaim:
    return NewClaim(
        uuid.uuid4().hex, "ab" * 32, uuid.uuid4().hex, datetime.now(UTC),
        timedelta(seconds=30), timedelta(hours=1),
    )  # fmt: skip


# --- The URL (nothing is connected) ----------------------------------------------


@pytest.mark.anyio
async def test_a_sentinel_url_builds_the_masters_client_with_the_stores_options() -> None:
    store = RedisStore(f"{URL}?wait_replicas=1&wait_timeout=0.5", command_timeout=2)
    try:
        assert isinstance(store.client, Redis)
        pool = store.client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.service_name == "mymaster"
        assert pool.connection_kwargs["db"] == 3
        assert pool.connection_kwargs["password"] == "hunter2"
        sentinels = pool.sentinel_manager.sentinels
        assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
        assert (store._wait, store._wait_ms) == (1, 500)
        assert not store.batching  # each write keeps its own WAIT
    finally:
        await store.close()
    assert kind_of(URL).name == "Redis"  # the CLI and open_store take it


@pytest.mark.anyio
async def test_the_stores_options_leave_every_redis_url_before_redis_py_reads_it() -> None:
    store = RedisStore(
        "redis://127.0.0.1:1/0?wait_replicas=2&wait_timeout=0.25&health_check_interval=5"
    )
    try:
        assert (store._wait, store._wait_ms) == (2, 250)
        assert isinstance(store.client, Redis)
        assert store.client.connection_pool.connection_kwargs["health_check_interval"] == 5
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("redis+sentinel://127.0.0.1:1,127.0.0.1:2", {}, "names the master's service"),
        ("redis+sentinel://127.0.0.1:1/mymaster/x", {}, "names the master's service"),
        ("redis+sentinel://127.0.0.1:1,,127.0.0.1:2/m", {}, "malformed host ''"),
        (f"{URL}?wait_replicas=1", {"wait_replicas": 2}, "wait_replicas is 2 as an argument and 1"),
        (f"{URL}?wait_replicas=one", {}, "wait_replicas='one' in the Redis URL is not a number"),
        (f"{URL}?ssl_cert_reqs=none", {}, "not ssl_cert_reqs"),
    ],
)
def test_a_malformed_sentinel_url_is_refused(
    url: str, options: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        RedisStore(url, wait_replicas=options.get("wait_replicas"))
    assert "hunter2" not in str(caught.value)


def test_a_sentinel_url_is_shown_with_every_sentinel_and_no_password() -> None:
    assert redact(f"{URL}?sentinel_password=s3cret&wait_replicas=1") == (
        "redis+sentinel://app:***@127.0.0.1:1,127.0.0.1:2/mymaster/3"
        "?sentinel_password=***&wait_replicas=1"
    )


# --- Real servers ----------------------------------------------------------------


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    try:
        group = start_group(tmp_path / "sentinel")
    except RuntimeError as exc:  # missing binaries or a failed start: say which, never skip
        pytest.fail(str(exc), pytrace=False)
    try:
        yield group
    finally:
        group.stop()


@pytest.mark.redis
def test_the_cli_takes_a_sentinel_url(
    group: SentinelGroup, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["stats", "--database-url", group.url("wait_replicas=1")]) == 0
    assert "records" in capsys.readouterr().out


@pytest.fixture
def two_servers(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    try:
        first, second = start_server(tmp_path / "a"), start_server(tmp_path / "b")
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield first, second
    finally:
        first.stop()
        second.stop()


@pytest.mark.anyio
@pytest.mark.redis
@pytest.mark.parametrize("batching", [True, False])
async def test_readonly_from_a_demoted_master_is_a_503_and_a_broken_connection(
    batching: bool, two_servers: tuple[RedisServer, RedisServer]
) -> None:
    """Behind one address (a DNS name, a virtual IP: here a proxy), the master is demoted
    and the address moves to the new one. The connection the store holds still leads to
    the old master, which answers READONLY: that request gets 503 (its command did not
    run), never a 500, and the connection is dropped, so the next one reaches the new
    master."""
    old, new = two_servers
    proxy = TcpProxy("127.0.0.1", old.port)
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", command_timeout=2, batching=batching)
    app, runs = effect_app(store, lease=5)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

            async def send(key: str) -> httpx.Response:
                return await client.post(
                    "/effects", json={"key": key}, headers={"Idempotency-Key": key}
                )

            assert (await send("before")).status_code == 201
            old.cli("REPLICAOF", "127.0.0.1", str(new.port))  # demoted
            proxy.upstream = ("127.0.0.1", new.port)  # the address moves
            demoted = await send("during")
            after = await send("during")
        assert demoted.status_code == 503, demoted.text
        assert demoted.headers["content-type"] == "application/problem+json"
        assert "retry-after" in demoted.headers
        assert after.status_code == 201
        assert runs["during"] == 1
    finally:
        await store.close()
        proxy.close()


@pytest.mark.anyio
@pytest.mark.redis
async def test_a_fresh_primary_without_the_scripts_costs_one_wait_not_two(
    two_servers: tuple[RedisServer, RedisServer],
) -> None:
    """A replica promoted by a failover has none of the store's scripts, and no replica
    of its own yet. The write fails its WAIT (503) after ``wait_timeout``, once: a
    NOSCRIPT reply pipelined with the WAIT made it block a second time first."""
    primary, _ = two_servers
    store = RedisStore(primary.url, command_timeout=3, wait_replicas=1, wait_timeout=0.5)
    try:
        with pytest.raises(StoreError, match="WAIT"):
            await store.insert(_claim())  # the scripts are known from here on
        primary.cli("SCRIPT", "FLUSH")
        started = time.monotonic()
        with pytest.raises(StoreError, match="WAIT"):
            await store.insert(_claim())
        took = time.monotonic() - started
    finally:
        await store.close()
    assert 0.5 <= took < 0.9, took

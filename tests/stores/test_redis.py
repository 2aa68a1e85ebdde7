"""What only the Redis store has: its key layout, TTLs, scripts, errors, WAIT, and its cost.

The store contract and the middleware suites run on Redis through the ``store``
fixture; these pin the rest, against real ``redis-server`` processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from asgi_idempotency import Policy, StoredResponse, StoreError
from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.stores.base import Capabilities, NewClaim, RecordStatus, Store, capabilities
from asgi_idempotency.stores.redis import REDIS_ERRORS, RedisStore
from tests.conftest import TinyFactory
from tests.helpers.redis_servers import RedisCluster as OurCluster
from tests.helpers.redis_servers import RedisServer, redis_cli, start_cluster, start_server
from tests.reliability.support import TcpProxy
from tests.stores.test_round_trips import _drive

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

NO_LEASE, HOUR = timedelta(0), timedelta(hours=1)
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id":1}')


def _ports(store: RedisStore) -> list[int]:
    """Every node's port (the one server's, or every cluster node's)."""
    if isinstance(store.client, RedisCluster):
        return sorted(int(n.port) for n in store.client.get_nodes())
    kwargs = store.client.connection_pool.connection_kwargs
    return [int(kwargs["port"])]


def _commandstats(ports: list[int]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for port in ports:
        for line in redis_cli(port, "INFO", "commandstats").splitlines():
            if line.startswith("cmdstat_"):
                name, _, fields = line.removeprefix("cmdstat_").partition(":")
                calls = int(dict(f.split("=") for f in fields.split(","))["calls"])
                totals[name] = totals.get(name, 0) + calls
    return totals


def _command_counter(store: RedisStore) -> Callable[[], list[Any]]:
    """``reset()`` for ``_drive``: what was sent and run since the last call.

    Counted twice: each command the client sent (``execute_command``; ``_drive`` sends
    one request at a time, and a request that finds its server idle goes alone, not in
    a pipeline, so one command is one round trip), and the scripts the
    servers ran by their own count (``INFO commandstats``, whose script-internal
    commands are left out: they cost no round trip).
    """
    ports = _ports(store)
    sent: list[str] = []
    raw = store.client.execute_command

    async def counted(*args: Any, **kwargs: Any) -> Any:
        sent.append(str(args[0]))
        return await raw(*args, **kwargs)

    store.client.execute_command = counted  # type: ignore[method-assign]  # a test's wiretap
    last = _commandstats(ports)

    def reset() -> list[Any]:
        nonlocal last
        now = _commandstats(ports)
        ran = now.get("evalsha", 0) - last.get("evalsha", 0)
        last, out = now, (list(sent), ran)
        sent.clear()
        return [out]

    return reset


async def test_round_trips_per_outcome(rstore: RedisStore, tiny: Any) -> None:
    await _drive(tiny(rstore), lambda: [], "warm-up")  # connect, load the scripts
    seen = await _drive(tiny(rstore), _command_counter(rstore), "counted")
    one, two = (["EVALSHA"], 1), (["EVALSHA", "EVALSHA"], 2)
    assert seen == {
        "fresh": [two],  # insert, complete
        "replay": [one],  # the insert returns the row in the way
        "mismatch_422": [one],
        "released_500": [two],  # insert, release
        "unguarded_no_key": [([], 0)],
        "unguarded_get": [([], 0)],
        "in_flight_409": [one],
    }


async def test_one_hash_per_record_under_the_digest_never_the_raw_key(
    rstore: RedisStore, tiny: Any
) -> None:
    client_key = "order-42-visible-client-key"
    async with tiny(rstore).client() as c:
        r = await c.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": client_key})
        assert r.status_code == 201
    names = [name async for name in rstore.client.scan_iter(match="idem:*")]
    digest = scoped_key("", client_key, "test")
    assert names == [f"idem:{{{digest}}}".encode()]
    # Beside it, the audit's index (a sorted set of digests and the route template).
    (index,) = [name async for name in rstore.client.scan_iter(match="idem-audit:*")]
    members = cast(list[bytes], await rstore.client.zrange(index, 0, -1))
    assert [m.split()[0] for m in members] == [digest.encode()]
    assert client_key not in repr(members)
    fields = await rstore.client.hgetall(names[0])
    assert set(fields) == {b"h", b"s", b"t", b"c", b"l", b"e", b"rs", b"rh", b"rb"}
    assert client_key not in repr((names, fields))


async def test_the_ttl_is_the_policys_retention(rstore: RedisStore, tiny: Any) -> None:
    policy = Policy(ttl=timedelta(minutes=10))
    app = tiny(rstore, default_policy=policy)
    async with app.client() as c:
        began = time.monotonic()
        first = asyncio.create_task(
            c.post("/pay", json={"wait": True}, headers={"Idempotency-Key": "ttl"})
        )
        await asyncio.wait_for(app.entered.wait(), 5)
        [name] = [n async for n in rstore.client.scan_iter(match="idem:*")]
        assert 595_000 < await rstore.client.pttl(name) <= 600_000  # the claim's
        await asyncio.sleep(0.3)
        app.gate.set()
        assert (await first).status_code == 201
        took_ms = (time.monotonic() - began) * 1000
    # The completion's TTL counts from the completion, on the server's clock, as its
    # expires_at does: the ttl asked for, less what has passed since.
    left = await rstore.client.pttl(name)
    assert 600_000 - took_ms <= left <= 600_000
    record = await rstore.get(name.decode().removeprefix("idem:{").removesuffix("}"))
    assert record is not None
    assert record.expires_at - record.created_at >= timedelta(minutes=10)


async def test_an_expired_ttl_makes_the_key_new_with_no_prune(
    rstore: RedisStore, tiny: Any
) -> None:
    app = tiny(rstore, default_policy=Policy(ttl=timedelta(milliseconds=300)))
    key = {"Idempotency-Key": "short"}
    async with app.client() as c:
        assert (await c.post("/pay", json={"n": 1}, headers=key)).status_code == 201
        await asyncio.sleep(0.5)
        assert [n async for n in rstore.client.scan_iter(match="idem:*")] == []
        assert (await c.post("/pay", json={"n": 2}, headers=key)).status_code == 201
    assert app.calls["pay"] == 2


async def test_scripts_flushed_on_the_server_are_reloaded(rstore: RedisStore) -> None:
    now = datetime.now(UTC)
    new = NewClaim("a" * 64, "h", "t1", now, timedelta(seconds=30), timedelta(hours=1))
    assert await rstore.insert(new) is None
    await rstore.client.script_flush()  # as after a restart or a failover to a bare replica
    assert await rstore.complete("a" * 64, "t1", RESPONSE, now=now, ttl=HOUR)
    record = await rstore.get("a" * 64)
    assert record is not None
    assert record.status is RecordStatus.COMPLETED
    assert record.response == RESPONSE


async def test_find_and_buckets_scan_every_primary(rstore: RedisStore) -> None:
    now = datetime.now(UTC)
    keys = [f"{i:02x}" + "0" * 62 for i in range(0, 256, 8)]  # spread over the slots
    for k in keys:
        claim = NewClaim(k, "h", "t-" + k, now, timedelta(seconds=30), timedelta(hours=1))
        assert await rstore.insert(claim) is None
    assert [r.key for r in await rstore.find("f8", limit=5)] == ["f8" + "0" * 62]
    assert len(await rstore.find("", limit=100)) == len(keys)
    [bucket] = await rstore.buckets(now=now)
    assert (bucket.status, bucket.expired, bucket.lease_over) == (
        RecordStatus.IN_PROGRESS,
        False,
        False,
    )
    assert bucket.count == len(keys)
    assert await rstore.count_expired(now=now + timedelta(hours=2)) == len(keys)
    assert await rstore.prune(now=now + timedelta(hours=2), batch_size=10) == 10
    assert await rstore.count_expired(now=now + timedelta(hours=2)) == len(keys) - 10


async def test_find_treats_glob_characters_as_text(rstore: RedisStore) -> None:
    now = datetime.now(UTC)
    await rstore.insert(NewClaim("ab" + "0" * 62, "h", "t", now, NO_LEASE, HOUR))
    assert await rstore.find("*") == []
    assert await rstore.find("a?") == []
    odd = RedisStore(rstore.client, key_prefix="my*app[1]")  # the prefix is text too
    await odd.insert(NewClaim("ab" + "0" * 62, "h", "t", now, NO_LEASE, HOUR))
    assert [r.key for r in await odd.find("ab")] == ["ab" + "0" * 62]
    assert [b.count for b in await odd.buckets(now=now)] == [1]
    assert [b.count for b in await rstore.buckets(now=now)] == [1]  # each its own records


async def test_a_call_retried_after_its_write_landed_reports_the_write_as_its_own(
    rstore: RedisStore,
) -> None:
    """redis-py resends a command after a dropped connection; the first may have landed.

    The claim scripts recognise their own token (unique to one claim), so a resent
    claim is still the caller's claim, not a 409 against itself, and a resent swap
    still succeeded, and a resent completion (the row completed under its token with
    the very response it sends) answers True, never a lost claim. A completion with
    another response still answers False and changes nothing (the contract's
    test_completing_a_completed_row_answers_false_and_changes_nothing).
    """
    now = datetime.now(UTC)
    lease, ttl = timedelta(seconds=30), timedelta(hours=1)
    new = NewClaim("d" * 64, "h", "t1", now, lease, ttl)
    assert await rstore.insert(new) is None
    assert await rstore.insert(new) is None  # the resend
    later = now + 2 * lease
    current = await rstore.get("d" * 64)
    assert current is not None
    taker = NewClaim("d" * 64, "h", "t2", later, lease, ttl)
    assert await rstore.replace(current, taker)
    assert await rstore.replace(current, taker)  # the resend
    assert await rstore.complete("d" * 64, "t2", RESPONSE, now=later, ttl=ttl)
    assert await rstore.complete("d" * 64, "t2", RESPONSE, now=later, ttl=ttl)  # the resend
    other = StoredResponse(500, (), b"other")
    assert not await rstore.complete("d" * 64, "t2", other, now=later, ttl=ttl)
    # A stranger's token still gets nothing, whatever the state.
    assert await rstore.insert(NewClaim("d" * 64, "h", "t3", later, timedelta(0), ttl))
    assert not await rstore.complete("d" * 64, "t1", RESPONSE, now=later, ttl=ttl)


# Errors: all of them StoreError, so the middleware's 503 path applies.


async def test_an_unreachable_server_is_a_store_error_and_a_503(
    refused_url: str, tiny: Any
) -> None:
    port = urlsplit(refused_url).port
    store = RedisStore(f"redis://127.0.0.1:{port}/0", command_timeout=1)
    try:
        with pytest.raises(StoreError, match="ConnectionError"):
            await store.get("a" * 64)
        app = tiny(store)
        async with app.client() as c:
            r = await c.post("/pay", json={}, headers={"Idempotency-Key": "down"})
        assert r.status_code == 503
        assert r.headers["retry-after"]
        assert app.calls == {}
    finally:
        await store.close()


async def test_a_hung_server_is_a_store_error_within_the_command_timeout(
    tmp_path: Path, tiny: Any
) -> None:
    """A server that accepts and never answers (SIGSTOP): StoreError and 503 within
    command_timeout, then a working store again once it answers."""
    server = start_server(tmp_path / "hung")
    store = RedisStore(server.url, command_timeout=0.5)
    try:
        assert await store.get("a" * 64) is None  # connected before the hang
        os.kill(server.pid, signal.SIGSTOP)
        try:
            for call in (
                store.get("a" * 64),
                store.insert(NewClaim("b" * 64, "h", "t", *_claim_times())),
                store.complete(
                    "b" * 64, "t", RESPONSE, now=_claim_times()[0], ttl=_claim_times()[2]
                ),
            ):
                started = time.monotonic()
                with pytest.raises(StoreError):
                    await call
                took = time.monotonic() - started
                assert took < 1.2  # command_timeout, not one timeout per retry
            app = tiny(store)
            async with app.client() as c:
                r = await c.post("/pay", json={}, headers={"Idempotency-Key": "hung"})
            assert r.status_code == 503
            assert app.calls == {}
        finally:
            os.kill(server.pid, signal.SIGCONT)
        # The timed-out connections were dropped, not left with a reply in flight.
        new = NewClaim("c" * 64, "h", "t", *_claim_times())
        assert await store.insert(new) is None
        assert (await store.get("c" * 64)) is not None
    finally:
        await store.close()
        server.stop()


def _claim_times() -> tuple[datetime, timedelta, timedelta]:
    return datetime.now(UTC), timedelta(seconds=30), timedelta(hours=1)


async def test_a_claim_that_timed_out_is_released_once_the_server_answers_again(
    tmp_path: Path, tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim of a request that got 503 (its call timed out on a paused server) was
    already sent, and runs when the server resumes: the key then held a claim nobody
    owns, 409 for the whole lease (30 s). Its token is known, so the store releases it
    in the background, fenced by the token, as soon as the server answers again."""
    server = start_server(tmp_path / "paused")
    store = RedisStore(server.url, command_timeout=0.5)
    app = tiny(store)
    client_key = "order-77-raw-client-key"
    digest = scoped_key("", client_key, "test")
    name = f"idem:{{{digest}}}"
    headers = {"Idempotency-Key": client_key}
    caplog.set_level(logging.INFO, logger="asgi_idempotency")
    try:
        async with app.client() as c:
            # Connected, and the scripts loaded (else the claim's EVALSHA would only meet
            # NOSCRIPT on the resumed server), before the pause.
            warm = await c.post("/pay", json={}, headers={"Idempotency-Key": "warm"})
            assert warm.status_code == 201
            os.kill(server.pid, signal.SIGSTOP)
            try:
                r = await c.post("/pay", json={"n": 1}, headers=headers)
                assert r.status_code == 503
            finally:
                os.kill(server.pid, signal.SIGCONT)
            started = time.monotonic()
            answers = []
            while time.monotonic() - started < 3:  # a tenth of the lease
                r = await c.post("/pay", json={"n": 1}, headers=headers)
                answers.append(r.status_code)
                if r.status_code != 409:
                    break
                await asyncio.sleep(0.05)
        assert answers[-1] == 201, answers
        assert "idempotent-replayed" not in r.headers
        assert app.calls == {"pay": 2}  # warm, and the retry
        assert await store.client.hget(name, "s") == b"completed"
        released = [rec for rec in caplog.records if "timed_out_claim_released" in rec.message]
        assert len(released) == 1, caplog.text
        assert digest[:16] in released[0].message
        assert client_key not in caplog.text
        assert digest not in caplog.text  # the first 16 hex digits only
    finally:
        await store.close()
        server.stop()


@pytest.fixture
def patient_cluster(tmp_path: Path) -> Iterator[OurCluster]:
    """3 primaries, no replicas, whose nodes wait 30 s before they call a silent node
    failed: one paused for a few seconds stays a healthy member, and nothing fails over."""
    cluster = start_cluster(tmp_path / "cluster", replicas=False)
    try:
        for node in cluster.nodes:
            node.cli("CONFIG", "SET", "cluster-node-timeout", "30000")
        yield cluster
    finally:
        cluster.stop()


def _keys_on(store: RedisStore, port: int, count: int) -> list[str]:
    """``count`` scoped keys whose records live on the cluster node at ``port``."""
    assert isinstance(store.client, RedisCluster)
    found = []
    for i in range(10_000):
        key = f"{i:064x}"
        node = store.client.get_node_from_key(f"idem:{{{key}}}")
        if node is not None and node.port == port:
            found.append(key)
            if len(found) == count:
                return found
    raise AssertionError(f"no {count} keys on port {port}")


async def test_a_hung_cluster_node_is_a_503_within_the_command_timeout(
    patient_cluster: OurCluster, tiny: Any
) -> None:
    """A cluster node that accepts and never answers (SIGSTOP): each call is a StoreError
    within command_timeout, not one socket timeout per retry of the cluster client; and
    the commands cut off leave no reply in flight on a pooled connection."""
    store = RedisStore(patient_cluster.url, command_timeout=1)
    digest = scoped_key("", "hung", "test")  # the tiny app's request below
    node = patient_cluster.primary_of(f"idem:{{{digest}}}")
    try:
        assert await store.get(digest) is None  # connected, and the slot map learnt
        a, b, c = _keys_on(store, node.port, 3)
        assert await store.insert(NewClaim(a, "h", "ta", *_claim_times())) is None
        os.kill(node.pid, signal.SIGSTOP)
        try:
            for call in (store.get(a), store.insert(NewClaim(b, "h", "tb", *_claim_times()))):
                started = time.monotonic()
                with pytest.raises(StoreError):
                    await call
                assert time.monotonic() - started < 1.5  # not 3 x 1 s
            app = tiny(store)
            started = time.monotonic()
            async with app.client() as client:
                r = await client.post("/pay", json={}, headers={"Idempotency-Key": "hung"})
            assert time.monotonic() - started < 1.5
            assert r.status_code == 503
            assert app.calls == {}
        finally:
            os.kill(node.pid, signal.SIGCONT)
        # Every connection a timeout cut off was dropped: each call reads its own reply.
        assert await store.insert(NewClaim(c, "h", "tc", *_claim_times())) is None
        held = await store.get(a)
        assert held is not None
        assert (held.token, held.status) == ("ta", RecordStatus.IN_PROGRESS)
        assert await store.get(c) is not None
    finally:
        await store.close()


async def test_fail_open_runs_the_handler_unguarded_when_redis_is_down(
    refused_url: str, tiny: Any
) -> None:
    port = urlsplit(refused_url).port
    store = RedisStore(f"redis://127.0.0.1:{port}/0", command_timeout=1)
    try:
        app = tiny(store, fail_open=True)
        async with app.client() as c:
            r = await c.post("/pay", json={}, headers={"Idempotency-Key": "open"})
        assert r.status_code == 201
        assert app.calls == {"pay": 1}
    finally:
        await store.close()


@pytest.fixture
def primary_and_replica(tmp_path: Path) -> Any:
    primary = start_server(tmp_path / "primary")
    replica = start_server(tmp_path / "replica")
    try:
        primary.cli("CONFIG", "SET", "repl-diskless-sync-delay", "0")
        replica.cli("REPLICAOF", "127.0.0.1", str(primary.port))
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


async def _wait_linked(replica: RedisServer) -> None:
    for _ in range(100):
        if "master_link_status:up" in replica.cli("INFO", "replication"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the replica never linked to its primary")


async def test_a_read_only_replica_is_a_store_error(primary_and_replica: Any) -> None:
    _, replica = primary_and_replica
    await _wait_linked(replica)
    store = RedisStore(replica.url)
    now = datetime.now(UTC)
    try:
        with pytest.raises(StoreError, match="ReadOnlyError"):
            await store.insert(NewClaim("a" * 64, "h", "t", now, NO_LEASE, HOUR))
    finally:
        await store.close()


async def test_wait_replicas_waits_for_a_replica_and_fails_without_one(
    primary_and_replica: Any,
) -> None:
    primary, replica = primary_and_replica
    await _wait_linked(replica)
    now = datetime.now(UTC)
    store = RedisStore(primary.url, command_timeout=10, wait_replicas=1, wait_timeout=5)
    lonely = RedisStore(primary.url, wait_replicas=2, wait_timeout=0.3)
    name = "idem:{" + "a" * 64 + "}"
    try:
        await store.client.script_flush()  # the pipelined EVALSHA reloads too
        assert await store.insert(NewClaim("a" * 64, "h", "t", now, NO_LEASE, HOUR)) is None
        # Acknowledged by the replica before the call returned: it is there now.
        assert replica.cli("HGET", name, "s").strip() == "in_progress"
        assert await store.complete("a" * 64, "t", RESPONSE, now=now, ttl=HOUR)
        assert replica.cli("HGET", name, "s").strip() == "completed"
        with pytest.raises(StoreError, match="WAIT: 1 of 2 replicas"):
            await lonely.insert(NewClaim("b" * 64, "h", "t", now, NO_LEASE, HOUR))
    finally:
        await store.close()
        await lonely.close()


async def test_wait_replicas_on_the_cluster_waits_on_the_keys_own_primary(
    redis_cluster_url: str,
) -> None:
    store = RedisStore(redis_cluster_url, wait_replicas=1, wait_timeout=2)
    now = datetime.now(UTC)
    try:
        await store.client.flushall()
        for k in ("1", "2", "3", "4", "5", "6"):  # spread over the primaries
            key = k * 64
            assert await store.insert(NewClaim(key, "h", "t", now, NO_LEASE, HOUR)) is None
            assert await store.complete(key, "t", RESPONSE, now=now, ttl=HOUR)
            assert await store.insert(NewClaim(key, "h", "u", now, NO_LEASE, HOUR)) is not None
    finally:
        await store.close()


@pytest.fixture
def replicated_cluster(tmp_path: Path) -> Iterator[OurCluster]:
    """3 primaries and a replica each, of this test's own (it moves their roles)."""
    cluster = start_cluster(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.stop()


def _replica_of(cluster: OurCluster, primary: RedisServer) -> RedisServer:
    nodes = [line.split() for line in primary.cli("CLUSTER", "NODES").splitlines()]
    primary_id = next(f[0] for f in nodes if "myself" in f[2])
    port = next(int(f[1].split(":")[1].split("@")[0]) for f in nodes if f[3] == primary_id)
    return next(n for n in cluster.nodes if n.port == port)


async def test_wait_mode_follows_a_moved_after_a_failover(replicated_cluster: OurCluster) -> None:
    """With wait_replicas, the write goes to the key's primary by the store's slot map.
    After a failover that map names a replica, which answers MOVED: the store refreshes
    the map and sends the write again, once, to the primary named now, within the
    command's deadline, rather than answering 503 where a fresh map would serve."""
    cluster = replicated_cluster
    store = RedisStore(cluster.url, command_timeout=3, wait_replicas=1, wait_timeout=1)
    now = datetime.now(UTC)
    key, other = "5" * 64, "6" * 64
    try:
        assert await store.insert(NewClaim(key, "h", "t", now, timedelta(minutes=1),
                                           timedelta(hours=1))) is None  # fmt: skip
        old = cluster.primary_of(f"idem:{{{key}}}")
        others = [k for k in _keys_on(store, old.port, 7) if k != key][:6]
        new = _replica_of(cluster, old)
        new.cli("CLUSTER", "FAILOVER")  # graceful: the old primary becomes its replica
        deadline = time.monotonic() + 30
        while cluster.roles().get(new.port) != "master" or cluster.roles().get(old.port) != (
            "slave"
        ):
            assert time.monotonic() < deadline, "the failover did not happen"
            await asyncio.sleep(0.05)
        cluster.wait_replicas_linked()
        cluster.wait_ok()
        # The store's map still names the old primary, now a replica that answers MOVED,
        # to every one of these at once: one refreshes the map, the others meet the
        # refresh in flight, and each follows its MOVED all the same.
        completed, *claimed = await asyncio.gather(
            store.complete(key, "t", RESPONSE, now=now, ttl=HOUR),
            *(store.insert(NewClaim(k, "h", "t", now, NO_LEASE, HOUR)) for k in others),
        )
        assert completed
        assert claimed == [None] * len(others)
        record = await store.get(key)
        assert record is not None
        assert record.status is RecordStatus.COMPLETED
        # The map is fresh now: the next write goes straight to the new primary.
        assert await store.insert(NewClaim(key, "h", "u", now, NO_LEASE, HOUR)) is not None
        assert await store.insert(NewClaim(other, "h", "u", now, NO_LEASE, HOUR)) is None
        assert isinstance(store.client, RedisCluster)
        assert all(node.port != old.port for node in store.client.get_primaries())
    finally:
        await store.close()


# Construction.


def test_urls_name_one_server_or_a_cluster() -> None:
    assert isinstance(RedisStore("redis://127.0.0.1:1/0"), Store)
    assert isinstance(RedisStore("redis://127.0.0.1:1/0").client, aioredis.Redis)
    assert isinstance(RedisStore("rediss://127.0.0.1:1/0").client, aioredis.Redis)
    assert isinstance(RedisStore("redis+cluster://127.0.0.1:1").client, RedisCluster)
    with pytest.raises(ValueError, match=r"redis\+cluster://host:port"):
        RedisStore("http://127.0.0.1:1")


@pytest.mark.parametrize(
    ("command_timeout", "wait_timeout"),
    [(1.0, 1.0), (1.0, 2.0), (0.5, 5.0), (5.0, 0.0), (5.0, -1.0)],
)
def test_wait_timeout_must_be_positive_and_shorter_than_the_command_timeout(
    command_timeout: float, wait_timeout: float
) -> None:
    """A WAIT that may block as long as the command's whole deadline would turn every
    write whose replicas are slow into a timeout, not a WAIT shortfall."""
    with pytest.raises(ValueError, match=r"wait_timeout.*command_timeout"):
        RedisStore("redis://127.0.0.1:1/0", command_timeout=command_timeout,
                   wait_replicas=1, wait_timeout=wait_timeout)  # fmt: skip
    with pytest.raises(ValueError, match="command_timeout"):
        RedisStore("redis://127.0.0.1:1/0", command_timeout=0)
    assert RedisStore("redis://127.0.0.1:1/0", command_timeout=2, wait_replicas=1,
                      wait_timeout=1.5)  # fmt: skip
    assert RedisStore("redis://127.0.0.1:1/0", command_timeout=0.5)  # no WAIT: not checked


async def test_a_passed_client_is_the_callers(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    store = RedisStore(client)
    await store.close()
    assert await client.ping()
    await client.aclose()
    with pytest.raises(ValueError, match="decode_responses=False"):
        RedisStore(aioredis.Redis.from_url(redis_url, decode_responses=True))


async def test_a_stale_owner_is_fenced_on_the_cluster_too(rstore: RedisStore) -> None:
    """The contract's fencing, through the lifecycle, on each store kind of this file."""
    t0 = datetime.now(UTC)
    lease, ttl = timedelta(seconds=0.5), timedelta(hours=1)
    old = await lifecycle.claim(rstore, "c" * 64, "h", "old", now=t0, lease=lease,
                                ttl=ttl)  # fmt: skip
    assert old.owned
    await asyncio.sleep(2 * lease.total_seconds())  # the server's clock decides the lease
    later = datetime.now(UTC)
    new = await lifecycle.claim(rstore, "c" * 64, "h", "new", now=later,
                                lease=lease, ttl=ttl)  # fmt: skip
    assert new.outcome is lifecycle.ClaimOutcome.TAKEN_OVER
    assert not await rstore.complete("c" * 64, "old", RESPONSE, now=later, ttl=ttl)
    assert not await rstore.renew("c" * 64, "old", now=later, lease=10 * lease)
    assert not await rstore.release("c" * 64, "old")
    assert await rstore.complete("c" * 64, "new", RESPONSE, now=later, ttl=ttl)


# One error boundary (issue 25): the driver's failures are StoreError (503), the rest
# is a bug and stays itself (a logged 500).


def test_the_boundary_maps_driver_failures_and_nothing_else() -> None:
    with pytest.raises(StoreError, match="ConnectionError"), REDIS_ERRORS:
        raise rexc.ConnectionError("Connection refused")
    with pytest.raises(StoreError), REDIS_ERRORS:
        raise rexc.ClusterDownError("CLUSTERDOWN The cluster is down")
    with pytest.raises(StoreError), REDIS_ERRORS:
        raise TimeoutError  # the store's own deadline
    with pytest.raises(KeyError), REDIS_ERRORS:
        raise KeyError("a bug of ours")


async def test_a_killed_server_is_a_store_error(tmp_path: Path) -> None:
    server = start_server(tmp_path / "killed")
    store = RedisStore(server.url, command_timeout=1)
    try:
        assert await store.insert(NewClaim("a" * 64, "h", "t", *_claim_times())) is None
        server.kill()
        with pytest.raises(StoreError, match="ConnectionError"):
            await store.insert(NewClaim("b" * 64, "h", "t", *_claim_times()))
        with pytest.raises(StoreError):
            await store.get("a" * 64)
    finally:
        await store.close()
        server.stop()


async def test_a_record_we_cannot_decode_is_a_bug_not_an_outage(rstore: RedisStore) -> None:
    """A record of a shape the store never writes (written here behind its back) makes
    the claim's reply undecodable: that is an error of ours to see in the log, not a 503."""
    key = "e" * 64
    await rstore.client.hset(
        f"idem:{{{key}}}", mapping={"h": "h", "s": "no-such-status", "t": "other", "c": "1",
                                    "l": "2", "e": "3"},
    )  # fmt: skip
    # KeyError as itself; through a batched pipeline, the batcher's RuntimeError of it.
    with pytest.raises((KeyError, RuntimeError), match="no-such-status") as raised:
        await rstore.insert(NewClaim(key, "h", "t", *_claim_times()))
    assert not isinstance(raised.value, StoreError), raised.value


async def test_a_client_of_the_wrong_kind_is_a_bug_not_an_outage(redis_url: str) -> None:
    """A synchronous client answers at once and its reply cannot be awaited: a TypeError
    of the caller's wiring, which used to pass for Redis being down (503)."""
    client = redis.Redis.from_url(redis_url)
    store = RedisStore(client)  # type: ignore[arg-type]  # the mistake under test
    try:
        # Through the pipeline's batcher: its RuntimeError of the TypeError, never a 503.
        with pytest.raises((TypeError, RuntimeError), match="can't be used in 'await'") as raised:
            await store.insert(NewClaim("f" * 64, "h", "t", *_claim_times()))
        assert not isinstance(raised.value, StoreError)
    finally:
        client.close()


async def test_capabilities_are_declared(redis_url: str) -> None:
    store = RedisStore(redis_url)
    try:
        assert capabilities(store) is store.capabilities
        # prune=False: Redis deletes each record itself when its TTL ends.
        assert store.capabilities == Capabilities(
            transactions=False,
            batching=True,
            stats=True,
            prune=False,
            audit=True,
            own_clock=True,  # leases on the server's TIME
        )
    finally:
        await store.close()
    assert not capabilities(RedisStore(redis_url, batching=False)).batching
    # Each write keeps its own script + WAIT pipeline.
    assert not capabilities(RedisStore(redis_url, wait_replicas=1, wait_timeout=0.5)).batching


async def test_the_row_in_a_claims_way_comes_back_byte_for_byte(rstore: RedisStore) -> None:
    """The insert script packs the row in its way into one reply (lengths, then the
    values back to back): bodies and headers holding spaces, newlines and any byte,
    and tokens of any text, come back exactly."""
    now, lease, ttl = _claim_times()
    key, token = "9" * 64, "a token\nwith a newline"
    response = StoredResponse(
        200, ((b"x-note", b"two words\t"), (b"content-type", b"text/plain")), b"a\nb c\x00\xff\n"
    )
    assert await rstore.insert(NewClaim(key, "h é 1", token, now, lease, ttl)) is None
    running = await rstore.insert(NewClaim(key, "h é 1", "other", now, lease, ttl))
    assert running is not None
    assert (running.request_hash, running.token, running.response) == ("h é 1", token, None)
    # The server's clock wrote the deadlines, and read the row a moment later.
    assert running.locked_until - running.created_at == lease
    assert running.expires_at - running.created_at == ttl
    assert running.read_at is not None
    assert running.created_at <= running.read_at < running.locked_until
    assert await rstore.complete(key, token, response, now=now, ttl=ttl)
    done = await rstore.insert(NewClaim(key, "h é 1", "other", now, lease, ttl))
    assert done is not None
    assert (done.status, done.response) == (RecordStatus.COMPLETED, response)
    empty = StoredResponse(204, (), b"")
    assert await rstore.insert(NewClaim("8" * 64, "h", "t", now, lease, ttl)) is None
    assert await rstore.complete("8" * 64, "t", empty, now=now, ttl=ttl)
    again = await rstore.insert(NewClaim("8" * 64, "h", "u", now, lease, ttl))
    assert again is not None
    assert again.response == empty
    assert again._replace(read_at=None) == await rstore.get("8" * 64)


async def test_a_completion_resent_after_a_client_kill_is_no_lost_claim(
    redis_url: str, tiny: TinyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The completion ran on the server, its reply was lost, and the connection was then
    ``CLIENT KILL``ed: redis-py sends it again on a new connection, which meets the row
    completed under its own token with its own response. That is the completion
    succeeding, not ``idempotency.claim_lost`` at ERROR. The proxy only holds the reply
    back; the kill is the server's own."""
    server = urlsplit(redis_url)
    assert server.hostname is not None
    assert server.port is not None
    proxy = TcpProxy(server.hostname, server.port)
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0")
    try:
        await store.client.flushall()
        app = tiny(store, principal=ANONYMOUS)
        body = {"wait": True}
        headers = {"Idempotency-Key": "k"}
        with caplog.at_level(logging.WARNING, logger="asgi_idempotency"):
            async with app.client() as client:
                warm = await client.post("/pay", json={}, headers={"Idempotency-Key": "warm"})
                assert warm.status_code == 201  # connected, scripts loaded
                request = asyncio.ensure_future(client.post("/pay", json=body, headers=headers))
                await app.entered.wait()  # claimed; the next command is the completion
                proxy.lose_next_answer()
                app.gate.set()
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while not proxy.answers_lost:  # the server answered: the completion landed
                    assert loop.time() < deadline, "the completion never reached the server"
                    await asyncio.sleep(0.01)
                redis_cli(server.port, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                first = await request
                replay = await client.post("/pay", json=body, headers=headers)
    finally:
        await store.close()
        proxy.close()
    assert first.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == first.json()
    assert app.calls["pay"] == 2  # warm, and k once
    events = [r.__dict__.get("event") for r in caplog.records]
    assert "idempotency.claim_lost" not in events

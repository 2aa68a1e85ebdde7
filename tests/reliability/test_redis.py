"""Redis under stress and failure: storms, a killed worker, a killed server, a failover.

Real ``redis-server`` processes the tests start (and stop by PID), real uvicorn
workers where processes matter. The guarantee checked throughout: no key's handler
runs twice, whatever the store does, and while the store cannot answer a guarded
request gets 503 + Retry-After and the handler does not run.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from asgi_idempotency.stores.redis import RedisStore
from tests.conftest import redis_store
from tests.helpers.redis_servers import (
    RedisCluster,
    RedisServer,
    redis_cli,
    start_cluster,
    start_server,
)

from ..helpers.serving import run_uvicorn
from .apps import refund_app
from .redis_app import APP, effects, env_for

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

PROBLEM = "application/problem+json"


def _key(name: str) -> dict[str, str]:
    return {"Idempotency-Key": name}


async def test_a_storm_of_100_same_key_requests_runs_the_handler_once(rstore: RedisStore) -> None:
    t = refund_app(rstore)
    async with asyncio.timeout(60), t.client() as c:
        storm = await asyncio.gather(
            *(
                c.post("/refunds", json={"amount": 5, "sleep": 0.3}, headers=_key("storm"))
                for _ in range(100)
            )
        )
        after = await c.post("/refunds", json={"amount": 5, "sleep": 0.3}, headers=_key("storm"))
    assert t.calls["refund"] == 1
    statuses = Counter(r.status_code for r in storm)
    assert set(statuses) <= {201, 409}, statuses
    executed = [r for r in storm if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    assert len(executed) == 1
    refund_id = executed[0].json()["refund_id"]
    assert all(r.json()["refund_id"] == refund_id for r in storm if r.status_code == 201)
    assert after.headers["idempotent-replayed"] == "true"
    assert after.json()["refund_id"] == refund_id


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["redis_url", "redis_cluster_url"])
async def test_a_storm_across_four_uvicorn_workers_runs_the_handler_once(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url: str = request.getfixturevalue(kind)
    done = tmp_path / "effects.log"
    store = await redis_store(url)  # flushes
    await store.close()
    path = "/orders/o-storm/refunds"
    with run_uvicorn(APP, env=env_for(url, done), log_dir=tmp_path, workers=4) as server:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30, limits=limits) as c:
            storm = await asyncio.gather(
                *(
                    c.post(path, json={"amount": 1, "delay": 0.5}, headers=_key("storm-4"))
                    for _ in range(100)
                )
            )
    statuses = Counter(r.status_code for r in storm)
    assert set(statuses) <= {201, 409}, statuses
    assert [order for order, _, _ in effects(done)] == ["o-storm"]
    [(_, refund_id, _)] = effects(done)
    assert all(r.json()["refund_id"] == refund_id for r in storm if r.status_code == 201)


@pytest.mark.slow
async def test_the_incident_on_redis_a_timed_out_client_gets_409_then_the_original_refund(
    redis_url: str, tmp_path: Path
) -> None:
    """The README's incident across two app processes on one Redis: the client gives up
    at 0.4 s on a 1.5 s refund and retries elsewhere; the refund happens once."""
    done = tmp_path / "effects.log"
    await (await redis_store(redis_url)).close()  # flushed
    path, key = "/orders/o-7/refunds", _key("refund-o-7")
    body = {"amount": 4500, "delay": 1.5}
    env = env_for(redis_url, done)
    with (
        run_uvicorn(APP, env=env, log_dir=tmp_path) as a,
        run_uvicorn(APP, env=env, log_dir=tmp_path) as b,
    ):
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.4)) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(a.base_url + path, json=body, headers=key)
            during = await c.post(b.base_url + path, json=body, headers=key)
            assert during.status_code == 409
            assert int(during.headers["retry-after"]) >= 1
            for _ in range(100):
                await asyncio.sleep(0.1)
                late = await c.post(b.base_url + path, json=body, headers=key)
                if late.status_code != 409:
                    break
    assert late.status_code == 201
    assert late.headers["idempotent-replayed"] == "true"
    [(order, refund_id, _)] = effects(done)
    assert (order, late.json()["refund_id"]) == ("o-7", refund_id)


async def _record_status(store: RedisStore) -> list[Any]:
    names = [n async for n in store.client.scan_iter(match="idem:*")]
    return [await store.client.hget(n, "s") for n in names]


@pytest.mark.slow
async def test_a_worker_killed_mid_handler_is_409_until_its_lease_ends_then_taken_over_once(
    redis_url: str, tmp_path: Path
) -> None:
    lease = 2.0
    done = tmp_path / "effects.log"
    store = await redis_store(redis_url)
    assert isinstance(store, RedisStore)
    path, key = "/orders/o-9/refunds", _key("refund-o-9")
    body = {"amount": 900, "delay": 3.0}  # the doomed owner is killed long before its effect
    try:
        with (
            run_uvicorn(APP, env=env_for(redis_url, done, lease=lease), log_dir=tmp_path) as doomed,
            run_uvicorn(
                APP, env=env_for(redis_url, done, lease=lease), log_dir=tmp_path, workers=2
            ) as survivor,
        ):
            async with httpx.AsyncClient(timeout=20) as client:
                first = asyncio.create_task(
                    client.post(doomed.base_url + path, json=body, headers=key)
                )
                for _ in range(200):
                    if await _record_status(store) == [b"in_progress"]:
                        break
                    await asyncio.sleep(0.02)
                [name] = [n async for n in store.client.scan_iter(match="idem:*")]
                claimed_until = int(await store.client.hget(name, "l") or 0)
                for _ in range(200):  # a live owner renews its lease
                    if int(await store.client.hget(name, "l") or 0) > claimed_until:
                        break
                    await asyncio.sleep(0.05)
                else:
                    pytest.fail("the live owner never renewed its lease")
                doomed.kill(signal.SIGKILL)
                with pytest.raises(httpx.TransportError):
                    await first
                locked_until = int(await store.client.hget(name, "l") or 0) / 1e6

                early = await client.post(survivor.base_url + path, json=body, headers=key)
                assert time.time() < locked_until  # answered inside the lease
                assert early.status_code == 409
                assert early.headers["content-type"] == PROBLEM

                await asyncio.sleep(max(0.0, locked_until - time.time()) + 0.1)
                racers = await asyncio.gather(
                    *(
                        client.post(survivor.base_url + path, json=body, headers=key)
                        for _ in range(4)
                    )
                )
        statuses = Counter(r.status_code for r in racers)
        assert statuses[201] >= 1, statuses
        assert set(statuses) <= {201, 409}, statuses
        executed = [
            r for r in racers if r.status_code == 201 and "idempotent-replayed" not in r.headers
        ]
        assert len(executed) == 1
        assert [o for o, _, _ in effects(done)] == ["o-9"]  # the killed owner never got there
        assert await store.client.hget(name, "s") == b"completed"
    finally:
        await store.close()


class Load:
    """A steady stream of guarded requests, each fresh key sent then replayed.

    Records every answer per key, so that a test can check that no key ran twice and
    how each was answered while the store was away.
    """

    def __init__(self, client: httpx.AsyncClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.answers: dict[str, list[httpx.Response]] = {}
        self.stop = asyncio.Event()
        self.n = 0

    async def post(self, key: str) -> httpx.Response:
        r = await self.client.post("/refunds", json={"amount": 1}, headers=_key(key))
        self.answers.setdefault(key, []).append(r)
        return r

    async def lane(self, lane: int) -> None:
        while not self.stop.is_set():
            self.n += 1
            key = f"{self.prefix}-{lane}-{self.n}"
            await self.post(key)
            await self.post(key)
            await asyncio.sleep(0.005)

    def check(self) -> Counter[int]:
        statuses: Counter[int] = Counter()
        for key, answers in self.answers.items():
            executed = {
                r.json()["refund_id"]
                for r in answers
                if r.status_code == 201 and "idempotent-replayed" not in r.headers
            }
            assert len(executed) <= 1, f"{key} executed twice: {executed}"
            for r in answers:
                statuses[r.status_code] += 1
                assert r.status_code in (201, 409, 503), (key, r.status_code, r.text)
                if r.status_code == 201 and r.headers.get("idempotent-replayed") == "true":
                    assert r.json()["refund_id"] in executed or not executed
                if r.status_code in (409, 503):
                    assert r.headers["content-type"] == PROBLEM
                    assert int(r.headers["retry-after"]) >= 1
        return statuses


async def _until(what: str, predicate: Any, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.05)


async def _assert_replayed(c: httpx.AsyncClient, before: dict[str, list[httpx.Response]]) -> None:
    """Every key answered 201 and asked again before the outage replays that first answer."""
    for key, answers in before.items():
        firsts = [r for r in answers if r.status_code == 201]
        if not firsts or len(answers) < 2:
            continue  # in flight at the outage
        again = await c.post("/refunds", json={"amount": 1}, headers=_key(key))
        assert again.status_code == 201, (key, again.status_code, again.text)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json()["refund_id"] == firsts[0].json()["refund_id"]


@pytest.fixture
def durable_redis(tmp_path: Path) -> Any:
    """A server of its own with ``appendfsync always``: every acknowledged write is on disk."""
    server = start_server(tmp_path / "aof", "--appendonly", "yes", "--appendfsync", "always")
    try:
        yield server
    finally:
        server.stop()


async def test_redis_killed_and_restarted_mid_load(durable_redis: RedisServer) -> None:
    """SIGKILL mid-load: 503 + Retry-After while it is gone, correct after, never twice.

    With ``appendfsync always`` every completion the client saw acknowledged survives
    the crash: keys answered 201 before it replay the same response after it. A
    request in flight at the crash may have run its handler and lost its completion:
    its key stays claimed (409) until the lease ends, and is never run again before.
    """
    store = RedisStore(durable_redis.url, command_timeout=1)
    t = refund_app(store)
    try:
        async with asyncio.timeout(90), t.client() as c:
            load = Load(c, "k")
            lanes = [asyncio.create_task(load.lane(i)) for i in range(4)]
            await _until("some load", lambda: _true(load.n > 40))
            before = {k: list(v) for k, v in load.answers.items()}
            durable_redis.kill()
            await _until("503s", lambda: _true(load.check()[503] >= 8))
            calls_while_down = t.calls["refund"]
            await asyncio.sleep(0.3)
            assert t.calls["refund"] == calls_while_down  # no handler starts while it is gone
            durable_redis.start()
            await _until("recovery", lambda: _true(_recovered(load)))
            mark = load.n
            await _until("more load", lambda: _true(load.n > mark + 40))
            load.stop.set()
            await asyncio.gather(*lanes)

            # Everything acknowledged before the crash is still there, verbatim.
            await _assert_replayed(c, before)
        statuses = load.check()
        assert statuses[503] >= 8, statuses
        assert statuses[201] > 80, statuses
        assert t.calls["refund"] == len(t.finished)
    finally:
        await store.close()


def _true(value: bool) -> Any:
    async def answer() -> bool:
        return value

    return answer()


def _recovered(load: Load) -> bool:
    """The last few answers of the load were all 201."""
    last = [r for answers in load.answers.values() for r in answers][-6:]
    return len(last) == 6 and all(r.status_code == 201 for r in last)


async def test_without_persistence_a_restart_forgets_completed_keys(tmp_path: Path) -> None:
    """What the README says about ``--appendonly no`` (and ``--save ""``): a restart loses
    every record, and a key retried after it runs again. Pinned so the claim stays true."""
    server = start_server(tmp_path / "volatile")
    store = RedisStore(server.url, command_timeout=1)
    t = refund_app(store)
    try:
        async with t.client() as c:
            first = await c.post("/refunds", json={"amount": 1}, headers=_key("volatile"))
            server.kill()
            server.start()
            for _ in range(5):  # the pool's broken connection may fail one request
                again = await c.post("/refunds", json={"amount": 1}, headers=_key("volatile"))
                if again.status_code != 503:
                    break
        assert first.status_code == again.status_code == 201
        assert "idempotent-replayed" not in again.headers
        assert t.calls["refund"] == 2
    finally:
        await store.close()
        server.stop()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Any:
    cluster = start_cluster(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.stop()


def _primary_of(cluster: RedisCluster, key: str) -> RedisServer:
    return cluster.primary_of(key)


@pytest.mark.slow
async def test_a_cluster_primary_killed_mid_load_fails_over_with_503s_and_never_twice(
    own_cluster: RedisCluster,
) -> None:
    """A primary is SIGKILLed mid-load; its replica takes over after the node timeout
    (1 s) and an election. ``wait_replicas=1``: every claim and completion the client
    saw was on the replica before it was acknowledged, so none is lost."""
    store = RedisStore(own_cluster.url, command_timeout=1, wait_replicas=1, wait_timeout=0.5)
    t = refund_app(store)
    try:
        async with asyncio.timeout(120), t.client() as c:
            load = Load(c, "c")
            lanes = [asyncio.create_task(load.lane(i)) for i in range(4)]
            await _until("some load", lambda: _true(load.n > 40))
            before = {k: list(v) for k, v in load.answers.items()}
            victim_key = "idem:{" + _scoped_of(next(iter(before))) + "}"
            victim = _primary_of(own_cluster, victim_key)
            victim.kill()
            await _until("503s", lambda: _true(load.check()[503] >= 3))
            await _until("the failover", lambda: _true(_masters(own_cluster) == 3), within=30)
            # Promoted, the replica has no replica of its own: with wait_replicas=1 its
            # writes fail (503) until the old primary comes back, as its replica.
            victim.start()
            await _until("recovery", lambda: _true(_recovered(load)), within=30)
            mark = load.n
            await _until("more load", lambda: _true(load.n > mark + 40))
            load.stop.set()
            await asyncio.gather(*lanes)

            await _assert_replayed(c, before)
        statuses = load.check()
        assert statuses[503] >= 3, statuses
        assert statuses[201] > 80, statuses
        assert own_cluster.roles()[victim.port] == "slave"
    finally:
        await store.close()


@pytest.mark.slow
async def test_a_graceful_cluster_failover_mid_load_never_runs_a_key_twice(
    own_cluster: RedisCluster,
) -> None:
    """``CLUSTER FAILOVER`` on a replica: the primary pauses writes while they swap."""
    store = RedisStore(own_cluster.url, command_timeout=1)
    t = refund_app(store)
    try:
        async with asyncio.timeout(120), t.client() as c:
            load = Load(c, "g")
            lanes = [asyncio.create_task(load.lane(i)) for i in range(4)]
            await _until("some load", lambda: _true(load.n > 40))
            replica = next(p for p, role in own_cluster.roles().items() if role == "slave")
            redis_cli(replica, "CLUSTER", "FAILOVER")
            await _until("the swap", lambda: _true(own_cluster.roles()[replica] == "master"))
            mark = load.n
            await _until("more load", lambda: _true(load.n > mark + 60))
            load.stop.set()
            await asyncio.gather(*lanes)
        statuses = load.check()
        assert statuses[201] > 80, statuses
    finally:
        await store.close()


def _masters(cluster: RedisCluster) -> int:
    return list(cluster.roles().values()).count("master")


def _scoped_of(client_key: str) -> str:
    from asgi_idempotency.core.keys import scoped_key

    return scoped_key("", client_key, "test")  # the host of refund_app.client()

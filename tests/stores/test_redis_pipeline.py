"""Redis pipelining (``RedisStore(batching=True)``, the default), on real servers.

While a command to a server (a slot's primary, on a cluster) is in flight, what arrives
for it leaves as one pipeline of the same scripts; each request is answered from its
own reply. Counted by the store's batch stats (pipelines sent) and by the servers'
``INFO commandstats`` (scripts run).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from asgi_idempotency import StoredResponse, StoreError
from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.lifecycle import ClaimOutcome
from asgi_idempotency.stores.base import NewClaim, RecordStatus
from asgi_idempotency.stores.redis import RedisStore
from tests.helpers.redis_servers import RedisCluster as OurCluster
from tests.helpers.redis_servers import redis_cli, start_server
from tests.stores.test_redis import _commandstats, _keys_on, _ports, patient_cluster

__all__ = ["patient_cluster"]  # the fixture, shared with test_redis.py

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id":1}')
LEASE, TTL = timedelta(seconds=30), timedelta(hours=1)


def _new(key: str, token: str, request_hash: str = "h") -> NewClaim:
    now = datetime.now(UTC)
    return NewClaim(key, request_hash, token, now, LEASE, TTL)


async def _claim(store: RedisStore, key: str, token: str, request_hash: str = "h") -> ClaimOutcome:
    now = datetime.now(UTC)
    answer = await lifecycle.claim(store, key, request_hash, token, now=now,
                                   lease=LEASE, ttl=TTL)  # fmt: skip
    return answer.outcome


async def test_concurrent_claims_share_pipelines_and_each_is_answered(
    rstore: RedisStore,
) -> None:
    """200 claims of distinct keys at once: fewer pipelines than requests, every script
    run once, and each claim's record is its own."""
    assert rstore.batching
    # Connected, the slot map learnt (a cluster), the scripts loaded (one claim per node).
    await asyncio.gather(*(rstore.insert(_new(f"{i:064x}", "warm")) for i in range(1000, 1030)))
    ports = _ports(rstore)
    before, stats = _commandstats(ports).get("evalsha", 0), rstore.batch_stats
    keys = [f"{i:064x}" for i in range(200)]
    answers = await asyncio.gather(*(rstore.insert(_new(k, f"t{i}")) for i, k in enumerate(keys)))
    assert answers == [None] * len(keys)
    sent = rstore.batch_stats
    pipelines = sent.statements - stats.statements
    assert sent.operations - stats.operations == len(keys)
    assert pipelines < len(keys) / 4, sent  # a few per server, not one per request
    assert _commandstats(ports)["evalsha"] - before == len(keys)
    records = [await rstore.get(k) for k in keys]  # reads are not batched: one at a time
    assert [(r.token, r.status) for r in records if r is not None] == [
        (f"t{i}", RecordStatus.IN_PROGRESS) for i in range(len(keys))
    ]
    # Completions, releases and renewals share pipelines too, each fenced by its token.
    done = await asyncio.gather(
        *(rstore.complete(k, f"t{i}", RESPONSE, now=datetime.now(UTC), ttl=TTL)
          for i, k in enumerate(keys[:100])),
        *(rstore.release(k, "not-the-owner") for k in keys[100:150]),
        *(rstore.renew(k, f"t{i + 150}", now=datetime.now(UTC), lease=2 * LEASE)
          for i, k in enumerate(keys[150:])),
    )  # fmt: skip
    assert done == [True] * 100 + [False] * 50 + [True] * 50
    assert rstore.batch_stats.statements - sent.statements < 150 / 4


async def test_claims_of_one_key_in_one_pipeline_run_once(rstore: RedisStore) -> None:
    """Twenty claims of one key in one pipeline: the scripts run in order, so the first
    claims and the others meet its claim (409); once it completed, a storm of the same
    request all replay, and another request is a 422."""
    key, other = _one_servers_keys(rstore, 2)  # one batcher for both
    await rstore.get(key)
    before = rstore.batch_stats
    # The first claim of another key finds the server idle and goes alone; the twenty
    # arrive while it is in flight, and leave together.
    alone, *outcomes = await asyncio.gather(
        _claim(rstore, other, "first"), *(_claim(rstore, key, f"t{i}") for i in range(20))
    )
    assert alone is ClaimOutcome.CLAIMED
    assert rstore.batch_stats.largest >= 20  # they went together
    assert rstore.batch_stats.statements - before.statements == 2
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 19
    owner = f"t{outcomes.index(ClaimOutcome.CLAIMED)}"
    assert owner == "t0"  # arrival order
    assert await rstore.complete(key, owner, RESPONSE, now=datetime.now(UTC), ttl=TTL)
    storm = await asyncio.gather(
        *(_claim(rstore, key, f"r{i}") for i in range(20)), _claim(rstore, key, "x", "other")
    )
    assert storm == [ClaimOutcome.COMPLETED] * 20 + [ClaimOutcome.MISMATCH]
    record = await rstore.get(key)
    assert record is not None
    assert (record.token, record.response) == (owner, RESPONSE)


async def test_a_failed_pipeline_fails_each_request_with_its_own_error(tmp_path: Path) -> None:
    server = start_server(tmp_path / "dies")
    store = RedisStore(server.url, command_timeout=1)
    try:
        assert await store.insert(_new("b" * 64, "warm")) is None
        server.kill()
        results = await asyncio.gather(
            *(store.insert(_new(f"{i:064x}", f"t{i}")) for i in range(10)), return_exceptions=True
        )
        assert all(isinstance(r, StoreError) for r in results), results
        assert len({id(r) for r in results}) == 10  # one error each, not one shared
    finally:
        await store.close()
        server.stop()


async def test_a_cancelled_waiter_never_cancels_its_pipeline(rstore: RedisStore) -> None:
    """The pipeline runs in the batcher's task: a waiter that goes away loses only its
    answer. Its claim, which landed, is the lifecycle's ``orphaned`` callback's to release
    (the store adds no release path of its own)."""
    keys = _one_servers_keys(rstore, 10)
    await rstore.get(keys[0])
    orphaned: list[NewClaim] = []
    now = datetime.now(UTC)
    tasks = [
        asyncio.create_task(
            lifecycle.claim(
                rstore,
                k,
                "h",
                f"t{i}",
                now=now,
                lease=LEASE,
                ttl=TTL,
                orphaned=orphaned.append,
            )
        )
        for i, k in enumerate(keys)
    ]
    # The first goes alone and the nine queue behind it. As it returns it starts the
    # batcher's task, which takes the nine into one pipeline before this test resumes
    # (the loop runs ready callbacks in order); the pipeline's replies can only be read
    # in a later pass, so the waiter cancelled now is one whose pipeline is in flight.
    await tasks[0]
    assert rstore.batch_stats.operations == 10
    assert not tasks[3].done()
    tasks[3].cancel()
    rest = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(rest[3], asyncio.CancelledError)
    assert all(r == lifecycle.CLAIMED for i, r in enumerate(rest) if i != 3)
    assert [o.token for o in orphaned] == ["t3"]
    landed = await rstore.get(keys[3])
    assert landed is not None  # the pipeline went on: its claim ran
    assert await lifecycle.release_orphan(rstore, orphaned[0])
    assert await rstore.get(keys[3]) is None


async def test_batching_off_sends_one_command_per_request(redis_url: str) -> None:
    store = RedisStore(redis_url, batching=False)
    try:
        answers = await asyncio.gather(*(store.insert(_new(f"c{i:063x}", "t")) for i in range(20)))
        assert answers == [None] * 20
        assert store.batch_stats.statements == 0
    finally:
        await store.close()


async def test_max_batch_bounds_a_pipeline(redis_url: str) -> None:
    store = RedisStore(redis_url, max_batch=4)
    try:
        await store.get("0" * 64)
        await asyncio.gather(*(store.insert(_new(f"d{i:063x}", "t")) for i in range(20)))
        assert store.batch_stats.largest == 4
        assert store.batch_stats.operations == 20
    finally:
        await store.close()
    with pytest.raises(ValueError, match="max_batch"):
        RedisStore(redis_url, max_batch=0)


def _one_servers_keys(store: RedisStore, count: int) -> list[str]:
    """``count`` keys whose records live on one server (one primary, on a cluster), so
    that their operations share one batcher."""
    keys = [f"{i + 1:064x}" for i in range(count)]
    if isinstance(store.client, RedisCluster):
        node = store.client.get_node_from_key(f"idem:{{{keys[0]}}}")
        assert node is not None
        keys = _keys_on(store, int(node.port), count)
    return keys


def _keys_in_slot(slot: int, count: int) -> list[str]:
    found = []
    for i in range(2_000_000):
        key = f"{i:064x}"
        if key_slot(f"idem:{{{key}}}".encode()) == slot:
            found.append(key)
            if len(found) == count:
                return found
    raise AssertionError(f"no {count} keys in slot {slot}")


async def test_a_pipeline_that_meets_a_moved_slot_resends_those_commands(
    patient_cluster: OurCluster,
) -> None:
    """A slot moves to another primary after the store learnt the map: the pipeline to
    the old owner runs its other scripts, gets MOVED for that slot's (which did not
    run), and those are sent again through the cluster client, to the new owner."""
    cluster = patient_cluster
    store = RedisStore(cluster.url, command_timeout=3)
    try:
        await store.get("0" * 64)  # the slot map, learnt now
        source = cluster.primary_of("idem:{" + "0" * 64 + "}")
        target = next(n for n in cluster.nodes if n.port != source.port)
        others = _keys_on(store, source.port, 30)
        slot = key_slot(f"idem:{{{others[0]}}}".encode())
        moving = _keys_in_slot(slot, 3)
        staying = [k for k in others if key_slot(f"idem:{{{k}}}".encode()) != slot][:10]
        # An empty slot changes owner by telling every node (CLUSTER SETSLOT ... NODE).
        target_id = target.cli("CLUSTER", "MYID").strip()
        for node in [target, *(n for n in cluster.nodes if n is not target)]:
            node.cli("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
        cluster.wait_ok()
        assert cluster.primary_of(f"idem:{{{moving[0]}}}").port == target.port
        before = store.batch_stats
        # The first goes alone; the rest queue behind it and leave as one pipeline to
        # the old owner, as the store's (stale) map says.
        keys = [staying[0], *moving, *staying[1:]]
        answers = await asyncio.gather(
            *(store.insert(_new(k, f"t{i}")) for i, k in enumerate(keys))
        )
        assert answers == [None] * len(keys)
        assert store.batch_stats.largest >= len(keys) - 1
        assert store.batch_stats.statements - before.statements == 2
        for i, key in enumerate(keys):
            record = await store.get(key)
            assert record is not None
            assert record.token == f"t{i}"
        assert target.cli("EXISTS", f"idem:{{{moving[0]}}}").strip() == "1"
        # The old owner answered MOVED to the moved slot's three, and ran none of them.
        assert "errorstat_MOVED:count=3" in source.cli("INFO", "errorstats")
    finally:
        await store.close()


async def test_scripts_flushed_on_the_server_are_reloaded_for_a_pipeline(
    rstore: RedisStore,
) -> None:
    """A pipelined EVALSHA is not reloaded by redis-py: after SCRIPT FLUSH the store
    loads what the server lost and sends those commands again (they did not run)."""
    keys = [f"{i + 500:064x}" for i in range(11)]
    if isinstance(rstore.client, RedisCluster):
        # All on one primary, so that no request finds another server idle and, alone,
        # reloads the script everywhere (the cluster client's SCRIPT LOAD) first.
        node = rstore.client.get_node_from_key(f"idem:{{{keys[0]}}}")
        assert node is not None
        keys = _keys_on(rstore, int(node.port), 11)
    first, keys = keys[0], keys[1:]
    assert await asyncio.gather(*(rstore.insert(_new(k, "t")) for k in keys)) == [None] * 10
    await rstore.client.script_flush()  # every primary, on a cluster
    before = _errorstats(_ports(rstore)).get("NOSCRIPT", 0)
    expires = datetime.now(UTC) + TTL
    # The first finds its server idle and reloads its own script; the completions
    # queue behind it and meet NOSCRIPT in their pipeline.
    blocker, *done = await asyncio.gather(
        rstore.insert(_new(first, "t")),
        *(rstore.complete(k, "t", RESPONSE, now=expires - TTL, ttl=TTL) for k in keys),
    )
    assert blocker is None
    assert done == [True] * 10
    # The blocker's one, and each completion's once: none ran twice, none was lost.
    assert _errorstats(_ports(rstore))["NOSCRIPT"] - before == 11
    for key in keys:
        record = await rstore.get(key)
        assert record is not None
        assert record.response == RESPONSE


def _errorstats(ports: list[int]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for port in ports:
        for line in redis_cli(port, "INFO", "errorstats").splitlines():
            if line.startswith("errorstat_"):
                name, _, fields = line.removeprefix("errorstat_").partition(":")
                totals[name] = totals.get(name, 0) + int(fields.split("=")[1])
    return totals

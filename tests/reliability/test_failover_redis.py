"""A Redis master SIGKILLed under traffic and its replica promoted by three Sentinels, on
the URL users write for it (``redis+sentinel://h1:p1,h2:p2,h3:p3/mymaster/0``) with
``wait_replicas=1`` in its query, and on the documented
``RedisStore(Sentinel(...).master_for(...), wait_replicas=1)``.

Real processes (``tests/helpers/redis_sentinels.py``); the app runs in-process, as in the other
store-fault tests, so the test counts each key's handler runs itself. The scenario and
its checks: ``failover.py``. With ``wait_replicas=1`` every claim and completion a
client saw acknowledged was on the replica first, so the promoted replica has them all;
promoted, it has no replica of its own, so its writes get 503 until the old master
comes back as its replica (:meth:`SentinelGroup.rejoin`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel

from asgi_idempotency.stores.redis import RedisStore
from asgi_idempotency.stores.registry import open_store

from ..helpers.redis_sentinels import SERVICE, SentinelGroup, start_group
from .failover import effect_app, run_failover

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.slow]

LEASE = 10.0  # seconds: in-flight completions are retried for this long


@pytest.fixture
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    try:
        group = start_group(tmp_path_factory.mktemp("sentinel"))
    except RuntimeError as exc:  # missing binaries or a failed start: say which, never skip
        pytest.fail(str(exc), pytrace=False)
    try:
        yield group
    finally:
        group.stop()


def _store(group: SentinelGroup, how: str) -> tuple[RedisStore, list[Redis]]:
    """The store, and what the test closes itself (the clients of a Sentinel it built)."""
    if how == "url":
        store = open_store(group.url("wait_replicas=1&wait_timeout=0.5"), command_timeout=2)
        assert isinstance(store, RedisStore)
        return store, []
    sentinel = Sentinel(
        [("127.0.0.1", s.port) for s in group.sentinels],
        sentinel_kwargs={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
    )
    client = sentinel.master_for(SERVICE, socket_timeout=2, socket_connect_timeout=2)
    # Its Sentinels' clients as built: redis-py's discovery reorders the list with a
    # swap across an await, and under concurrent discoveries one can drop out of it.
    return RedisStore(client, wait_replicas=1, wait_timeout=0.5), [client, *sentinel.sentinels]


@pytest.mark.parametrize("how", ["url", "master_for"])
async def test_a_killed_master_and_a_promoted_replica_lose_nothing_and_run_nothing_twice(
    how: str, group: SentinelGroup
) -> None:
    store, ours = _store(group, how)
    app, runs = effect_app(store, lease=LEASE)
    old, new = group.master, group.replica

    async def promote() -> float:
        await asyncio.to_thread(group.wait_promoted, new.port)
        promoted = time.monotonic()
        await asyncio.to_thread(group.rejoin, old, new.port)
        return promoted

    try:
        outcome = await run_failover(app, runs, kill=old.kill, promote=promote)
    finally:
        await asyncio.wait_for(store.close(), 10)
        for client in ours:
            await client.aclose()
    print(outcome.summary())
    outcome.check()

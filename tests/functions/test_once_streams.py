"""Duplicate delivery from a real broker: a Redis Streams consumer group.

A slow consumer takes a message and is still at work when the message's idle time
passes; a second consumer takes it over with ``XAUTOCLAIM`` and delivers it again,
as a consumer group is meant to when a consumer may have died. Unguarded, the refund
is issued twice. Guarded by :class:`Once` (on a :class:`RedisStore` on the same
server), the second delivery waits for the first holder's result instead of running,
so the refund is issued once; in both runs every delivery is acknowledged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from asgi_idempotency import Once
from asgi_idempotency.stores.redis import RedisStore
from tests.helpers.redis_servers import start_server

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

GROUP = "refunders"
IDLE_MS = 200  # XAUTOCLAIM's min-idle-time: past it a pending message is up for grabs
MESSAGE = {"id": "msg-7f3a", "order": "A-88214", "amount_p": "4500"}

Handler = Callable[[dict[str, str], str], Awaitable[dict[str, str]]]


@dataclass
class Broker:
    url: str
    client: aioredis.Redis


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    """A redis-server of this test's own, and a client of it (strings in and out)."""
    server = start_server(tmp_path / "redis")
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    try:
        yield Broker(server.url, client)
    finally:
        await client.aclose()
        server.stop()


async def deliver_twice(
    client: aioredis.Redis, stream: str, handler: Callable[[asyncio.Event], Handler]
) -> list[str]:
    """One message, delivered to a slow consumer and taken over by a fast one.

    ``handler(taken_over)`` is the consumers' handler; on the slow consumer it hangs
    (a slow downstream call) until the fast consumer has claimed the message, an
    event rather than a race: the idle time has passed by then, by construction.
    Returns the entry ids each consumer was given, in the order they were given.
    """
    await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    fields: dict[Any, Any] = dict(MESSAGE)  # redis-py types field values as any encodable
    await client.xadd(stream, fields)
    taken_over = asyncio.Event()
    handle = handler(taken_over)
    given: list[str] = []

    async def slow() -> None:
        read: Any = await client.xreadgroup(GROUP, "slow", {stream: ">"}, count=1)
        [[_, entries]] = read  # redis-py types a reply as any reply
        for entry_id, fields in entries:
            given.append(entry_id)
            await handle(fields, "slow")
            await client.xack(stream, GROUP, entry_id)

    async def fast() -> None:
        while True:  # the reclaim loop a consumer group's workers run
            _, entries, _ = await client.xautoclaim(stream, GROUP, "fast", IDLE_MS, count=1)
            if entries:
                break
            await asyncio.sleep(IDLE_MS / 4000)
        taken_over.set()
        for entry_id, fields in entries:
            given.append(entry_id)
            await handle(fields, "fast")
            await client.xack(stream, GROUP, entry_id)

    await asyncio.wait_for(asyncio.gather(slow(), fast()), 30)
    return given


async def test_a_redelivered_message_runs_twice_unguarded_and_once_guarded(
    broker: Broker,
) -> None:
    client = broker.client
    store = RedisStore(broker.url)  # the broker's own server keeps the records
    # ``wait``: a redelivery that finds the first delivery still running waits for its
    # result (polling every 50 ms) rather than failing, so it can be acknowledged.
    once = Once(store, namespace="refunds", wait=timedelta(seconds=10), retry_after=0.05)
    results: list[dict[str, str]] = []

    def refunds(taken_over: asyncio.Event) -> Handler:
        async def issue_refund(msg: dict[str, str], consumer: str) -> dict[str, str]:
            if consumer == "slow":
                await taken_over.wait()  # a slow downstream call, past the idle time
            number = await client.incr(f"refunds-issued:{msg['order']}")  # the effect
            return {"refund": f"rf-{number}", "order": msg["order"], "by": consumer}

        return issue_refund

    def guarded(taken_over: asyncio.Event) -> Handler:
        # Who delivered it is not what was asked: the consumer's name is left out of
        # the fingerprint, so both deliveries are one call.
        handle = once(key=lambda msg, consumer: msg["id"], exclude=("consumer",))(
            refunds(taken_over)
        )

        async def recorded(msg: dict[str, str], consumer: str) -> dict[str, str]:
            result = await handle(msg, consumer)
            results.append(result)
            return result

        return recorded

    try:
        plain_given = await deliver_twice(client, "refunds:plain", refunds)
        unguarded = int(await client.getset("refunds-issued:A-88214", 0) or 0)
        once_given = await deliver_twice(client, "refunds:once", guarded)
        guarded_effects = int(await client.get("refunds-issued:A-88214") or 0)
        pending: list[Any] = [
            await client.xpending(stream, GROUP) for stream in ("refunds:plain", "refunds:once")
        ]
    finally:
        await store.close()

    # The same entry was delivered twice in both runs: the broker did its part.
    assert len(plain_given) == len(once_given) == 2
    assert len(set(plain_given)) == len(set(once_given)) == 1
    assert unguarded == 2  # unguarded: the refund issued twice
    assert guarded_effects == 1  # guarded: once
    # Both deliveries of the guarded run answer with the one result, the slow one's.
    assert results == [{"refund": "rf-1", "order": "A-88214", "by": "slow"}] * 2
    assert [p["pending"] for p in pending] == [0, 0]  # every delivery acknowledged

"""The shared renewal schedule: which running claims get renewed, and when."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest

from asgi_idempotency import Policy
from asgi_idempotency.core.lease import LeaseRenewal, LeaseRenewals
from asgi_idempotency.observability.observer import Observer
from asgi_idempotency.stores.base import NewClaim, Store, utcnow
from asgi_idempotency.stores.memory import MemoryStore
from tests.conftest import TinyFactory
from tests.timing import UNIT, seconds

EVERY = 0.05  # seconds between renewals: short, so the tests wait little
LEASE = timedelta(seconds=1)


class CountingStore(MemoryStore):
    """A memory store that counts renewals per token and can refuse them (a lost claim)."""

    def __init__(self) -> None:
        super().__init__()
        self.renewed: dict[str, int] = {}
        self.lost: set[str] = set()

    async def renew(self, key: str, token: str, *, now: datetime, lease: timedelta) -> bool:
        self.renewed[token] = self.renewed.get(token, 0) + 1
        if token in self.lost:
            return False
        return await super().renew(key, token, now=now, lease=lease)


async def claimed(store: MemoryStore, name: str) -> tuple[str, str]:
    now = utcnow()
    key, token = f"key-{name}", f"token-{name}"
    assert await store.insert(NewClaim(key, "h", token, now, LEASE, 2 * LEASE)) is None
    return key, token


def schedule(store: MemoryStore) -> LeaseRenewals:
    return LeaseRenewals(store, clock=utcnow, observer=Observer(None))


async def until(condition: Callable[[], bool], within: float = 2.0) -> None:
    """Wait (polling the loop) until ``condition()`` holds; fail after ``within`` seconds."""
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(EVERY / 5)


@pytest.mark.anyio
async def test_a_claim_still_running_is_renewed_and_one_that_ended_is_not() -> None:
    store = CountingStore()
    renewals = schedule(store)
    quick_key, quick = await claimed(store, "quick")
    slow_key, slow = await claimed(store, "slow")
    quick_renewal = renewals.start(quick_key, quick, LEASE, EVERY, "/r")
    slow_renewal = renewals.start(slow_key, slow, LEASE, EVERY, "/r")
    quick_renewal.stop(quick)
    await until(lambda: store.renewed.get(slow, 0) >= 3)
    slow_renewal.stop(slow)
    await asyncio.sleep(0)  # the cancelled task unwinds
    seen = dict(store.renewed)
    await asyncio.sleep(3 * EVERY)
    assert store.renewed == seen  # stopped means stopped
    assert quick not in store.renewed
    assert renewals.running == {}


@pytest.mark.anyio
async def test_the_timer_moves_on_to_the_oldest_claim_still_running() -> None:
    # The timer is armed for the first claim; when that one has ended by the time it
    # fires, the claim started after it must still get its renewal.
    store = CountingStore()
    renewals = schedule(store)
    first_key, first = await claimed(store, "first")
    second_key, second = await claimed(store, "second")
    renewals.start(first_key, first, LEASE, EVERY, "/r").stop(first)
    await asyncio.sleep(EVERY / 2)
    later = renewals.start(second_key, second, LEASE, EVERY, "/r")
    await until(lambda: store.renewed.get(second, 0) >= 1)
    later.stop(second)
    assert first not in store.renewed


@pytest.mark.anyio
async def test_claims_with_different_intervals_are_each_renewed_on_their_own() -> None:
    store = CountingStore()
    renewals = schedule(store)
    long_key, long = await claimed(store, "long")
    short_key, short = await claimed(store, "short")
    long_renewal = renewals.start(long_key, long, LEASE, 10.0, "/r")
    short_renewal = renewals.start(short_key, short, LEASE, EVERY, "/r")
    await until(lambda: store.renewed.get(short, 0) >= 2)
    assert long not in store.renewed  # not due for ten seconds
    long_renewal.stop(long)
    short_renewal.stop(short)


@pytest.mark.anyio
async def test_a_lost_claim_stops_renewing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    store = CountingStore()
    renewals = schedule(store)
    key, token = await claimed(store, "lost")
    store.lost.add(token)
    with caplog.at_level(logging.ERROR, logger="asgi_idempotency"):
        renewal = renewals.start(key, token, LEASE, EVERY, "/r")
        await until(lambda: store.renewed.get(token, 0) == 1 and not renewals.running)
        await asyncio.sleep(3 * EVERY)
    assert store.renewed[token] == 1  # no second attempt at a claim that is gone
    assert [r.__dict__["event"] for r in caplog.records] == ["idempotency.claim_lost"]
    renewal.stop(token)  # the handler ends later: nothing left to stop, no error


def test_the_schedule_follows_the_app_to_a_new_event_loop() -> None:
    store = CountingStore()
    renewals = schedule(store)

    async def start_and_leave(name: str) -> object:
        key, token = await claimed(store, name)
        return renewals.start(key, token, LEASE, EVERY, "/r")  # never stopped

    async def start_and_watch(name: str) -> object:
        key, token = await claimed(store, name)
        renewal = renewals.start(key, token, LEASE, EVERY, "/r")
        await until(lambda: store.renewed.get(token, 0) >= 1)
        renewal.stop(token)
        return renewal

    # A loop that is still open and has a claim waiting: a claim on another loop meanwhile
    # gets a timer of its own, and is renewed all the same.
    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(start_and_leave("abandoned"))
        assert isinstance(asyncio.run(start_and_watch("elsewhere")), LeaseRenewal)
    finally:
        first.close()
    # Once that loop is closed, what it held can never run: the schedule moves over.
    assert not isinstance(asyncio.run(start_and_watch("moved")), LeaseRenewal)
    assert "token-abandoned" not in store.renewed


@pytest.mark.anyio
async def test_a_handler_outliving_its_ttl_runs_once(store: Store, tiny: TinyFactory) -> None:
    # Real time, every store: ttl 2 units, lease 1 (renewed every third of it), a
    # handler of 3. A duplicate at 2.5 units is past the claim's ttl but within its
    # renewed lease: 409, never a second run (Redis must not drop the key at its TTL
    # either). Real time on the caller's clock too: the renewals run on the loop's timer.
    policy = Policy(required=True, ttl=2 * UNIT, lease=UNIT)
    app = tiny(store, policies={"POST /pay": policy})
    headers = {"Idempotency-Key": "outlives-ttl"}
    body = {"wait": True}
    async with app.client(timeout=10) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = asyncio.ensure_future(client.post("/pay", json=body, headers=headers))
        await asyncio.wait_for(app.entered.wait(), 10)
        await asyncio.sleep(started + seconds(2.5) - loop.time())
        # A second run would wait on the gate too: bounded, it fails here instead.
        duplicate = await asyncio.wait_for(
            client.post("/pay", json=body, headers=headers), seconds(2)
        )
        assert duplicate.status_code == 409
        await asyncio.sleep(started + seconds(3) - loop.time())
        app.gate.set()
        assert (await first).status_code == 201
        replay = await client.post("/pay", json=body, headers=headers)
    assert replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == (await first).json()
    assert app.calls["pay"] == 1

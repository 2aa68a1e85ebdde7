"""A slow handler is never run twice while its worker lives: the lease is renewed while it runs.

Renewal is off the fast path: a handler that finishes within a third of the lease
costs no renewal statement at all (counted as round trips on the wire).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from asgi_idempotency import SQLStore

from ..helpers.serving import UvicornProcess
from .apps import refund_app
from .support import SHARED_LEASE, Probe, TcpProxy, close_bounded

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


@pytest.mark.slow
async def test_duplicate_after_each_lease_boundary_gets_409_and_the_handler_runs_once(
    demo_pair: tuple[UvicornProcess, UvicornProcess], probe: Probe
) -> None:
    a, b = demo_pair
    lease, delay = SHARED_LEASE, 4 * SHARED_LEASE  # the handler outlives three leases
    path, key = "/orders/o-1/refunds", {"Idempotency-Key": "slow-refund"}
    body = {"amount": 100, "delay": delay}
    async with httpx.AsyncClient(timeout=10) as c:
        first = asyncio.create_task(c.post(a.base_url + path, json=body, headers=key))
        await probe.wait_for("the claim", probe.records, within=5)
        loop = asyncio.get_running_loop()
        claimed = loop.time()
        dups: list[tuple[int, float]] = []
        for boundary in (1, 2, 3):
            await asyncio.sleep(max(0.0, claimed + boundary * lease + 0.1 - loop.time()))
            r = await c.post(b.base_url + path, json=body, headers=key)
            dups.append((r.status_code, loop.time() - claimed))
        refunds_during = await probe.refunds()
        done = await first
        replay = await c.post(b.base_url + path, json=body, headers=key)
    print(f"duplicates (status, seconds after claim): {dups}")
    assert [s for s, _ in dups] == [409, 409, 409]
    assert dups[-1][1] > 3 * lease
    assert refunds_during == []  # still running at the last duplicate, not finished early
    assert done.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    refunds = await probe.refunds()
    assert [r[0] for r in refunds] == [done.json()["refund_id"]]  # ran exactly once


async def test_renewal_round_trips_only_for_a_slow_handler_and_they_stop_with_it(
    pg_url: str, pg_proxy: TcpProxy
) -> None:
    """Counted on the wire (a proxy between store and Postgres), so it holds whatever
    layer issues the statements: a fast request costs exactly claim + complete, with no
    renewal, no ping on checkout and no BEGIN/COMMIT or timeout statement around them."""
    store = SQLStore(pg_proxy.url_for(pg_url))
    lease = 0.6  # renewal every 0.2 s
    t = refund_app(store, lease=lease)
    try:
        async with asyncio.timeout(30), t.client() as c:  # bounded: a hang fails
            for i in range(2):  # connect, and prepare the claim and complete statements
                warm = await c.post("/refunds", json={"n": i}, headers={"Idempotency-Key": f"w{i}"})
                assert warm.status_code == 201

            before = pg_proxy.round_trips
            fast = await c.post("/refunds", json={"amount": 1}, headers={"Idempotency-Key": "fast"})
            await asyncio.sleep(lease / 3 + 0.2)  # past the first renewal tick, had one been armed
            fast_trips = pg_proxy.round_trips - before

            before = pg_proxy.round_trips
            replay = await c.post(
                "/refunds", json={"amount": 1}, headers={"Idempotency-Key": "fast"}
            )
            replay_trips = pg_proxy.round_trips - before

            before = pg_proxy.round_trips
            slow = await c.post(
                "/refunds", json={"amount": 2, "sleep": 1.0}, headers={"Idempotency-Key": "slow"}
            )
            slow_trips = pg_proxy.round_trips - before
            await asyncio.sleep(lease / 3 * 2 + 0.1)  # two ticks, had renewal outlived the handler
            later_trips = pg_proxy.round_trips - before
    finally:
        await close_bounded(store, pg_proxy)

    print(f"round trips: fast {fast_trips}, replay {replay_trips}, slow {slow_trips}")
    assert fast.status_code == slow.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert fast_trips == 2  # claim + complete: no renewal, no ping, no BEGIN/COMMIT
    assert replay_trips == 1  # the claim statement returns the stored response
    # One renewal per lease/3 over a 1 s handler (the first may also prepare its statement).
    assert 2 + 3 <= slow_trips <= 2 + 6 + 1, slow_trips
    assert later_trips == slow_trips  # the renewal stopped with the handler

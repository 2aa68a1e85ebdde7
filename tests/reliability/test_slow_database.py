"""A stuck database gives a prompt 503, not a hung request: the driver's timeout bounds every call.

``SQLStore(command_timeout=...)`` sets asyncpg's ``command_timeout`` (and the connect
timeout) on the connection, so the bound costs no statement of its own.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import text

from asgi_idempotency import SQLStore

from .apps import refund_app
from .support import Probe, TcpProxy, close_bounded

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 0.5
PROBLEM = "application/problem+json"


async def test_locked_table_gives_503_within_the_timeout(pg_url: str, probe: Probe) -> None:
    store = SQLStore(pg_url, command_timeout=TIMEOUT)
    t = refund_app(store)
    try:
        async with asyncio.timeout(15), t.client() as c:  # bounded: a hang fails
            warm = await c.post("/refunds", json={"amount": 1}, headers={"Idempotency-Key": "warm"})
            assert warm.status_code == 201
            async with probe.store.engine.connect() as locker:
                await locker.execute(
                    text("LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
                )
                started = time.monotonic()
                stuck = await c.post(
                    "/refunds", json={"amount": 2}, headers={"Idempotency-Key": "stuck"}
                )
                elapsed = time.monotonic() - started
                # A replay cannot be answered either: the claim statement is the read.
                replay = await c.post(
                    "/refunds", json={"amount": 1}, headers={"Idempotency-Key": "warm"}
                )
                await locker.rollback()
            after = await c.post(
                "/refunds", json={"amount": 2}, headers={"Idempotency-Key": "stuck"}
            )
        assert stuck.status_code == 503, stuck.text
        assert stuck.headers["content-type"] == PROBLEM
        assert int(stuck.headers["retry-after"]) >= 1
        assert TIMEOUT * 0.8 <= elapsed < TIMEOUT + 1.0, elapsed
        assert replay.status_code == 503
        assert after.status_code == 201  # the timed-out statement was cancelled; the pool is fine
        assert t.calls["refund"] == 2  # warm and after; never the stuck one
        assert len(await probe.records()) == 2
    finally:
        await close_bounded(store)


async def test_stalled_network_gives_503_within_a_bound_then_recovers(
    pg_url: str, pg_proxy: TcpProxy, probe: Probe
) -> None:
    """The server stops answering at all (a stalled link): pooled and fresh connections.

    Bound: ``command_timeout`` plus slack, for a statement on a pooled connection and
    for a fresh connect alike. (A graceful close of the dead connection would wait the
    timeout once more; the store terminates it instead.)
    """
    store = SQLStore(pg_proxy.url_for(pg_url), command_timeout=TIMEOUT)
    t = refund_app(store)
    try:
        async with asyncio.timeout(15), t.client() as c:  # bounded: a hang fails
            warm = await c.post("/refunds", json={"amount": 1}, headers={"Idempotency-Key": "warm"})
            assert warm.status_code == 201
            pg_proxy.stall()
            timings: list[tuple[int, float]] = []
            for i in range(2):  # first on the pooled connection, then on a fresh connect
                started = time.monotonic()
                r = await c.post(
                    "/refunds", json={"amount": 2}, headers={"Idempotency-Key": f"s{i}"}
                )
                timings.append((r.status_code, time.monotonic() - started))
                assert r.headers["content-type"] == PROBLEM
            pg_proxy.restore()
            after = await c.post("/refunds", json={"amount": 2}, headers={"Idempotency-Key": "s0"})
        assert [s for s, _ in timings] == [503, 503], timings
        assert all(TIMEOUT * 0.8 <= e < TIMEOUT + 1.0 for _, e in timings), timings
        assert after.status_code == 201
        assert t.calls["refund"] == 2
    finally:
        await close_bounded(store, pg_proxy)

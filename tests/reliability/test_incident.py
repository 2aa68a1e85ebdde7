"""The incident end to end over real HTTP: a client times out on a slow refund and retries.

Real uvicorn processes on loopback ports, the demo refund app on Postgres, httpx with a read
timeout shorter than the handler. Seconds scaled down.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ..helpers.serving import UvicornProcess
from .support import SHARED_LEASE, Probe

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.slow]


async def test_timed_out_client_retries_get_409_then_the_original_refund_replayed(
    demo_pair: tuple[UvicornProcess, UvicornProcess], probe: Probe
) -> None:
    a, b = demo_pair  # two app processes on one Postgres, as behind a load balancer
    path = "/orders/o-7/refunds"
    key = {"Idempotency-Key": "refund-o-7"}
    body = {"amount": 4500, "delay": 1.5}
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.4)) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(a.base_url + path, json=body, headers=key)
        # The client gave up; the handler did not. The retry arrives while it runs.
        early = await c.post(b.base_url + path, json=body, headers=key)
        refunds_at_early = await probe.refunds()

        refunds = await probe.wait_for("the refund", probe.refunds, within=5)
        late = await c.post(b.base_url + path, json=body, headers=key)
        for _ in range(20):  # the completion lands just after the insert
            if late.status_code != 409:
                break
            await asyncio.sleep(0.05)
            late = await c.post(a.base_url + path, json=body, headers=key)
        count = await c.get(a.base_url + "/refunds/count")

    assert early.status_code == 409
    assert early.headers["content-type"] == "application/problem+json"
    assert 1 <= int(early.headers["retry-after"]) <= max(1, SHARED_LEASE)
    assert refunds_at_early == []

    assert late.status_code == 201
    assert late.headers["idempotent-replayed"] == "true"
    assert late.json() == {"refund_id": refunds[0][0], "amount": 4500}  # the original refund
    assert count.json() == {"refunds": 1}
    assert await probe.refunds() == [(refunds[0][0], "o-7", 4500)]

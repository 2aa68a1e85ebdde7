"""Bounded load over loopback HTTP: multi-worker uvicorn, Postgres, a fixed mix of requests.

Mix (fixed, seeded): fresh keys each replayed twice; in-flight duplicates of a slow
request; mismatched bodies under a used key. Ends with zero 5xx, one refund row per
executed key, no row left ``in_progress``, and duplicates answered while their first
request still runs (not queued behind it). Prints its counts.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from ..helpers.serving import run_uvicorn
from .support import DEMO, Probe, demo_env

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.slow]
WORKERS = 2  # the machine has two cores and is shared
CONCURRENCY = 8  # past this a two-core machine only queues requests
FRESH, INFLIGHT, MISMATCH = 100, 30, 40
SLOW = 1.5  # seconds an in-flight first request takes


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    dup_latencies: list[float] = field(default_factory=list)
    executed: dict[str, str] = field(default_factory=dict)  # order id -> refund id (fresh 201)
    replays: list[tuple[str, str]] = field(default_factory=list)  # (order id, refund id replayed)


async def test_bounded_load_loses_and_doubles_nothing(
    pg_url: str, probe: Probe, tmp_path: Path
) -> None:
    rng = random.Random(20240611)
    tally = Tally()
    gate = asyncio.Semaphore(CONCURRENCY)
    dup_gate = asyncio.Semaphore(CONCURRENCY)  # duplicates must not queue behind the mix

    async def post(
        c: httpx.AsyncClient,
        order: str,
        amount: int,
        delay: float = 0,
        *,
        slot: asyncio.Semaphore = gate,
        sent: asyncio.Event | None = None,
    ) -> httpx.Response | None:
        async with slot:
            if sent is not None:
                sent.set()
            started = time.monotonic()
            try:
                r = await c.post(
                    f"/orders/{order}/refunds",
                    json={"amount": amount, "delay": delay},
                    headers={"Idempotency-Key": f"key-{order}"},
                )
            except httpx.HTTPError as exc:
                tally.errors.append(f"{order}: {type(exc).__name__}")
                return None
            elapsed = time.monotonic() - started
        tally.statuses[r.status_code] += 1
        if r.status_code == 201 and r.headers.get("idempotent-replayed") == "true":
            tally.kinds["replayed"] += 1
            tally.replays.append((order, r.json()["refund_id"]))
        elif r.status_code == 201:
            tally.kinds["executed"] += 1
            assert order not in tally.executed, f"{order} executed twice"
            tally.executed[order] = r.json()["refund_id"]
        elif r.status_code == 409:
            tally.kinds["in_progress"] += 1
            tally.dup_latencies.append(elapsed)
        elif r.status_code == 422:
            tally.kinds["mismatch"] += 1
        return r

    async def fresh(c: httpx.AsyncClient, order: str) -> None:
        amount = rng.randint(1, 10_000)
        for _ in range(3):  # the first executes, the next two replay
            await post(c, order, amount)

    async def inflight(c: httpx.AsyncClient, order: str) -> None:
        sent = asyncio.Event()
        first = asyncio.create_task(post(c, order, 1, SLOW, sent=sent))
        await sent.wait()
        await asyncio.sleep(0.3)  # the first has reached the server and claimed its key
        await asyncio.gather(*(post(c, order, 1, SLOW, slot=dup_gate) for _ in range(2)))
        await first
        await post(c, order, 1, SLOW)  # after it finished: a replay

    async def mismatch(c: httpx.AsyncClient, order: str) -> None:
        await post(c, order, 5)
        await post(c, order, 6)  # same key, different body

    run = rng.getrandbits(32)
    jobs = (
        [(fresh, f"f{run}-{i}") for i in range(FRESH)]
        + [(inflight, f"i{run}-{i}") for i in range(INFLIGHT)]
        + [(mismatch, f"m{run}-{i}") for i in range(MISMATCH)]
    )
    rng.shuffle(jobs)
    limits = httpx.Limits(max_connections=2 * CONCURRENCY)
    with run_uvicorn(DEMO, env=demo_env(pg_url), log_dir=tmp_path, workers=WORKERS) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=20, limits=limits) as c:
            started = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*(job(c, order) for job, order in jobs)), 60)
            elapsed = time.monotonic() - started

    refunds = await probe.refunds()
    rows = await probe.records()
    per_order = Counter(order for _, order, _ in refunds)
    total = sum(tally.statuses.values())
    dup_max = max(tally.dup_latencies, default=0.0)
    print(
        f"\nload: {total} requests in {elapsed:.1f}s ({total / elapsed:.0f}/s), "
        f"{WORKERS} workers; statuses {dict(sorted(tally.statuses.items()))}; "
        f"kinds {dict(tally.kinds)}; transport errors {len(tally.errors)}; "
        f"keys {len(jobs)}, refund rows {len(refunds)}, records {len(rows)} "
        f"({Counter(r.status for r in rows)}); 409 latency max {dup_max * 1000:.0f} ms"
    )
    assert tally.errors == []
    assert not [s for s in tally.statuses if s >= 500]
    assert set(tally.statuses) <= {201, 409, 422}
    # Every key executed exactly once: one refund row per order, none lost or doubled.
    assert set(per_order) == {order for _, order in jobs}
    assert set(per_order.values()) == {1}
    assert set(tally.executed) == set(per_order)
    assert {(o, rid) for rid, o, _ in refunds} == set(tally.executed.items())
    # Replays carry the refund their key executed, never another key's.
    assert all(tally.executed[o] == rid for o, rid in tally.replays)
    assert tally.kinds["mismatch"] == MISMATCH
    assert tally.kinds["in_progress"] >= INFLIGHT  # most duplicates hit the running first
    assert len(rows) == len(jobs)
    assert {r.status for r in rows} == {"completed"}  # nothing left in_progress
    assert dup_max < SLOW  # a duplicate is answered while its first still runs

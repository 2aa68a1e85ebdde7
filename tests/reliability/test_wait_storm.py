"""200 duplicates waiting for one running first, on one real uvicorn worker over Postgres.

The first runs in another worker (its own uvicorn process), so the storm's worker
cannot be told when it ends and must read the store. That worker's connections go
through a wire counter (``tests/helpers/pgwire.py``): while 200 duplicates wait, its reads of
the key stay within what one waiter's backoff makes, every duplicate gets the first's
response byte for byte, the handler runs once, other keys are served meanwhile (the
pool is not held by the waiters), and the worker's memory stays flat from storm to
storm.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from asgi_idempotency.core.waiting import POLL_FIRST, POLL_MAX

from ..helpers.pgwire import RoundTrip, WireCounter
from ..helpers.serving import UvicornProcess, run_uvicorn
from .support import Probe

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.slow]

APP = "tests.reliability.wait_app:app"
STORM = 200
OTHERS = 20  # fresh keys sent to the storm's worker while the storm waits
HOLD = 1.5  # seconds the storm waits once the other keys are served, before the first ends
STORMS = 4
LIMITS = httpx.Limits(max_connections=STORM + OTHERS + 10, max_keepalive_connections=0)


@asynccontextmanager
async def serving(env: dict[str, str], log_dir: Path) -> AsyncIterator[UvicornProcess]:
    """``run_uvicorn`` entered in a thread: its readiness probe blocks, and the wire
    counter the worker starts up through runs on this loop."""
    manager = run_uvicorn(APP, env=env, log_dir=log_dir)
    server = await asyncio.to_thread(manager.__enter__)
    try:
        yield server
    finally:
        await asyncio.to_thread(manager.__exit__, None, None, None)


def reads_bound(seconds: float) -> int:
    """Reads one watch makes in ``seconds``: pauses doubling from POLL_FIRST to POLL_MAX."""
    reads, delay, spent = 0, POLL_FIRST, 0.0
    while spent < seconds:
        spent += delay
        reads += 1
        delay = min(delay * 2, POLL_MAX)
    return reads + 2  # the read that finds the answer, and one in flight


def reads_of_the_key(trips: list[RoundTrip]) -> int:
    return sum(
        1
        for trip in trips
        for statement in trip.executed
        if statement.lstrip().upper().startswith("SELECT") and "idempotency_records" in statement
    )


async def get_json(client: httpx.AsyncClient, path: str) -> dict[str, int]:
    answer = await client.get(path)
    answer.raise_for_status()
    data: dict[str, int] = answer.json()
    return data


async def storm(
    holder: httpx.AsyncClient, stormed: httpx.AsyncClient, wire: WireCounter, probe: Probe,
    key: str, gate: Path,
) -> tuple[list[RoundTrip], float]:  # fmt: skip
    """One storm on ``key``: the first on ``holder``, running until ``gate`` exists, 200
    duplicates and 20 other keys on ``stormed``; returns the stormed worker's round
    trips meanwhile and how long it took."""
    body = {"amount": 4500, "gate": str(gate)}
    headers = {"Idempotency-Key": key}
    first = asyncio.ensure_future(holder.post("/refunds", json=body, headers=headers))

    async def claimed() -> bool:
        return any(r.status == "in_progress" for r in await probe.records())

    await probe.wait_for("the first's claim", claimed)
    wire.reset()
    began = time.monotonic()
    duplicates = [
        asyncio.ensure_future(stormed.post("/refunds", json=body, headers=headers))
        for _ in range(STORM)
    ]
    deadline = time.monotonic() + 20
    while (await get_json(stormed, "/waiting"))["waiting"] < STORM:
        assert time.monotonic() < deadline, "the duplicates never all waited"
        assert not any(d.done() for d in duplicates), "a duplicate was answered at once"
        await asyncio.sleep(0.05)
    others = await asyncio.gather(
        *(
            stormed.post("/refunds", json={"amount": i}, headers={"Idempotency-Key": f"{key}-{i}"})
            for i in range(OTHERS)
        )
    )
    assert [o.status_code for o in others] == [201] * OTHERS  # served while the storm waits
    await asyncio.sleep(HOLD)  # the storm's worker keeps reading the key meanwhile
    assert not first.done()
    assert not any(d.done() for d in duplicates)
    await asyncio.to_thread(gate.touch)
    original = await first
    answers = await asyncio.gather(*duplicates)
    took = time.monotonic() - began
    trips = wire.reset()
    assert original.status_code == 201
    assert "idempotent-replayed" not in original.headers
    for answer in answers:
        assert answer.status_code == 201
        assert answer.headers["idempotent-replayed"] == "true"
        assert answer.content == original.content
    return trips, took


async def test_a_storm_of_waiting_duplicates_reads_the_store_as_one_waiter_would(
    pg_url: str, probe: Probe, tmp_path: Path
) -> None:
    url = make_url(pg_url)
    effects = tmp_path / "effects.txt"
    async with WireCounter(url.host or "127.0.0.1", url.port or 5432) as wire:
        proxied = url.set(host="127.0.0.1", port=wire.port, query={"ssl": "disable"})
        stormed_env = {
            "EFFECTS": str(effects),
            "STORE_URL": proxied.render_as_string(hide_password=False),
        }
        holder_env = {"EFFECTS": str(effects), "STORE_URL": pg_url}
        async with (
            serving(holder_env, tmp_path) as holder_server,
            serving(stormed_env, tmp_path) as stormed_server,
            httpx.AsyncClient(base_url=holder_server.base_url, timeout=30) as holder,
            httpx.AsyncClient(
                base_url=stormed_server.base_url, timeout=30, limits=LIMITS
            ) as stormed,
        ):
            memory: list[dict[str, int]] = []
            reads: list[tuple[int, int, float]] = []  # (reads, all round trips, seconds)
            for n in range(STORMS):  # two warm the worker up; memory is compared after
                gate = tmp_path / f"gate-{n}"
                trips, took = await storm(holder, stormed, wire, probe, f"storm-{n}", gate)
                reads.append((reads_of_the_key(trips), len(trips), took))
                memory.append(await get_json(stormed, "/memory"))
    print(f"reads, round trips, seconds per storm: {reads}; memory after each: {memory}")
    runs = effects.read_text().splitlines()
    for n in range(STORMS):
        assert runs.count(f"storm-{n}") == 1  # the handler ran once per storm, on the holder
    for count, total, took in reads:
        # Reads of the key: one waiter's backoff, not 200 waiters'.
        assert count <= reads_bound(took), (count, took)
        # Every round trip: the duplicates' own claims (batched), the other keys'
        # claim and completion, and the reads with their BEGIN/ROLLBACK.
        assert total <= STORM + 2 * OTHERS + 4 * count + 10, (total, count)
    # Flat: what one storm leaves (past the warm-up) is what the next one leaves.
    growth = memory[-1]["kb"] - memory[-2]["kb"]
    assert growth < 2 * 1024, f"RSS grew {growth} kB from one storm to the next"
    # Fewer objects than one per duplicate: nothing a waiting request made stays.
    assert abs(memory[-1]["objects"] - memory[-2]["objects"]) < STORM, memory

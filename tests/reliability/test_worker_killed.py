"""A uvicorn worker is SIGKILLed in the middle of a handler; its claim is abandoned.

Before the lease runs out, retries (to another server process on the same database)
get 409; a different body gets 422 and never takes the claim over; after the lease,
two retries race from two processes and exactly one wins and runs the handler.
On Postgres and on MariaDB.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from asgi_idempotency import SQLStore
from asgi_idempotency.core.lifecycle import Claim, ClaimOutcome, claim

from ..conftest import emptied
from ..helpers.serving import UvicornProcess, run_uvicorn
from .support import DEMO, Probe, demo_env

pytestmark = pytest.mark.anyio


@pytest.mark.slow
@pytest.mark.postgres
async def test_abandoned_claim_is_409_until_the_lease_ends_then_taken_over_once(
    pg_url: str, demo_pair: tuple[UvicornProcess, UvicornProcess], probe: Probe, tmp_path: Path
) -> None:
    await _abandoned_claim(pg_url, demo_pair, probe, tmp_path)


@pytest.mark.slow
@pytest.mark.mariadb
async def test_abandoned_claim_on_mariadb_is_409_until_the_lease_ends_then_taken_over_once(
    mariadb_url: str,
    mariadb_demo_pair: tuple[UvicornProcess, UvicornProcess],
    mariadb_probe: Probe,
    tmp_path: Path,
) -> None:
    await _abandoned_claim(mariadb_url, mariadb_demo_pair, mariadb_probe, tmp_path)


async def _abandoned_claim(
    url: str, demo_pair: tuple[UvicornProcess, UvicornProcess], probe: Probe, tmp_path: Path
) -> None:
    lease, delay = 2.0, 1.0  # the doomed server's lease; b and c run the shared one
    path, key = "/orders/o-9/refunds", {"Idempotency-Key": "refund-o-9"}
    body, other_body = {"amount": 900, "delay": delay}, {"amount": 901, "delay": delay}
    env = demo_env(url, lease=lease)
    b, c = demo_pair
    with run_uvicorn(DEMO, env=env, log_dir=tmp_path) as doomed:
        async with httpx.AsyncClient(timeout=10) as client:
            first = asyncio.create_task(client.post(doomed.base_url + path, json=body, headers=key))
            [claimed] = await probe.wait_for("the claim", probe.records, within=5)

            async def renewed() -> bool:
                return any(r.locked_until > claimed.locked_until for r in await probe.records())

            await probe.wait_for("a lease renewal", renewed, within=lease)  # a live owner renews
            doomed.kill(signal.SIGKILL)
            assert doomed.process.returncode == -signal.SIGKILL
            with pytest.raises(httpx.TransportError):
                await first

            [abandoned] = await probe.records()
            assert abandoned.status == "in_progress"
            early = await client.post(b.base_url + path, json=body, headers=key)
            early_mismatch = await client.post(c.base_url + path, json=other_body, headers=key)
            assert datetime.now(UTC) < abandoned.locked_until  # both answered inside the lease

            wait = (abandoned.locked_until - datetime.now(UTC)).total_seconds() + 0.1
            await asyncio.sleep(max(0.0, wait))
            late_mismatch = await client.post(b.base_url + path, json=other_body, headers=key)
            [still] = await probe.records()

            racers = await asyncio.gather(
                client.post(b.base_url + path, json=body, headers=key),
                client.post(c.base_url + path, json=body, headers=key),
            )
            [done] = await probe.records()

    assert early.status_code == 409
    assert int(early.headers["retry-after"]) >= 1
    assert early_mismatch.status_code == 422
    # An expired lease is no licence for a different request: 422, and the row stands.
    assert late_mismatch.status_code == 422
    assert still == abandoned
    statuses = sorted(r.status_code for r in racers)
    assert statuses == [201, 409], statuses
    winner = next(r for r in racers if r.status_code == 201)
    assert "idempotent-replayed" not in winner.headers
    refunds = await probe.refunds()
    # The killed worker died in its sleep, before its effect: the takeover's is the only one.
    assert [r[0] for r in refunds] == [winner.json()["refund_id"]]
    assert (done.status, done.response_status) == ("completed", 201)


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ],
)
@pytest.mark.parametrize("same_request", [True, False])
async def test_many_racers_for_an_abandoned_claim_exactly_one_wins(
    backend: str, request: pytest.FixtureRequest, same_request: bool
) -> None:
    """The takeover race at the store, widened: 16 claims from 4 engines (as 4 processes).

    Two HTTP retries rarely overlap inside the database; these do, so a takeover that
    is not fenced on the row's token and lease would let several win. A different
    request never takes an abandoned claim over, however many try.
    """
    url = request.getfixturevalue("pg_url" if backend == "postgres" else "mariadb_url")
    async with emptied(SQLStore(url)):  # the run's database: start from empty tables
        pass
    stores = [SQLStore(url) for _ in range(4)]
    try:
        # Four connections per engine, opened before the race so that it is not a connect race.
        await asyncio.gather(*(s.get("warm") for s in stores for _ in range(4)))
        for round_ in range(5):
            key, now = f"abandoned-{round_}", datetime.now(UTC)
            dead = await claim(
                stores[0],
                key,
                "h",
                "dead-worker",
                now=now,
                lease=timedelta(0),  # its lease is over as soon as it is written
                ttl=timedelta(hours=1),
            )
            assert dead.owned
            start = asyncio.Event()

            async def racer(
                i: int, key: str = key, now: datetime = now, start: asyncio.Event = start
            ) -> Claim:
                await start.wait()
                return await claim(
                    stores[i % len(stores)],
                    key,
                    "h" if same_request else f"other-{i}",
                    f"racer-{i}",
                    now=now,
                    lease=timedelta(seconds=30),
                    ttl=timedelta(hours=1),
                )

            tasks = [asyncio.create_task(racer(i)) for i in range(16)]
            await asyncio.sleep(0)
            start.set()
            claims = await asyncio.wait_for(asyncio.gather(*tasks), 20)
            outcomes = Counter(c.outcome for c in claims)
            if same_request:
                assert sum(c.owned for c in claims) == 1, outcomes
                assert outcomes[ClaimOutcome.IN_PROGRESS] == 15, outcomes
            else:
                assert outcomes == {ClaimOutcome.MISMATCH: 16}
                record = await stores[0].get(key)
                assert record is not None
                assert record.token == "dead-worker"
    finally:
        await asyncio.gather(*(s.close() for s in stores))

"""App hosts whose clocks disagree share one store: the store's clock decides every lease.

Two real uvicorn servers on one store, one of them under libfaketime. A host whose
clock runs 40 s ahead must answer 409 to a duplicate of a live claim another host
holds (the handler runs once); a host 40 s behind must take over a dead host's claim
within its lease and 2 s, not 40 s later. On Postgres (batching and not), MariaDB and
Redis (one server and a cluster).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from asgi_idempotency.stores.base import Record, Store, utcnow

from ..conftest import open_store
from ..helpers.serving import UvicornProcess, run_uvicorn
from .redis_app import APP, effects, env_for

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEW = 40.0  # seconds
LEASE = 3.0  # seconds: short, so that a dead claim's lease ends within the test

# kind -> (open_store's kind for the probe, the URL fixture, batching of the servers)
KINDS = {
    "postgres": ("postgres", "pg_url", True),
    "postgres_unbatched": ("postgres", "pg_url", False),
    "mariadb": ("mariadb", "mariadb_url", True),
    "redis": ("redis", "redis_url", True),
    "redis_cluster": ("redis_cluster", "redis_cluster_url", True),
}
MARKS = {
    "postgres": pytest.mark.postgres,
    "postgres_unbatched": pytest.mark.postgres,
    "mariadb": pytest.mark.mariadb,
    "redis": pytest.mark.redis,
    "redis_cluster": pytest.mark.redis,
}


@pytest.fixture(params=[pytest.param(kind, marks=MARKS[kind]) for kind in KINDS])
async def shared(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, bool, Store]]:
    """(the store's URL, batching, a probe on it emptied first) for every shared store."""
    probe_kind, url_fixture, batching = KINDS[request.param]
    url: str = request.getfixturevalue(url_fixture)
    async with open_store(request, probe_kind) as probe:
        yield url, batching, probe


def faketime(env: dict[str, str], offset: float) -> dict[str, str]:
    """``env`` for a process whose wall clock is ``offset`` seconds off (libfaketime).

    The monotonic clock stays true: asyncio's timers (and so the lease renewals) keep
    running at the real pace, as on a host whose wall clock alone is off.
    """
    if not LIBFAKETIME.exists():
        pytest.fail(
            f"libfaketime is missing ({LIBFAKETIME}): `apt-get install faketime` "
            "(.ci/run installs it); the clock-skew tests cannot run without it",
            pytrace=False,
        )
    return {
        **env,
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"{offset:+.0f}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


async def assert_clock(client: httpx.AsyncClient, server: UvicornProcess, offset: float) -> None:
    """The server's wall clock really is ``offset`` seconds off ours."""
    said = (await client.get(server.base_url + "/clock")).json()["time"]
    assert abs(said - time.time() - offset) < 5, f"clock off by {said - time.time():.1f}s"


async def wait_for_claim(probe: Store, within: float = 10) -> Record:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = await probe.find("", limit=2)
        if found:
            [record] = found
            return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"no claim within {within}s")


async def test_a_host_ahead_never_takes_over_a_live_claim(
    shared: tuple[str, bool, Store], tmp_path: Path
) -> None:
    url, batching, probe = shared
    done = tmp_path / "effects"
    env = env_for(url, done, lease=LEASE, batching=batching)
    path, key = "/orders/o-1/refunds", {"Idempotency-Key": f"skew-{uuid.uuid4().hex}"}
    body = {"amount": 100, "delay": LEASE + 1.5}  # outlives one lease: renewed meanwhile
    with (
        run_uvicorn(APP, env=env, log_dir=tmp_path) as holder,
        run_uvicorn(APP, env=faketime(env, +SKEW), log_dir=tmp_path) as ahead,
    ):
        async with httpx.AsyncClient(timeout=30) as client:
            await assert_clock(client, holder, 0)
            await assert_clock(client, ahead, +SKEW)
            first = asyncio.create_task(client.post(holder.base_url + path, json=body, headers=key))
            await wait_for_claim(probe)
            answers = []
            while not first.done():
                dup = await client.post(ahead.base_url + path, json=body, headers=key)
                answers.append(dup.status_code)
                if dup.status_code != 409:
                    break
                await asyncio.sleep(0.25)
            original = await first
            assert original.status_code == 201
            assert answers, "the first answered before a duplicate was sent"
            assert set(answers) == {409}, answers  # never taken over
            replay = await client.post(ahead.base_url + path, json=body, headers=key)
    assert replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == original.json()
    assert len(effects(done)) == 1  # the handler ran once


async def test_a_host_behind_takes_over_a_dead_claim_within_its_lease(
    shared: tuple[str, bool, Store], tmp_path: Path
) -> None:
    url, batching, probe = shared
    done = tmp_path / "effects"
    env = env_for(url, done, lease=LEASE, batching=batching)
    path, key = "/orders/o-2/refunds", {"Idempotency-Key": f"skew-{uuid.uuid4().hex}"}
    body = {"amount": 200, "delay": 1.0}
    with run_uvicorn(APP, env=faketime(env, -SKEW), log_dir=tmp_path) as behind:
        async with httpx.AsyncClient(timeout=30) as client:
            await assert_clock(client, behind, -SKEW)
            with run_uvicorn(APP, env=env, log_dir=tmp_path) as doomed:
                first = asyncio.create_task(
                    client.post(doomed.base_url + path, json=body, headers=key)
                )
                await wait_for_claim(probe)
                doomed.kill(signal.SIGKILL)
                killed_at = utcnow()
                with pytest.raises(httpx.TransportError):
                    await first
            [dead] = await probe.find("", limit=2)
            assert dead.response is None  # the dead host never completed it
            # The dead claim's lease ends at dead.locked_until (the store's clock, which
            # this host shares); the host behind must run the handler soon after.
            give_up = time.monotonic() + LEASE + 2 + 5
            taken: tuple[datetime, httpx.Response] | None = None
            while time.monotonic() < give_up:
                sent = datetime.now(UTC)
                answer = await client.post(behind.base_url + path, json=body, headers=key)
                if answer.status_code != 409:
                    taken = (sent, answer)
                    break
                await asyncio.sleep(0.1)
    assert taken is not None, f"the host behind did not take the claim over within {LEASE + 7}s"
    sent, answer = taken
    assert answer.status_code == 201
    late = (sent - dead.locked_until).total_seconds()
    after_kill = (sent - killed_at).total_seconds()
    print(f"taken over {late:+.2f}s after the dead lease ended ({after_kill:.2f}s after the kill)")
    assert after_kill <= LEASE + 2
    assert len(effects(done)) == 1  # the dead host's handler never finished: one effect
    assert os.environ.get("FAKETIME") is None  # this process's own clock is true

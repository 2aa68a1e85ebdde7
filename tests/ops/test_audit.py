"""``asgi-idempotency audit``: a regenerated-key storm through four uvicorn workers, found
in the records they wrote, on Postgres, MariaDB, Redis and SQLite; legitimate repeats not.

The storm is the incident's client: one caller, one refund, a new Idempotency-Key on
every attempt (minted inside the retry loop), so every attempt runs. Around it, what a
healthy system sees: the same caller's other refunds (other bodies), another caller
sending the same body, a client retrying with one key (replays), and a caller repeating
a refund after longer than the window.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asgi_idempotency.core.keys import scope_digest
from asgi_idempotency.http.principals import from_headers
from asgi_idempotency.http.request import host_scope
from asgi_idempotency.migrations import upgrade
from tests.conftest import MariaDBServer, PgServer
from tests.helpers.serving import run_uvicorn
from tests.ops.audit_app import APP, ENV

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "/refunds/{account}"
WAVE, WAVES = 4, 10  # the storm's attempts (each under a new key): waves of 4, at most 10
GAP = 3.0  # seconds between the two refunds of the caller who repeats one on purpose


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty store of its own: a migrated database, a fresh SQLite file (the app
    creates its table), or a redis-server of this test's own."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'audit.db'}"
    elif request.param == "postgres":
        pg: PgServer = request.getfixturevalue("pg_server")
        with pg.database("idem_audit") as url:
            upgrade(url)
            yield url
    elif request.param == "mariadb":
        maria: MariaDBServer = request.getfixturevalue("mariadb_server")
        with maria.database("idem_audit") as url:
            upgrade(url)
            yield url
    else:
        from tests.helpers.redis_servers import start_server

        server = start_server(tmp_path / "redis")
        try:
            yield server.url
        finally:
            server.stop()


def caller(user: str) -> str:
    """The caller digest the audit names ``user`` by: their scope as the middleware
    builds it (host and principal), digested."""
    principal = from_headers("X-User")({"headers": [(b"x-user", user.encode())]})
    assert isinstance(principal, str)
    return scope_digest(principal, host_scope(b"127.0.0.1"))


def audit(url: str, *args: str) -> tuple[int, Any]:
    """``asgi-idempotency audit --database-url URL --format json ARGS`` in a process."""
    result = subprocess.run(
        [sys.executable, "-m", "asgi_idempotency.ops.cli", "audit", "--database-url", url,
         "--format", "json", *args],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


async def test_the_audit_finds_a_regenerated_key_storm_sent_through_four_workers(
    store_url: str, tmp_path: Path
) -> None:
    env = {ENV: store_url, "PYTHONPATH": str(ROOT)}
    with run_uvicorn(APP, env=env, log_dir=tmp_path, workers=4) as server:
        url = server.base_url + "/refunds/acct-1"
        # One connection per request, so the storm spreads over the workers.
        async with httpx.AsyncClient(
            timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
        ) as c:

            async def post(user: str, body: dict[str, Any], key: str) -> httpx.Response:
                # A new connection each, so that the storm spreads over the workers.
                headers = {"X-User": user, "Idempotency-Key": key, "Connection": "close"}
                return await c.post(url, json=body, headers=headers)

            refund = {"amount": 4500, "order": "o-1"}
            # The incident: every attempt under a new key, every attempt runs.
            # Waves until more than one worker has run one (a worker may accept a
            # whole wave's connections before it runs any).
            storm: list[httpx.Response] = []
            while len(storm) < WAVES * WAVE and len({r.json()["pid"] for r in storm}) < 2:
                storm += await asyncio.gather(
                    *(post("alice", refund, uuid.uuid4().hex) for _ in range(WAVE))
                )
            # Legitimate: alice's other refunds, bob's same body (another caller), and
            # dave's retries with one key, replayed.
            others = [
                await post("alice", {"amount": 4500, "order": f"o-{n}"}, uuid.uuid4().hex)
                for n in range(2, 5)
            ]
            others.append(await post("bob", refund, uuid.uuid4().hex))
            dave_key = uuid.uuid4().hex
            replays = [await post("dave", refund, dave_key) for _ in range(3)]
            # carol repeats a refund on purpose, later than the window the audit is given.
            carol = [await post("carol", refund, uuid.uuid4().hex)]
            await asyncio.sleep(GAP)
            carol.append(await post("carol", refund, uuid.uuid4().hex))

    attempts = len(storm)
    assert [r.status_code for r in storm] == [201] * attempts
    assert len({r.json()["refund_id"] for r in storm}) == attempts  # every attempt ran
    assert len({r.json()["pid"] for r in storm}) > 1  # on more than one worker
    assert [r.status_code for r in others + carol] == [201] * 6
    assert [r.headers.get("idempotent-replayed") for r in replays] == [None, "true", "true"]

    code, report = audit(store_url, "--window", f"{int(GAP) - 1}s")
    assert code == 1
    (found,) = report["suspected"]
    assert found["route"] == ROUTE
    assert found["caller_digest"] == caller("alice")  # never the name
    assert (found["requests"], found["keys"]) == (attempts, attempts)
    assert found["first"] <= found["last"]
    assert "alice" not in json.dumps(report)

    # With the default window (10m) carol's two refunds are one run too: the window,
    # not anything else, kept them out above.
    code, report = audit(store_url)
    assert code == 1
    runs = sorted((r["keys"], r["caller_digest"]) for r in report["suspected"])
    assert runs == [
        (2, caller("carol")),
        (attempts, caller("alice")),
    ]

    # Another route, or a lookback that ends before the storm: nothing.
    assert audit(store_url, "--route", "/payouts/{account}")[0] == 0
    code, report = audit(store_url, "--route", ROUTE)
    assert code == 1

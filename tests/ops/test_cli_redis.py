"""``asgi-idempotency inspect`` / ``stats`` / ``prune`` / ``migrate`` on Redis URLs.

Synchronous, like ``test_cli``: the CLI runs its own event loop, so the records it
reads are written with ``asyncio.run`` first.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.core.lifecycle import claim
from asgi_idempotency.ops.cli import REDIS_MIGRATE, REDIS_PRUNE, Exit, main
from asgi_idempotency.stores.base import StoredResponse
from asgi_idempotency.stores.registry import kind_of
from asgi_idempotency.stores.urls import redact
from tests.conftest import backdate, redis_store

pytestmark = pytest.mark.redis

FINGERPRINT = "cd" * 32


async def _seed(url: str, now: datetime) -> None:
    store = await redis_store(url)  # flushed
    try:
        for key, done, age in (("refund-42", True, 0), ("running", False, 0), ("dead", False, 60)):
            t0 = now
            token = uuid.uuid4().hex
            digest = scoped_key("", key)
            owned = await claim(
                store, digest, FINGERPRINT, token, now=t0,
                lease=timedelta(seconds=30), ttl=timedelta(hours=24),
            )  # fmt: skip
            assert owned.owned
            if done:
                response = StoredResponse(201, (), b'{"refund_id": "r-1"}')
                await store.complete(digest, token, response, now=t0, ttl=timedelta(hours=24))
            # Written at the server's time: aged to ``age`` seconds before ``now``.
            record = await store.get(digest)
            assert record is not None
            await backdate(store, digest, record.created_at - (now - timedelta(seconds=age)))
    finally:
        await store.close()


@pytest.fixture(params=["redis", "redis_cluster"])
def seeded(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(
        "redis_cluster_url" if "cluster" in request.param else "redis_url"
    )
    asyncio.run(_seed(url, datetime.now(UTC)))
    return url


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_inspect_on_redis(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", "refund-42", "--database-url", seeded)
    assert code == Exit.OK
    assert scoped_key("", "refund-42") in out
    assert "completed" in out
    assert "201 (20 bytes stored)" in out
    assert "refund_id" not in out
    code, out, _ = run(capsys, "inspect", "dead", "--json", "--database-url", seeded)
    data = json.loads(out)
    assert (code, data["status"], data["abandoned"]) == (Exit.OK, "in_progress", True)
    assert run(capsys, "inspect", "never", "--database-url", seeded)[0] == Exit.NOT_FOUND


def test_stats_on_redis(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "stats", "--json", "--database-url", seeded)
    data = json.loads(out)
    assert code == Exit.OK
    assert data["total"] == 3
    assert data["live"] == {"completed": 1, "in_progress": 2}
    assert data["abandoned"] == 1  # of the two in progress
    assert data["expired"] == 0


def test_prune_on_redis_explains_that_redis_expires_records(
    seeded: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "prune", "--database-url", seeded)
    assert code == Exit.OK
    assert out.strip() == REDIS_PRUNE
    code, out, _ = run(capsys, "prune", "--json", "--database-url", seeded)
    assert json.loads(out) == {"pruned": 0, "dry_run": False, "note": REDIS_PRUNE}
    assert json.loads(run(capsys, "stats", "--json", "--database-url", seeded)[1])["total"] == 3


@pytest.mark.parametrize("scheme", ["redis", "rediss", "redis+cluster", "rediss+cluster"])
def test_migrate_on_redis_says_there_is_nothing_to_migrate(
    scheme: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Exit 0, as prune on Redis: a deploy step that always migrates keeps working, and
    # the note says why nothing happened. Nothing connects (port 9 refuses).
    code, out, err = run(capsys, "migrate", "--database-url", f"{scheme}://127.0.0.1:9/0")
    assert (code, err) == (Exit.OK, "")
    assert out.strip() == REDIS_MIGRATE
    assert "Redis needs no schema" in out


def test_an_unreachable_redis_is_exit_3_without_the_password(
    refused_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    port = refused_url.rsplit(":", 1)[1]
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    code, _, err = run(capsys, "stats", "--timeout", "1", "--database-url", url)
    assert code == Exit.UNREACHABLE
    assert "ConnectionError" in err
    assert "hunter2" not in err


def test_redis_urls_are_told_apart_and_redacted() -> None:
    for url in ("redis://h:1/0", "REDISS://h", "redis+cluster://h:7000", "rediss+cluster://h"):
        assert kind_of(url).name == "Redis", url
    for url in ("postgresql://h/db", "sqlite:///x.db"):
        assert kind_of(url).name != "Redis", url
    for url in ("redis", "rediscluster://h"):
        with pytest.raises(ValueError, match=r"malformed|unsupported"):
            kind_of(url)
    assert "s3cret" not in redact("redis+cluster://user:s3cret@h:7000")

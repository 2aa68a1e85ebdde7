"""``asgi-idempotency inspect`` takes the key digest a log line carries (the console script)."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import NewClaim, Policy, SQLStore
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.stores.base import utcnow
from tests.apps import guarded

SCRIPT = Path(sys.executable).parent / "asgi-idempotency"


def inspect(url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.exists(), f"{SCRIPT} missing: install the package (pip install -e .)"
    return subprocess.run(
        [str(SCRIPT), "inspect", *argv, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _serve_twice(url: str, key: str, principal: str) -> None:
    """A first request and its replay, the way the logs see them."""

    async def pay(request: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    store = SQLStore(url)
    app = guarded(
        store,
        [Route("/pay", pay, methods=["POST"])],
        policies={"POST /pay": Policy(required=True)},
        principal=lambda scope: principal,
    )
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for _ in range(2):
                r = await c.post("/pay", json={}, headers={"Idempotency-Key": key})
                assert r.status_code == 201, r.text
    finally:
        await store.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'records.db'}"


def test_the_digest_from_a_log_line_finds_its_record(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_idempotency")
    asyncio.run(_serve_twice(url, "refund-7f3a", principal="user-42"))
    (replay,) = [r for r in caplog.records if r.getMessage().startswith("idempotency.replay")]
    logged: str = replay.__dict__["key_digest"]
    assert len(logged) == 16

    done = inspect(url, logged, "--json")  # no --principal: the digest already names it
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["found"] is True
    assert shown["key_digest"] == scoped_key("user-42", "refund-7f3a", "t")
    assert shown["status"] == "completed"
    assert shown["response_status"] == 201

    text = inspect(url, logged.upper())
    assert text.returncode == 0, text.stderr
    assert f"key digest   {scoped_key('user-42', 'refund-7f3a', 't')}" in text.stdout


def test_a_digest_that_matches_nothing_is_not_found(url: str) -> None:
    asyncio.run(_serve_twice(url, "some-key", principal=""))
    done = inspect(url, "0123456789abcdef")
    assert done.returncode == 1, done.stderr
    assert "nor a record whose key digest starts with 0123456789abcdef" in done.stdout
    as_json = json.loads(inspect(url, "0123456789abcdef", "--json").stdout)
    assert as_json["key_digest"] == scoped_key("", "0123456789abcdef")
    assert as_json["found"] is False
    assert as_json["digest_prefix"] == "0123456789abcdef"


def test_an_ambiguous_digest_prefix_says_so(url: str) -> None:
    async def seed() -> None:
        store = SQLStore(url)
        try:
            await store.prepare()
            now = utcnow()
            for tail in ("0" * 48, "1" * 48):
                claim = NewClaim(
                    "abcdef0123456789" + tail, "ab" * 32, tail[:32], now,
                    timedelta(seconds=30), timedelta(hours=1),
                )  # fmt: skip
                assert await store.insert(claim) is None
        finally:
            await store.close()

    asyncio.run(seed())
    done = inspect(url, "abcdef0123456789")
    assert done.returncode == 2
    assert "matches more than one record" in done.stderr
    assert "Traceback" not in done.stderr
    longer = inspect(url, "abcdef0123456789" + "1" * 4)
    assert longer.returncode == 0, longer.stderr
    assert "abcdef0123456789" + "1" * 48 in longer.stdout


def test_a_hex_client_key_is_still_looked_up_as_a_key(url: str) -> None:
    asyncio.run(_serve_twice(url, "00ff00ff00ff00ff", principal=""))
    done = inspect(url, "00ff00ff00ff00ff", "--host", "t", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["key_digest"] == scoped_key("", "00ff00ff00ff00ff", "t")

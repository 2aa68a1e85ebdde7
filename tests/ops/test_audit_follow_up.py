"""From an audit finding to its records and its caller: the key digests it lists are what
``inspect`` takes, ``scope-digest PRINCIPAL`` prints the caller digest it shows, both
take the middleware's ``--namespace``; its Prometheus text carries its own family only.

Records written by the real middleware (SQLite), a caller whose client mints a new key
for each retry.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, Policy, SQLStore
from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.keys import scope_digest, scoped_key
from asgi_idempotency.ops.cli import Exit, main

HOST = "shop.example:8443"  # the port is ignored, by the middleware and the commands alike


async def _retry_storm(url: str, keys: int) -> None:
    """One caller sends one refund ``keys`` times, each under a new key."""

    async def refund(request: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    store = SQLStore(url)
    app = Starlette(
        routes=[Route("/refunds", refund, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies={"POST /refunds": Policy(required=True)},
                principal=lambda scope: "acme",
            )
        ],
    )
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{HOST}") as c:
            for n in range(keys):
                headers = {"Idempotency-Key": f"minted-in-the-loop-{n}"}
                r = await c.post("/refunds", json={"amount": 4500}, headers=headers)
                assert r.status_code == 201, r.text
    finally:
        await store.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    db = f"sqlite:///{tmp_path / 'records.db'}"
    asyncio.run(_retry_storm(db, keys=3))
    return db


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_the_audits_key_digests_are_what_inspect_takes(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _run(capsys, "audit", "--database-url", url, "--format", "json")
    assert code == Exit.FOUND
    (run,) = json.loads(out)["suspected"]
    expected = [scoped_key("acme", f"minted-in-the-loop-{n}", "shop.example") for n in range(3)]
    assert run["key_digests"] == expected  # oldest first, in full
    for digest in run["key_digests"]:
        code, shown = _run(capsys, "inspect", digest[:16], "--database-url", url, "--json")
        assert code == Exit.OK
        assert json.loads(shown)["key_digest"] == digest
    # The table shows the same digests, 16 hex digits each (a log line's key_digest).
    code, table = _run(capsys, "audit", "--database-url", url)
    assert code == Exit.FOUND
    listed = re.search(r"^  key digests: (.*)$", table, re.M)
    assert listed is not None, table
    assert listed.group(1).split() == [d[:16] for d in expected]
    assert "asgi-idempotency inspect KEY_DIGEST" in table


def test_scope_digest_names_the_caller_behind_the_audits_digest(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _run(capsys, "audit", "--database-url", url, "--format", "json")
    (run,) = json.loads(out)["suspected"]
    code, printed = _run(capsys, "scope-digest", "acme", "--host", HOST)
    assert code == Exit.OK
    assert printed == run["caller_digest"] + "\n"
    assert _run(capsys, "scope-digest", "globex", "--host", HOST)[1] != printed
    assert _run(capsys, "scope-digest", "acme")[1] != printed  # the host scopes it too
    code, table = _run(capsys, "audit", "--database-url", url)
    assert printed[:16] in table
    assert "asgi-idempotency scope-digest PRINCIPAL" in table


def test_namespace_scopes_inspects_keys_and_scope_digests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'ns.db'}"

    async def seed() -> None:
        store = SQLStore(db)
        try:
            await store.prepare()
            key = scoped_key("acme", "refund-1", "shop.example", namespace="billing")
            await lifecycle.claim(
                store, key, "f" * 64, "t" * 32, now=datetime.now(UTC),
                lease=timedelta(seconds=30), ttl=timedelta(hours=1),
            )  # fmt: skip
        finally:
            await store.close()

    asyncio.run(seed())
    scope = ("--principal", "acme", "--host", HOST, "--database-url", db)
    assert main(["inspect", "refund-1", *scope, "--namespace", "billing"]) == Exit.OK
    assert main(["inspect", "refund-1", *scope]) == Exit.NOT_FOUND
    assert "--namespace" in capsys.readouterr().out  # the hint names what may be missing
    assert main(["inspect", "refund-1", *scope, "--namespace", "shipping"]) == Exit.NOT_FOUND
    capsys.readouterr()
    code, printed = _run(capsys, "scope-digest", "acme", "--host", HOST, "--namespace", "billing")
    assert code == Exit.OK
    assert printed == scope_digest("acme", "shop.example", namespace="billing") + "\n"
    assert printed != scope_digest("acme", "shop.example") + "\n"
    for bad in ("has space", "x" * 65, "slash/y"):
        assert main(["scope-digest", "acme", "--namespace", bad]) == Exit.USAGE
        assert main(["inspect", "k", *scope, "--namespace", bad]) == Exit.USAGE
        assert "is not a service name" in capsys.readouterr().err  # the middleware's rule


def test_the_audit_suggests_commands_in_its_namespace(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, table = _run(capsys, "audit", "--database-url", url, "--namespace", "billing")
    assert code == Exit.FOUND
    assert "scope-digest PRINCIPAL [--host HOST] --namespace billing" in table
    code, out = _run(capsys, "audit", "--database-url", url, "--namespace", "billing",
                     "--format", "json")  # fmt: skip
    assert json.loads(out)["namespace"] == "billing"


def test_the_prometheus_text_carries_the_audits_family_alone(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _run(capsys, "audit", "--database-url", url, "--format", "prometheus")
    assert code == Exit.FOUND
    name = "idempotency_audit_suspected_regenerated_keys"
    assert text.splitlines() == [
        f"# HELP {name} " + text.split(f"# HELP {name} ", 1)[1].splitlines()[0],
        f"# TYPE {name} gauge",
        f'{name}{{route="/refunds"}} 2.0',
    ], text
    # Nothing found: the family's HELP and TYPE, still no other family.
    code, text = _run(capsys, "audit", "--database-url", url, "--format", "prometheus",
                      "--route", "/other")  # fmt: skip
    assert code == Exit.OK
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# ")}
    assert families == {name}, text

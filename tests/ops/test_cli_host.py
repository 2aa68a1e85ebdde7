"""``asgi-idempotency inspect`` looks a key up in the scope the middleware wrote it in.

Records are scoped by host (and the hosts a proxy names), so the command takes the
host as the app saw it, port and all, through the middleware's own function; when it
finds nothing it says which scope it searched and what may be missing, never a bare
"it never ran".
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import Policy, SQLStore
from asgi_idempotency.ops.cli import Exit, main
from tests.apps import guarded

KEY = "refund-7f3a"
PRINCIPAL = "user-42"


async def _refund(url: str, base_url: str, headers: dict[str, str]) -> None:
    """One guarded refund, written by the middleware to the store at ``url``."""

    async def refund(request: Request) -> Response:
        return JSONResponse({"refund": 1}, status_code=201)

    store = SQLStore(url)
    app = guarded(
        store,
        [Route("/refunds", refund, methods=["POST"])],
        policies={"POST /refunds": Policy(required=True)},
        principal=lambda scope: PRINCIPAL,
    )
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as c:
            r = await c.post("/refunds", json={}, headers={"Idempotency-Key": KEY, **headers})
            assert r.status_code == 201, r.text
    finally:
        await store.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'records.db'}"


def inspect(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str]:
    code = main(["inspect", KEY, "--principal", PRINCIPAL, *argv, "--database-url", url])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out


def test_a_host_with_a_port_finds_the_record_the_middleware_wrote(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(_refund(url, "http://localhost:8104", {}))
    for host in ("localhost:8104", "localhost", "LocalHost:9000"):
        code, out = inspect(capsys, url, "--host", host)
        assert code == Exit.OK, (host, out)
        assert "completed" in out
        assert "201 (" in out


def test_nothing_found_says_which_scope_was_searched_and_what_may_be_missing(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(_refund(url, "http://localhost:8104", {}))
    code, out = inspect(capsys, url)
    assert code == Exit.NOT_FOUND
    first = out.splitlines()[0]
    assert "never ran" not in first, "a confident wrong answer to a support question"
    assert "no record for this key in the scope searched" in first
    assert "host         none (--host not given)" in out
    assert "principal    'user-42'" in out
    assert "pass --host as the app saw it" in out

    code, out = inspect(capsys, url, "--host", "localhost:8104", "--json")
    assert code == Exit.OK, out  # the same record, found once the host is given
    code, out = inspect(capsys, url, "--host", "other.example:8104", "--json")
    assert code == Exit.NOT_FOUND
    shown = json.loads(out)
    assert shown["found"] is False
    assert shown["searched"] == {
        "host": "other.example",
        "principal": PRINCIPAL,
        "x_forwarded_host": None,
        "forwarded_host": None,
    }
    assert not any("--host" in hint for hint in shown["hints"])  # it was given
    assert any("--x-forwarded-host" in hint for hint in shown["hints"])


@pytest.mark.parametrize(
    ("header", "value", "option", "other"),
    [
        ("X-Forwarded-Host", "acme.shop.example", "--x-forwarded-host", "globex.shop.example"),
        (
            "Forwarded",
            "for=192.0.2.60;host=acme.shop.example",
            "--forwarded",
            "host=globex.shop.example",
        ),
    ],
)
def test_hosts_a_proxy_passed_on_are_searched_as_the_middleware_scoped_them(
    url: str,
    capsys: pytest.CaptureFixture[str],
    header: str,
    value: str,
    option: str,
    other: str,
) -> None:
    asyncio.run(_refund(url, "http://app.internal:8000", {header: value}))
    code, out = inspect(capsys, url, "--host", "app.internal:8000", option, value)
    assert code == Exit.OK, out
    code, out = inspect(capsys, url, "--host", "app.internal")
    assert code == Exit.NOT_FOUND
    assert "forwarded    none" in out
    assert "pass them with --x-forwarded-host or --forwarded" in out
    code, out = inspect(capsys, url, "--host", "app.internal", option, other)
    assert code == Exit.NOT_FOUND
    assert "globex.shop.example" in out


def test_help_documents_host_and_its_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--help"]) == Exit.OK
    shown = " ".join(capsys.readouterr().out.split())
    assert "--host HOST" in shown
    assert "the port is ignored" in shown
    assert "--x-forwarded-host VALUE" in shown
    assert "--forwarded VALUE" in shown

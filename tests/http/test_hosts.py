"""Which host a record belongs to: the host the app sees, never another's.

A tenant-per-host app names the tenant from the request's host: from ``Host`` (the
first one, as Starlette reads it) or, behind a proxy that rewrites ``Host``, from
``X-Forwarded-Host`` or ``Forwarded: host=``. Its users' ids are tenant-local ("1" in
every tenant), so the host in the record's scope is what keeps tenants apart: Mallory
of globex, with her own valid token and Alice's key, must never receive Alice's refund.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, InvalidHost, MemoryStore, Policy
from asgi_idempotency.http.asgi import Scope
from asgi_idempotency.http.request import forwarded_hosts, host_name, host_scope
from asgi_idempotency.ops._serve import serve_in_thread
from tests.helpers.lifespan import served

KEY = "refund-A-88214"
BODY = b'{"order": "A-88214", "amount_p": 4500}'
ACME, GLOBEX = "acme.shop.example", "globex.shop.example"
# Each tenant's users, by token; ids are tenant-local.
TOKENS = {ACME: {"tok-alice": "1"}, GLOBEX: {"tok-mallory": "1"}}
INVALID_HOST = "urn:asgi-idempotency:problem:invalid-host"


def _forwarded_host(value: str) -> str:
    """The ``host=`` of the first element of a ``Forwarded`` value, as an app reads it."""
    for pair in value.split(",")[0].split(";"):
        name, _, param = pair.strip().partition("=")
        if name.lower() == "host":
            return param.strip('"')
    return ""


def tenant_of(request: Request, via: str) -> str:
    """The tenant the app serves this request for, read the way the app reads it."""
    if via == "x-forwarded-host":
        raw = request.headers.get("x-forwarded-host", "")
    elif via == "forwarded":
        raw = _forwarded_host(request.headers.get("forwarded", ""))
    else:
        raw = request.headers.get("host", "")  # Starlette's (and the app's): the first
    return raw.split(":")[0].lower()


def tenant_app(via: str = "host", **guard: Any) -> tuple[Starlette, list[str]]:
    """Refunds per tenant; ``via`` names the header the app takes its tenant from."""
    runs: list[str] = []

    def user_of(request: Request) -> str | None:
        token = request.headers.get("authorization", "").removeprefix("Bearer ")
        return TOKENS.get(tenant_of(request, via), {}).get(token)

    def principal(scope: Scope) -> str | None:
        return user_of(Request(scope))

    async def refund(request: Request) -> Response:
        tenant, user = tenant_of(request, via), user_of(request)
        if user is None:
            return JSONResponse({"error": "unknown user"}, status_code=401)
        runs.append(tenant)
        body = await request.json()
        return JSONResponse(
            {"refund": len(runs), "tenant": tenant, "user": user, **body}, status_code=201
        )

    app = Starlette(
        routes=[Route("/refunds", refund, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                principal=principal,
                policies={"POST /refunds": Policy(required=True)},
                **guard,
            )
        ],
    )
    return app, runs


def post_raw(base_url: str, headers: list[tuple[str, str]]) -> tuple[int, dict[str, str], Any]:
    """POST ``/refunds`` with exactly these header lines, on a socket of its own."""
    host, _, port = base_url.removeprefix("http://").partition(":")
    lines = [
        "POST /refunds HTTP/1.1",
        *(f"{name}: {value}" for name, value in headers),
        "Content-Type: application/json",
        f"Content-Length: {len(BODY)}",
        "Connection: close",
    ]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + BODY)
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        body = answer.read()
    return answer.status, {k.lower(): v for k, v in answer.getheaders()}, json.loads(body)


def test_two_host_headers_are_a_400_and_never_reach_another_tenants_record() -> None:
    """The attack: the app reads the first Host, the old guard scoped by the last."""
    app, runs = tenant_app()
    with serve_in_thread(app, lifespan="on", http="httptools") as url:
        alice = [("Host", ACME), ("Authorization", "Bearer tok-alice"), ("Idempotency-Key", KEY)]
        status, _, alices = post_raw(url, alice)
        assert status == 201, alices

        mallory = [
            ("Host", GLOBEX),
            ("Host", ACME),
            ("Authorization", "Bearer tok-mallory"),
            ("Idempotency-Key", KEY),
        ]
        status, headers, answer = post_raw(url, mallory)
        assert answer != alices, "Mallory received Alice's stored refund"
        assert "idempotent-replayed" not in headers
        assert status == 400, answer
        assert headers["content-type"] == "application/problem+json"
        assert answer["type"] == INVALID_HOST
        assert "Host" in answer["detail"]

        # Nothing was claimed or stored for the refused request: Mallory's own request
        # runs once for her tenant, and Alice's retry still replays her own refund.
        status, _, own = post_raw(url, [mallory[0], *mallory[2:]])
        assert (status, own["tenant"], own["user"]) == (201, GLOBEX, "1"), own
        status, headers, again = post_raw(url, alice)
        assert (status, headers.get("idempotent-replayed"), again) == (201, "true", alices)
    assert runs == [ACME, GLOBEX]


@pytest.mark.anyio
async def test_two_host_headers_are_refused_with_scope_by_host_off_too() -> None:
    app, runs = tenant_app(scope_by_host=False)
    async with served(app) as c:
        r = await c.post(
            "/refunds",
            content=BODY,
            headers=[
                ("Host", GLOBEX), ("Host", ACME), ("Authorization", "Bearer tok-mallory"),
                ("Idempotency-Key", KEY), ("Content-Type", "application/json"),
            ],
        )  # fmt: skip
    assert r.status_code == 400
    assert r.json()["type"] == INVALID_HOST
    assert runs == []


def _via(header: str, tenant: str) -> tuple[str, str]:
    """The header a proxy in front of the app adds to name the host the client asked for."""
    if header == "x-forwarded-host":
        return ("X-Forwarded-Host", tenant)
    return ("Forwarded", f'for=192.0.2.60;proto=https;host="{tenant}"')


@pytest.mark.anyio
@pytest.mark.parametrize("header", ["x-forwarded-host", "forwarded"])
async def test_behind_a_proxy_that_rewrites_host_each_tenant_gets_its_own_run(
    header: str,
) -> None:
    """nginx's default: every request reaches the app with ``Host: app.internal``."""
    app, runs = tenant_app(header)

    def headers(tenant: str, token: str) -> list[tuple[str, str]]:
        return [
            ("Host", "app.internal:8000"), _via(header, tenant),
            ("Authorization", f"Bearer {token}"), ("Idempotency-Key", KEY),
            ("Content-Type", "application/json"),
        ]  # fmt: skip

    async with served(app) as c:
        alice = await c.post("/refunds", content=BODY, headers=headers(ACME, "tok-alice"))
        mallory = await c.post("/refunds", content=BODY, headers=headers(GLOBEX, "tok-mallory"))
        again = await c.post("/refunds", content=BODY, headers=headers(ACME, "tok-alice"))
    assert alice.status_code == mallory.status_code == 201, (alice.text, mallory.text)
    assert "idempotent-replayed" not in mallory.headers, "Mallory received Alice's refund"
    assert mallory.json()["tenant"] == GLOBEX
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == alice.json()
    assert runs == [ACME, GLOBEX]


def _proxied(*extra: tuple[str, str], token: str = "tok-alice") -> list[tuple[str, str]]:
    return [
        ("Host", "app.internal:8000"), *extra, ("Authorization", f"Bearer {token}"),
        ("Idempotency-Key", KEY), ("Content-Type", "application/json"),
    ]  # fmt: skip


@pytest.mark.anyio
async def test_x_forwarded_host_sent_twice_is_a_400_and_stores_nothing() -> None:
    app, runs = tenant_app("x-forwarded-host")
    async with served(app) as c:
        twice = _proxied(("X-Forwarded-Host", GLOBEX), ("X-Forwarded-Host", ACME))
        refused = await c.post("/refunds", content=BODY, headers=twice)
        alice = await c.post("/refunds", content=BODY, headers=_proxied(("X-Forwarded-Host", ACME)))
    assert refused.status_code == 400
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["type"] == INVALID_HOST
    assert "X-Forwarded-Host" in refused.json()["detail"]
    assert alice.status_code == 201
    assert "idempotent-replayed" not in alice.headers
    assert runs == [ACME]


@pytest.mark.anyio
async def test_a_retry_through_the_same_proxy_replays() -> None:
    """Only the host names scope the record: a port, case or another ``for=`` does not."""
    app, runs = tenant_app("forwarded")
    async with served(app) as c:
        first = await c.post(
            "/refunds",
            content=BODY,
            headers=_proxied(("Forwarded", f'for="192.0.2.60:41000";host="{ACME}"')),
        )
        retry = await c.post(
            "/refunds",
            content=BODY,
            headers=_proxied(("Forwarded", f"For=198.51.100.7;Host={ACME.upper()}:443")),
        )
    assert first.status_code == 201, first.text
    assert retry.headers["idempotent-replayed"] == "true"
    assert runs == [ACME]


@pytest.mark.anyio
async def test_forwarded_on_two_lines_is_one_list_and_every_host_in_it_scopes() -> None:
    """RFC 7239 §4: a proxy may add its element on a line of its own."""
    app, runs = tenant_app("forwarded")
    async with served(app) as c:
        alice = await c.post(
            "/refunds", content=BODY, headers=_proxied(("Forwarded", f"host={ACME}"))
        )
        # The app reads the first element (globex); the second names Alice's tenant.
        two_lines = _proxied(
            ("Forwarded", f"host={GLOBEX}"), ("Forwarded", f"host={ACME}"), token="tok-mallory"
        )
        mallory = await c.post("/refunds", content=BODY, headers=two_lines)
    assert alice.status_code == mallory.status_code == 201
    assert "idempotent-replayed" not in mallory.headers
    assert runs == [ACME, GLOBEX]


@pytest.mark.anyio
async def test_scope_by_host_off_leaves_forwarded_hosts_out_too() -> None:
    app, runs = tenant_app("x-forwarded-host", scope_by_host=False)
    async with served(app) as c:
        first = await c.post("/refunds", content=BODY, headers=_proxied(("X-Forwarded-Host", ACME)))
        again = await c.post("/refunds", content=BODY, headers=_proxied(("X-Forwarded-Host", ACME)))
        # Without a host in the scope, host names the app does not read change nothing.
        more = _proxied(("X-Forwarded-Host", ACME), ("Forwarded", "host=other.example"))
        other = await c.post("/refunds", content=BODY, headers=more)
    assert first.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert other.headers["idempotent-replayed"] == "true"
    assert runs == [ACME]


def test_the_scope_of_a_host_alone_is_its_name() -> None:
    """Records written before forwarded hosts entered the scope keep their keys."""
    assert host_scope(b"Shop.Example:8443") == host_name(b"shop.example") == "shop.example"
    assert host_scope(b"[::1]:8000") == "[::1]"


@pytest.mark.parametrize(
    ("forwarded", "hosts"),
    [
        (b'for=192.0.2.60;proto=http;host="a.example:8080"', [b"a.example:8080"]),
        (b"HOST = a.example , for=x;host=b.example", [b"a.example", b"b.example"]),
        (b'host="a\\"b"', [b'a"b']),
        (b'for="x;host=c.example";host=a.example', [b'c.example"', b"a.example"]),
        (b"for=192.0.2.60;proto=https", []),
        (b'host="unterminated', [b"unterminated"]),
    ],
)
def test_every_host_parameter_of_forwarded_is_read(forwarded: bytes, hosts: list[bytes]) -> None:
    assert forwarded_hosts(forwarded) == hosts


def test_forwarded_names_split_scopes_and_never_join_them() -> None:
    scopes = {
        host_scope(b"app.internal"),
        host_scope(b"app.internal", b"acme.example"),
        host_scope(b"app.internal", b"globex.example"),
        host_scope(b"app.internal", b"acme.example, globex.example"),
        host_scope(b"app.internal", None, b"host=acme.example"),
        host_scope(b"app.internal", b"acme.example", b"host=acme.example"),
        host_scope(b"app.internal", b""),
        host_scope(b"app.internal", None, b""),
    }
    assert len(scopes) == 8
    assert host_scope(b"app.internal:80", b"Acme.example:443") == host_scope(
        b"app.internal", b"acme.example"
    )


def test_a_host_with_a_nul_is_refused_so_no_name_can_spell_another_scope() -> None:
    with pytest.raises(InvalidHost):
        host_scope(b"app.internal\x00x17:acme.shop.example")
    with pytest.raises(InvalidHost):
        host_scope(b"app.internal", b"acme.shop.example\x00")

"""The guard's place among the app's other middleware, as browsers and proxies meet it."""

from __future__ import annotations

import asyncio
import gzip

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from asgi_idempotency.http.capture import storable_headers
from asgi_idempotency.http.principals import ANONYMOUS
from tests.apps import guarded
from tests.helpers.lifespan import refuses, served

pytestmark = pytest.mark.anyio

ORIGIN = "https://app.shop.example"


def _app(*, cors_inside: bool = False, gzip_inside: bool = False) -> Starlette:
    gate = asyncio.Event()

    @idempotent(required=True)
    async def refund(request: Request) -> Response:
        if request.query_params.get("wait"):
            await gate.wait()
        return JSONResponse({"refund": 1}, status_code=201)

    cors = Middleware(
        CORSMiddleware,
        allow_origins=[ORIGIN],
        allow_methods=["POST"],
        allow_headers=["Idempotency-Key"],
        expose_headers=["Idempotent-Replayed", "Retry-After"],
    )
    guard = Middleware(IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS)
    extra = [Middleware(GZipMiddleware)] if gzip_inside else []
    stack = [guard, cors] if cors_inside else [cors, guard, *extra]
    app = Starlette(routes=[Route("/refunds", refund, methods=["POST"])], middleware=stack)
    app.state.gate = gate
    return app


async def test_cors_inside_the_guard_is_refused_naming_the_order() -> None:
    message = await refuses(_app(cors_inside=True))
    assert "CORSMiddleware is inside IdempotencyMiddleware" in message
    assert "add_middleware" in message


async def test_gzip_inside_the_guard_is_refused() -> None:
    assert "GZipMiddleware is inside IdempotencyMiddleware" in await refuses(_app(gzip_inside=True))


async def test_with_cors_outside_a_browser_reads_the_guards_own_answers() -> None:
    app = _app()
    async with served(app) as c:
        headers = {"Origin": ORIGIN, "Idempotency-Key": "k-1"}
        missing = await c.post("/refunds", headers={"Origin": ORIGIN})
        first = asyncio.create_task(c.post("/refunds?wait=1", headers=headers))
        await asyncio.sleep(0.05)
        busy = await c.post("/refunds?wait=1", headers=headers)
        app.state.gate.set()
        await first
        replay = await c.post("/refunds?wait=1", headers=headers)
    for answer in (missing, busy, replay):
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        exposed = answer.headers["access-control-expose-headers"].lower()
        assert "idempotent-replayed" in exposed
        assert "retry-after" in exposed
    assert missing.status_code == 400
    assert busy.status_code == 409
    assert replay.headers["idempotent-replayed"] == "true"


def test_access_control_headers_are_never_stored() -> None:
    kept = storable_headers(
        [
            (b"content-type", b"application/json"),
            (b"Access-Control-Allow-Origin", b"https://a.example"),
            (b"access-control-allow-credentials", b"true"),
        ]
    )
    assert kept == ((b"content-type", b"application/json"),)


async def test_a_replay_never_sends_a_coding_the_retry_did_not_accept() -> None:
    payload = b'{"refund": "A-88214"}' * 50

    @idempotent(required=True)
    async def refund(request: Request) -> Response:
        # An app that compresses by itself, for a client that accepted gzip.
        return Response(
            gzip.compress(payload),
            status_code=201,
            headers={"content-encoding": "gzip", "vary": "Accept-Encoding"},
            media_type="application/json",
        )

    app = guarded(MemoryStore(), [Route("/refunds", refund, methods=["POST"])])
    async with served(app) as c:
        first = await c.post(
            "/refunds", headers={"Idempotency-Key": "k", "Accept-Encoding": "gzip"}
        )
        plain = await c.post(
            "/refunds", headers={"Idempotency-Key": "k", "Accept-Encoding": "identity"}
        )
        refused = await c.post(
            "/refunds", headers={"Idempotency-Key": "k", "Accept-Encoding": "gzip;q=0, br"}
        )
        again = await c.post(
            "/refunds", headers={"Idempotency-Key": "k", "Accept-Encoding": "gzip, br"}
        )
    assert first.content == payload  # httpx decodes what it accepted
    for answer in (plain, refused):
        assert answer.headers["idempotent-replayed"] == "true"
        assert "content-encoding" not in answer.headers
        assert answer.content == payload
        assert answer.headers["content-length"] == str(len(payload))
    assert again.headers["content-encoding"] == "gzip"
    assert again.content == payload

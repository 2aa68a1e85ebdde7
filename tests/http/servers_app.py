"""The app `tests/http/test_servers.py` serves with each ASGI server, in a process of its own.

``POST /refunds`` runs once per key; ``POST /slow`` waits in its handler until
``GET /release`` (``GET /entered`` says when one is inside), for the in-flight 409;
``POST /grpc`` answers with trailers (``grpc-status``, ``grpc-message``) where the
server takes them (``scope["extensions"]["http.response.trailers"]``), as a gRPC-style
handler does. ``GET /runs`` counts each handler's runs. One worker, the memory store.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore
from asgi_idempotency.http.principals import ANONYMOUS

TRAILERS = [(b"grpc-status", b"0"), (b"grpc-message", b"refund accepted")]

runs: Counter[str] = Counter()
entered = asyncio.Event()
gate = asyncio.Event()


async def refunds(request: Request) -> Response:
    runs["refunds"] += 1
    body = await request.json()
    return JSONResponse({"refund": runs["refunds"], **body}, status_code=201)


async def slow(request: Request) -> Response:
    runs["slow"] += 1
    entered.set()
    await gate.wait()
    return JSONResponse({"slow": runs["slow"]}, status_code=201)


class Grpc:
    """A raw ASGI endpoint (an instance, so Starlette's Route calls it as an ASGI app):
    trailers when the server offers them, as the spec asks."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await _grpc(scope, receive, send)


async def _grpc(scope: Any, receive: Any, send: Any) -> None:
    runs["grpc"] += 1
    while (await receive()).get("more_body", False):
        pass
    offered = "http.response.trailers" in scope.get("extensions", {})
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/grpc+json")],
                "trailers": offered})  # fmt: skip
    await send({"type": "http.response.body", "body": b'{"refund": 1}', "more_body": False})
    if offered:
        await send({"type": "http.response.trailers", "headers": TRAILERS, "more_trailers": False})


async def ready(request: Request) -> Response:
    return PlainTextResponse("ok")


async def entered_yet(request: Request) -> Response:
    return PlainTextResponse("1" if entered.is_set() else "0")


async def release(request: Request) -> Response:
    gate.set()
    return PlainTextResponse("released")


async def counts(request: Request) -> Response:
    return JSONResponse(dict(runs))


app = Starlette(
    routes=[
        Route("/ready", ready),
        Route("/refunds", refunds, methods=["POST"]),
        Route("/slow", slow, methods=["POST"]),
        Route("/entered", entered_yet),
        Route("/release", release),
        Route("/grpc", Grpc(), methods=["POST"]),
        Route("/runs", counts),
    ],
    middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS)],
)

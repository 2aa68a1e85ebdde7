"""A tiny in-process refund app for the reliability tests, and a raw ASGI driver."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message

from asgi_idempotency import IdempotencyMiddleware, Policy
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.stores.base import Store

Hook = Callable[[], Awaitable[None]]


@dataclass
class RefundApp:
    """``POST /refunds`` (guarded, key required), ``POST /notes`` (exempt), ``GET /health``."""

    app: Starlette
    calls: dict[str, int]
    started: asyncio.Event
    gate: asyncio.Event
    finished: list[str] = field(default_factory=list)

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://test", **kwargs
        )


def refund_app(
    store: Store,
    *,
    lease: float = 30.0,
    after_handler: Hook | None = None,
    **middleware: Any,
) -> RefundApp:
    """Build the app. A body with ``"wait": true`` blocks on ``gate`` after setting ``started``;
    ``"sleep": s`` sleeps; ``after_handler`` runs once the effect is done, before returning."""
    calls: dict[str, int] = {}
    started, gate = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    def count(name: str) -> None:
        calls[name] = calls.get(name, 0) + 1

    async def refund(request: Request) -> Response:
        count("refund")
        data = orjson.loads(await request.body())
        started.set()
        if data.get("wait"):
            await gate.wait()
        if data.get("sleep"):
            await asyncio.sleep(float(data["sleep"]))
        refund_id = uuid.uuid4().hex
        finished.append(refund_id)
        if after_handler is not None:
            await after_handler()
        return JSONResponse({"refund_id": refund_id, "amount": data.get("amount")}, status_code=201)

    async def notes(request: Request) -> Response:
        count("notes")
        return JSONResponse({"ok": True})

    async def health(request: Request) -> Response:
        count("health")
        return JSONResponse({"ok": True})

    policies = {
        "POST /refunds": Policy(required=True, lease=timedelta(seconds=lease)),
        "POST /notes": Policy(enabled=False),
    }
    app = Starlette(
        routes=[
            Route("/refunds", refund, methods=["POST"]),
            Route("/notes", notes, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies=policies,
                **{"principal": ANONYMOUS, **middleware},
            )
        ],
    )
    return RefundApp(app, calls, started, gate, finished)


@dataclass
class RawResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


async def asgi_call(
    app: ASGIApp,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    chunks: list[bytes],
) -> RawResponse:
    """Drive ``app`` with exactly these header bytes and body chunks (no client normalising)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    pending = list(chunks) or [b""]
    sent_all = False

    async def receive() -> Message:
        nonlocal sent_all
        if pending:
            chunk = pending.pop(0)
            sent_all = not pending
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
        await asyncio.sleep(3600)  # a client that stays: the app must not need more
        raise AssertionError("unreachable")

    status = 0
    out_headers: list[tuple[bytes, bytes]] = []
    body = bytearray()
    starts = 0

    async def send(message: Message) -> None:
        nonlocal status, out_headers, starts
        if message["type"] == "http.response.start":
            starts += 1
            status = message["status"]
            out_headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))

    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    assert starts == 1, f"{starts} response starts"
    return RawResponse(status, out_headers, bytes(body))

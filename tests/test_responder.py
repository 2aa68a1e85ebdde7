"""The responder's last duty: a completion interrupted by cancellation still lands or is logged."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, StoredResponse, StoreError
from asgi_idempotency.asgi import Message

pytestmark = pytest.mark.anyio


class CompletionFails(MemoryStore):
    """A store whose first completion hangs (the request is cancelled there) and whose
    second, run in the background, fails."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.calls = 0

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, expires_at: datetime
    ) -> bool:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            await asyncio.Event().wait()
        raise StoreError("connection lost while completing")


async def test_a_failed_background_completion_is_logged_with_its_route_and_key_digest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def pay(request: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    store = CompletionFails()
    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store)],
    )
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/pay", "raw_path": b"/pay", "query_string": b"",
        "root_path": "", "headers": [(b"idempotency-key", b"k-1"), (b"content-length", b"2")],
        "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {},
    }  # fmt: skip
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    request = asyncio.ensure_future(app(scope, receive, send))
    await store.entered.wait()
    with caplog.at_level(logging.ERROR, logger="asgi_idempotency"):
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        for _ in range(5):  # the background retry runs on the next turns of the loop
            await asyncio.sleep(0)
    assert store.calls == 2
    [record] = [r for r in caplog.records if getattr(r, "event", "") == "idempotency.store_error"]
    assert record.__dict__["route"] == "/pay"
    assert record.__dict__["phase"] == "complete"
    assert len(record.__dict__["key_digest"]) == 16
    assert "k-1" not in record.getMessage()

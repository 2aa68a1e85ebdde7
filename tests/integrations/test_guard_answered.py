"""When the guard answers a FastAPI request itself (replay, 409, 422) after the dependency
claim, the endpoint is stopped by a signal only the guard catches: the app's exception
handlers and its middleware never see an answer the client never gets."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import Response
from fastapi.security import APIKeyHeader
from starlette.exceptions import HTTPException as StarletteHTTPException

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from asgi_idempotency.principals import from_dependency

pytestmark = [pytest.mark.anyio]

api_key = APIKeyHeader(name="X-API-Key")


def current_client(key: str = Depends(api_key)) -> str:
    return key


async def test_the_apps_handlers_never_see_the_guards_own_answer() -> None:
    seen: list[int] = []  # what the app's exception handler and middleware saw
    ran: list[str] = []
    app = FastAPI()

    @app.exception_handler(StarletteHTTPException)
    async def audited(request: Request, exc: StarletteHTTPException) -> Response:
        seen.append(exc.status_code)  # an app that writes an audit row per error answer
        return await http_exception_handler(request, exc)

    @app.middleware("http")
    async def catches_everything(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)  # a middleware of the app's, inside the guard
        seen.append(response.status_code)
        return response

    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), principal=from_dependency(current_client)
    )

    @app.post("/pay", status_code=201)
    @idempotent(required=True)
    async def pay(client: str = Depends(current_client)) -> dict[str, str]:
        ran.append(client)
        return {"paid": client}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        h = {"Idempotency-Key": "k", "X-API-Key": "acme"}
        first = await c.post("/pay", headers=h)
        replay = await c.post("/pay", headers=h)
        mismatch = await c.post("/pay?x=1", headers=h)
    assert first.status_code == replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert mismatch.status_code == 422
    assert ran == ["acme"]
    assert seen == [201]  # the first's answer only: no handler saw the guard's

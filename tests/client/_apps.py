"""A guarded refund app for the end-to-end tests: the real middleware in front of a handler
whose every run is an effect, counted in memory and, optionally, in a file on disk."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy, SQLStore
from asgi_idempotency.http.principals import ANONYMOUS


@dataclass
class StatusLog:
    """Outermost ASGI wrapper: records the status of every response the server sends."""

    app: ASGIApp
    statuses: list[int] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def record(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.statuses.append(message["status"])
            await send(message)

        await self.app(scope, receive, record)


@dataclass
class Guarded:
    """The app, what its handler returned each time it ran, and the response log."""

    app: StatusLog
    effects: list[dict[str, Any]]

    @property
    def statuses(self) -> list[int]:
        return self.app.statuses


def guarded_app(
    store: str | Path,
    *,
    delay: float = 0.0,
    effects_file: Path | None = None,
) -> Guarded:
    """``POST /refunds`` guarded with ``Policy(required=True)``.

    Args:
        store: ``"memory"``, or the path of a SQLite file for a ``SQLStore``.
        delay: Seconds the handler sleeps after its effect, before answering.
        effects_file: If given, each effect also appends a line to this file, so a
            count survives the test's Python objects.
    """
    effects: list[dict[str, Any]] = []
    if store == "memory":
        backend: MemoryStore | SQLStore = MemoryStore()
    else:
        backend = SQLStore(f"sqlite+aiosqlite:///{store}")

    async def refund(request: Request) -> Response:
        body = await request.json()
        effect = {"refund_id": uuid.uuid4().hex, "n": len(effects) + 1, "args": body}
        effects.append(effect)
        if effects_file is not None:
            with effects_file.open("a") as out:
                out.write(f"{effect['refund_id']}\n")
        await anyio.sleep(delay)
        return JSONResponse(effect, status_code=201)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        # The SQL store's connections belong to the server's event loop: open and
        # close them there.
        if isinstance(backend, SQLStore):
            await backend.create_all()
        try:
            yield
        finally:
            if isinstance(backend, SQLStore):
                await backend.close()

    app = Starlette(
        routes=[Route("/refunds", refund, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=backend,
                principal=ANONYMOUS,
                policies={"POST /refunds": Policy(required=True)},
            )
        ],
        lifespan=lifespan,
    )
    return Guarded(StatusLog(app), effects)

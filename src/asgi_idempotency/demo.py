"""A small refund service: the demo's server and the multi-process tests' app.

Configured from the environment so that ``uvicorn asgi_idempotency.demo:app
--workers N`` gives every worker the same setup:

- ``IDEMPOTENCY_DEMO_DATABASE_URL``: store and refunds table (default ``sqlite+aiosqlite:///./idempotency-demo.db``)
- ``IDEMPOTENCY_DEMO_GUARDED``: ``0`` serves without the middleware (default ``1``)
- ``IDEMPOTENCY_DEMO_LEASE``: lease in seconds (default 30)
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .middleware import IdempotencyMiddleware
from .policy import Policy
from .stores.sql import SQLStore

__all__ = ["app", "count_refunds", "create_app", "refunds"]

demo_metadata = MetaData()
refunds = Table(
    "demo_refunds",
    demo_metadata,
    Column("id", String(36), primary_key=True),
    Column("order_id", String(64), nullable=False),
    Column("amount", Integer, nullable=False),
)

DEFAULT_URL = "sqlite+aiosqlite:///./idempotency-demo.db"


def create_app(url: str, *, guarded: bool = True, lease: float = 30.0) -> Starlette:
    """The refund app. ``POST /orders/{order_id}/refunds`` with ``{"amount": int, "delay": s}``."""
    store = SQLStore(url)

    async def refund(request: Request) -> JSONResponse:
        payload: dict[str, Any] = await request.json()
        await asyncio.sleep(float(payload.get("delay", 0)))
        refund_id = str(uuid.uuid4())
        async with store.engine.begin() as conn:
            await conn.execute(
                insert(refunds).values(
                    id=refund_id,
                    order_id=request.path_params["order_id"],
                    amount=int(payload["amount"]),
                )
            )
        return JSONResponse({"refund_id": refund_id, "amount": payload["amount"]}, status_code=201)

    async def count(request: Request) -> JSONResponse:
        return JSONResponse({"refunds": await count_refunds(store)})

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        await store.close()

    middleware = []
    if guarded:
        policy = Policy(required=True, lease=timedelta(seconds=lease))
        middleware.append(
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies={"POST /orders/{order_id}/refunds": policy},
            )
        )
    return Starlette(
        routes=[
            Route("/orders/{order_id}/refunds", refund, methods=["POST"]),
            Route("/refunds/count", count, methods=["GET"]),
        ],
        middleware=middleware,
        lifespan=lifespan,
    )


async def prepare(url: str) -> None:
    """Create the records and refunds tables (idempotent)."""
    store = SQLStore(url)
    try:
        await store.create_all()
        async with store.engine.begin() as conn:
            await conn.run_sync(demo_metadata.create_all)
    finally:
        await store.close()


async def count_refunds(store: SQLStore) -> int:
    async with store.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(refunds))).scalar_one())


def _from_env() -> Starlette:
    return create_app(
        os.environ.get("IDEMPOTENCY_DEMO_DATABASE_URL", DEFAULT_URL),
        guarded=os.environ.get("IDEMPOTENCY_DEMO_GUARDED", "1") != "0",
        lease=float(os.environ.get("IDEMPOTENCY_DEMO_LEASE", "30")),
    )


def __getattr__(name: str) -> Any:
    # Built on first access so importing this module has no side effects.
    if name == "app":
        return _from_env()
    raise AttributeError(name)

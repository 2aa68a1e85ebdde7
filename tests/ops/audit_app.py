"""A refund app for the audit's multi-worker tests (``tests.ops.audit_app:app``), on any store.

Configured from the environment: ``IDEMPOTENCY_TEST_AUDIT_URL`` names the store (a SQL
URL, or ``redis://``). ``POST /refunds/{account}`` is guarded with the middleware's
default settings (a required key, scoped by host and by the gateway-verified
``X-User`` header); each execution answers with a fresh refund id and the worker's pid.
``GET /refunds/count`` is the readiness path of ``uvicorn_process``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, Policy
from asgi_idempotency.http.principals import from_headers
from asgi_idempotency.stores.base import Store

APP = "tests.ops.audit_app:app"
ENV = "IDEMPOTENCY_TEST_AUDIT_URL"


def _store(url: str) -> Store:
    if url.startswith("redis"):
        from asgi_idempotency.stores.redis import RedisStore

        return RedisStore(url, command_timeout=5)
    from asgi_idempotency.stores.sql.store import SQLStore

    return SQLStore(url, command_timeout=5)


def create_app(url: str) -> Starlette:
    store = _store(url)

    async def refund(request: Request) -> JSONResponse:
        await request.body()
        # Blocking (not awaiting) keeps this worker from accepting meanwhile, so that
        # concurrent connections reach the other workers (as tests/ops/test_serving.py does).
        time.sleep(0.05)  # noqa: ASYNC251
        return JSONResponse({"refund_id": uuid.uuid4().hex, "pid": os.getpid()}, 201)

    async def count(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await store.close()

    return Starlette(
        routes=[
            Route("/refunds/{account}", refund, methods=["POST"]),
            Route("/refunds/count", count, methods=["GET"]),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                principal=from_headers("X-User"),
                policies={"POST /refunds/{account}": Policy(required=True)},
            )
        ],
        lifespan=lifespan,
    )


def __getattr__(name: str) -> Starlette:
    # Built on first access (by uvicorn), not at import: importing needs no environment.
    if name == "app":
        value = create_app(os.environ[ENV])
        globals()["app"] = value
        return value
    raise AttributeError(name)

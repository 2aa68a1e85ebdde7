"""An app for ``asgi-idempotency check --expect-wait``, served by a real uvicorn process.

Our middleware on a :class:`MemoryStore`, anonymous callers: ``POST /waits`` (1 s) with
``Policy(wait=...)``, where a duplicate in flight waits for the first's answer and gets
it replayed, and ``POST /answers-409`` (1 s) without, where it gets 409 at once.
``GET /refunds/count`` is the readiness path.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy
from asgi_idempotency.http.principals import ANONYMOUS

WAITING = "tests.ops.wait_apps:app"
_effects = [0]


async def refund(request: Request) -> Response:
    await asyncio.sleep(1.0)
    _effects[0] += 1
    return JSONResponse({"refund_id": str(uuid.uuid4())}, status_code=201)


async def count(request: Request) -> Response:
    return JSONResponse({"count": _effects[0]})


app = Starlette(
    routes=[
        Route("/waits", refund, methods=["POST"]),
        Route("/answers-409", refund, methods=["POST"]),
        Route("/refunds/count", count),
    ],
    middleware=[
        Middleware(
            IdempotencyMiddleware,
            store=MemoryStore(),
            principal=ANONYMOUS,
            policies={
                "POST /waits": Policy(
                    required=True, wait=timedelta(seconds=10), lease=timedelta(seconds=30)
                ),
                "POST /answers-409": Policy(required=True),
            },
        )
    ],
)

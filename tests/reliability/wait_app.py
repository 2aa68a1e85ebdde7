"""A Starlette app served by real uvicorn for the storm of waiting duplicates.

``POST /refunds`` waits for a running first (``wait``): a body ``{"gate": path}`` runs
until the file ``path`` exists, and each run appends a line with its key to the file
``EFFECTS``.
``GET /waiting`` says how many duplicates wait in this worker, ``GET /memory`` its
resident memory (kB) and live objects. ``STORE_URL`` is the store's SQLAlchemy URL.
"""

from __future__ import annotations

import asyncio
import gc
import os
import uuid
from datetime import timedelta
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, SQLStore, idempotent
from asgi_idempotency.http.principals import ANONYMOUS

EFFECTS = Path(os.environ["EFFECTS"])
WAIT = timedelta(seconds=25)
LEASE = timedelta(seconds=30)


def effect(key: str) -> None:
    with EFFECTS.open("a") as f:
        f.write(key + "\n")


async def opened(gate: str) -> None:
    for _ in range(3000):  # 60 s at most: a test that failed must not hang its server
        if await asyncio.to_thread(os.path.exists, gate):
            return
        await asyncio.sleep(0.02)


@idempotent(required=True, wait=WAIT, lease=LEASE)
async def refund(request: Request) -> JSONResponse:
    data = await request.json()
    effect(request.headers["idempotency-key"])
    gate = data.get("gate")
    if gate is not None:
        await opened(str(gate))
    return JSONResponse({"refund": uuid.uuid4().hex, "amount": data.get("amount")}, 201)


def count(request: Request) -> JSONResponse:
    return JSONResponse({"n": len(EFFECTS.read_text().splitlines()) if EFFECTS.exists() else 0})


async def waiting(request: Request) -> JSONResponse:
    guard = IdempotencyMiddleware.of(request.app)
    return JSONResponse({"waiting": guard._runtime.runner.waiters.waiting()})


def memory(request: Request) -> JSONResponse:
    """Resident memory (kB) and live objects, after a full collection: what stays."""
    gc.collect()
    status = Path("/proc/self/status").read_text()
    kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return JSONResponse({"kb": kb, "objects": len(gc.get_objects())})


app = Starlette(
    routes=[
        Route("/refunds", refund, methods=["POST"]),
        Route("/refunds/count", count),
        Route("/waiting", waiting),
        Route("/memory", memory),
    ],
    middleware=[
        Middleware(
            IdempotencyMiddleware, store=SQLStore(os.environ["STORE_URL"]), principal=ANONYMOUS
        )
    ],
)

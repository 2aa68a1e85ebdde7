"""A refund app on :class:`RedisStore`, for real uvicorn processes (``redis_app:app``).

Configured from the environment:

- ``IDEMPOTENCY_TEST_APP_REDIS_URL``: the store (``redis://`` or ``redis+cluster://``;
  a SQL URL gives a :class:`SQLStore`, for the tests that run on every shared store);
- ``IDEMPOTENCY_TEST_APP_BATCHING``: ``0`` builds the SQL store with ``batching=False``;
- ``IDEMPOTENCY_TEST_APP_LEASE``: lease in seconds (default 30);
- ``IDEMPOTENCY_TEST_APP_EFFECTS``: a file each handler execution appends one line to,
  ``<order> <refund id> <pid>``, with ``O_APPEND`` (atomic for one short write), so
  executions are counted across processes and whatever happens to Redis.

``POST /orders/{order}/refunds`` (guarded, key required; ``{"amount", "delay"}``),
``GET /refunds/count`` (the readiness path of ``uvicorn_process``) and ``GET /clock``
(this process's ``time.time()``: what its clock says, e.g. under libfaketime).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, Policy, SQLStore
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.stores.base import Store
from asgi_idempotency.stores.redis import RedisStore

APP = "tests.reliability.redis_app:app"


def effects(path: Path) -> list[tuple[str, str, int]]:
    """(order, refund id, pid) of every execution recorded in ``path``."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        order, refund_id, pid = line.split()
        out.append((order, refund_id, int(pid)))
    return out


def env_for(
    url: str, effects: Path, *, lease: float = 30.0, batching: bool = True
) -> dict[str, str]:
    return {
        "IDEMPOTENCY_TEST_APP_REDIS_URL": url,
        "IDEMPOTENCY_TEST_APP_EFFECTS": str(effects),
        "IDEMPOTENCY_TEST_APP_LEASE": str(lease),
        "IDEMPOTENCY_TEST_APP_BATCHING": "1" if batching else "0",
    }


def create_app(url: str, effects_path: Path, lease: float, batching: bool = True) -> Starlette:
    # The library's warnings and errors (store errors, take-overs) into uvicorn's log
    # file, where a failing test's reader finds them.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    store: Store
    if url.startswith("redis"):
        store = RedisStore(url, command_timeout=2)
    else:
        store = SQLStore(url, command_timeout=2, batching=None if batching else False)

    async def refund(request: Request) -> JSONResponse:
        data = orjson.loads(await request.body())
        if data.get("delay"):
            await asyncio.sleep(float(data["delay"]))
        refund_id = uuid.uuid4().hex
        line = f"{request.path_params['order']} {refund_id} {os.getpid()}\n".encode()
        fd = os.open(effects_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return JSONResponse({"refund_id": refund_id, "amount": data.get("amount")}, 201)

    async def count(request: Request) -> JSONResponse:
        return JSONResponse({"count": len(effects(effects_path))})

    async def clock(request: Request) -> JSONResponse:
        return JSONResponse({"time": time.time()})

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await store.close()

    policy = Policy(required=True, lease=timedelta(seconds=lease))
    return Starlette(
        routes=[
            Route("/orders/{order}/refunds", refund, methods=["POST"]),
            Route("/refunds/count", count, methods=["GET"]),
            Route("/clock", clock, methods=["GET"]),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                principal=ANONYMOUS,
                policies={"POST /orders/{order}/refunds": policy},
            )
        ],
        lifespan=lifespan,
    )


def _from_env() -> Starlette:
    return create_app(
        os.environ["IDEMPOTENCY_TEST_APP_REDIS_URL"],
        Path(os.environ["IDEMPOTENCY_TEST_APP_EFFECTS"]),
        float(os.environ.get("IDEMPOTENCY_TEST_APP_LEASE", "30")),
        os.environ.get("IDEMPOTENCY_TEST_APP_BATCHING", "1") != "0",
    )


def __getattr__(name: str) -> Starlette:
    # Built on first access (by uvicorn), not at import: importing needs no environment.
    if name == "app":
        value = _from_env()
        globals()["app"] = value
        return value
    raise AttributeError(name)

"""The app factory of the tests: a guarded app, a client for it, a real server for it.

- :func:`guarded`: a Starlette (or, ``fastapi=True``, FastAPI) app whose routes are
  guarded by :class:`IdempotencyMiddleware` with the store, principal and policies
  given (``principal`` defaults to ``ANONYMOUS``: a test of principals names its own).
  Middleware of the app's own goes ``outside`` the guard or ``inside`` it, in the
  order given, outermost first, as Starlette's ``middleware=`` list reads.
- :func:`client`: an ``httpx.AsyncClient`` over ``httpx.ASGITransport`` (in process,
  no lifespan: ``tests.helpers.lifespan.served`` runs an app's startup first).
- :func:`served`: the app by its import path in real uvicorn worker processes.
- :func:`tiny_app` (the ``tiny`` fixture): a guarded app with the routes most HTTP tests
  need, counting its handlers' runs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from asgi_idempotency import IdempotencyMiddleware, Policy
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.stores.base import Store

if TYPE_CHECKING:  # uvicorn, imported where a test serves an app
    from tests.helpers.serving import UvicornProcess

__all__ = [
    "Tiny",
    "TinyFactory",
    "client",
    "guarded",
    "served",
    "tiny_app",
]

Handler = Callable[[Request], Awaitable[Response]]


def guarded(
    store: Store,
    routes: Sequence[BaseRoute] | Handler,
    *,
    path: str = "/pay",
    methods: Sequence[str] = ("POST",),
    principal: Any = ANONYMOUS,
    policies: Mapping[str, Policy] | None = None,
    outside: Sequence[Middleware] = (),
    inside: Sequence[Middleware] = (),
    fastapi: bool = False,
    **guard: Any,
) -> Starlette:
    """A guarded app: ``routes``, or one ``handler`` served at ``path`` for ``methods``.

    The other keywords go to :class:`IdempotencyMiddleware` (``default_policy``,
    ``clock``, ``metrics``, ``mode`` ...). With ``fastapi=True`` the app is a FastAPI
    app (its routes given as FastAPI routes, or added to it afterwards).
    """
    if callable(routes):
        routes = [Route(path, routes, methods=list(methods))]
    middleware = [
        *outside,
        Middleware(
            IdempotencyMiddleware, store=store, principal=principal, policies=policies, **guard
        ),
        *inside,
    ]
    if fastapi:
        from fastapi import FastAPI

        return FastAPI(routes=list(routes), middleware=middleware)
    return Starlette(routes=list(routes), middleware=middleware)


def client(app: Any, *, base_url: str = "http://test", **kwargs: Any) -> httpx.AsyncClient:
    """An in-process client of ``app`` (``httpx.ASGITransport``): real ASGI, no sockets."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url, **kwargs)


@contextmanager
def served(
    app: str, *, env: Mapping[str, str], log_dir: Path, workers: int = 1
) -> Iterator[UvicornProcess]:
    """``app`` ("module:attribute") served by ``workers`` real uvicorn processes."""
    from tests.helpers.serving import run_uvicorn

    with run_uvicorn(app, env=dict(env), log_dir=log_dir, workers=workers) as server:
        yield server


@dataclass
class Tiny:
    """A tiny guarded Starlette app that counts how often its handlers ran."""

    app: Starlette
    calls: dict[str, int]
    gate: asyncio.Event
    entered: asyncio.Event  # set once a request that waits on ``gate`` is in its handler

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return client(self.app, **kwargs)


class TinyFactory(Protocol):
    """What the ``tiny`` fixture returns; the keywords go to :class:`IdempotencyMiddleware`."""

    def __call__(self, store: Store, **kwargs: Any) -> Tiny: ...


def tiny_app(store: Store, **kwargs: Any) -> Tiny:
    """``tiny_app(store, **middleware_kwargs)`` → :class:`Tiny`.

    Routes: ``POST /pay`` (201 with a fresh id; sets ``entered`` and waits on ``gate``
    when the body has ``"wait": true``), ``POST /fail/{status}`` (answers that status),
    ``POST /boom`` (raises), ``GET /pay``, ``POST /cookie`` (sets a cookie).
    """
    calls: dict[str, int] = {}
    gate, entered = asyncio.Event(), asyncio.Event()

    def count(name: str) -> None:
        calls[name] = calls.get(name, 0) + 1

    async def pay(request: Request) -> Response:
        count("pay")
        body = await request.body()
        data = await request.json() if body else {}
        if data.get("wait"):
            entered.set()
            await gate.wait()
        return JSONResponse({"id": uuid.uuid4().hex, "echo": data}, status_code=201)

    async def fail(request: Request) -> Response:
        count("fail")
        return JSONResponse({"n": calls["fail"]}, status_code=int(request.path_params["status"]))

    async def boom(request: Request) -> Response:
        count("boom")
        raise RuntimeError("handler failed")

    async def get_pay(request: Request) -> Response:
        count("get")
        return JSONResponse({"ok": True})

    async def cookie(request: Request) -> Response:
        count("cookie")
        response = JSONResponse({"n": calls["cookie"]})
        response.set_cookie("session", "secret-session")
        return response

    routes = [
        Route("/pay", pay, methods=["POST"]),
        Route("/pay", get_pay, methods=["GET"]),
        Route("/fail/{status:int}", fail, methods=["POST"]),
        Route("/boom", boom, methods=["POST"]),
        Route("/cookie", cookie, methods=["POST"]),
    ]
    app = guarded(store, routes, **{"principal": ANONYMOUS, **kwargs})
    return Tiny(app, calls, gate, entered)

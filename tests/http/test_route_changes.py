"""Routing decisions follow the routes as they are now, not only how many there are.

The guard resolves each path through the app's router once and keeps the answer. A
route swapped in after startup, at a path that answered 405 before and with the
number of routes unchanged, used to keep the cached "nothing to guard": the same key
ran the new handler twice (issue 41).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, Router

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from asgi_idempotency.http.policy import RouteResolver
from asgi_idempotency.http.principals import ANONYMOUS

pytestmark = pytest.mark.anyio

KEY = {"Idempotency-Key": "refund-A-88214"}
BODY = {"order": "A-88214", "amount_p": 4500}


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


class Refunds:
    """The handlers: a list that answers GET, and the create that is swapped in later."""

    def __init__(self) -> None:
        self.created = 0

    async def list(self, request: Request) -> Response:
        return JSONResponse([])

    async def create(self, request: Request) -> Response:
        self.created += 1
        return JSONResponse({"refund": self.created}, status_code=201)


def guarded(routes: list[Any]) -> Starlette:
    return Starlette(
        routes=routes,
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS)],
    )


async def twice(c: httpx.AsyncClient, path: str) -> tuple[httpx.Response, httpx.Response]:
    first = await c.post(path, json=BODY, headers=KEY)
    second = await c.post(path, json=BODY, headers=KEY)
    return first, second


def assert_ran_once(refunds: Refunds, first: httpx.Response, second: httpx.Response) -> None:
    assert first.status_code == 201, first.text
    assert second.status_code == 201
    assert second.headers.get("idempotent-replayed") == "true", "the handler ran again"
    assert refunds.created == 1


async def test_a_route_swapped_in_where_a_path_answered_405_is_guarded() -> None:
    refunds = Refunds()
    app = guarded([Route("/refunds", refunds.list, methods=["GET"])])
    async with client(app) as c:
        assert (await c.post("/refunds", json=BODY, headers=KEY)).status_code == 405
        # Swapped in place: the router's list keeps its object and its length.
        app.router.routes[0] = Route("/refunds", refunds.create, methods=["GET", "POST"])
        first, second = await twice(c, "/refunds")
    assert_ran_once(refunds, first, second)


async def test_a_route_list_replaced_by_one_of_the_same_length_is_seen() -> None:
    refunds = Refunds()
    app = guarded([Route("/refunds", refunds.list, methods=["GET"])])
    async with client(app) as c:
        assert (await c.post("/refunds", json=BODY, headers=KEY)).status_code == 405
        app.router.routes = [Route("/refunds", refunds.create, methods=["POST"])]
        first, second = await twice(c, "/refunds")
    assert_ran_once(refunds, first, second)


async def test_a_route_swapped_in_inside_a_mount_is_guarded() -> None:
    refunds = Refunds()
    app = guarded([Mount("/api", routes=[Route("/refunds", refunds.list, methods=["GET"])])])
    async with client(app) as c:
        assert (await c.post("/api/refunds", json=BODY, headers=KEY)).status_code == 405
        mount = app.router.routes[0]
        assert isinstance(mount, Mount)
        mount.routes[0] = Route("/refunds", refunds.create, methods=["POST"])
        first, second = await twice(c, "/api/refunds")
    assert_ran_once(refunds, first, second)


async def test_a_policy_swapped_in_with_its_route_takes_effect() -> None:
    """A guarded route replaced by an exempt one (and back): the decision follows."""
    refunds = Refunds()

    @idempotent(enabled=False)
    async def exempt(request: Request) -> Response:
        return await refunds.create(request)

    app = guarded([Route("/refunds", refunds.create, methods=["POST"])])
    async with client(app) as c:
        await twice(c, "/refunds")
        assert refunds.created == 1
        app.router.routes[0] = Route("/refunds", exempt, methods=["POST"])
        await twice(c, "/refunds")
        assert refunds.created == 3  # exempt: each ran
        app.router.routes[0] = Route("/refunds", refunds.create, methods=["POST"])
        _, replayed = await twice(c, "/refunds")
    assert replayed.headers.get("idempotent-replayed") == "true"
    assert refunds.created == 3


async def test_a_route_added_to_an_included_fastapi_router_is_guarded() -> None:
    """FastAPI keeps an included router nested (the app's own list holds one entry for
    it): a route added to that router later leaves the app's list as it was."""
    created: list[int] = []
    router = APIRouter()

    @router.get("/refunds")
    async def list_refunds() -> list[int]:
        return created

    app = FastAPI()
    app.include_router(router, prefix="/v1")
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS)
    async with client(app) as c:
        assert (await c.post("/v1/refunds", json=BODY, headers=KEY)).status_code == 405

        async def create_refund() -> dict[str, int]:
            created.append(1)
            return {"refund": len(created)}

        router.add_api_route("/refunds", create_refund, methods=["POST"], status_code=201)
        first = await c.post("/v1/refunds", json=BODY, headers=KEY)
        second = await c.post("/v1/refunds", json=BODY, headers=KEY)
    assert first.status_code == second.status_code == 201, first.text
    assert second.headers.get("idempotent-replayed") == "true"
    assert created == [1]


def test_a_repeated_path_is_answered_from_the_cache() -> None:
    """The change detector does not defeat the cache: an unchanged app is walked once per
    path, and a change is walked again once."""
    decided: list[str] = []

    def decide(scope: Any, resolved: Any, routed: bool) -> str:
        decided.append(scope["path"])
        return "guard"

    async def endpoint(request: Request) -> Response:
        return Response()

    async def other(request: Request) -> Response:
        return Response()

    router = Router([Route(f"/r{i}", endpoint, methods=["POST"]) for i in range(50)])
    inner = Router([Route("/x", endpoint, methods=["POST"])])
    router.routes.append(Mount("/m", app=inner))
    app = type("App", (), {"router": router})()
    resolve = RouteResolver(decide)

    def ask(*paths: str) -> None:
        for path in paths:
            resolve({"type": "http", "method": "POST", "path": path, "app": app})

    ask("/r7", "/m/x", "/r7", "/m/x", "/r7")
    assert decided == ["/r7", "/m/x"]
    inner.routes[0] = Route("/x", other, methods=["POST"])  # another endpoint: walked again
    ask("/m/x", "/m/x", "/r7")
    assert decided == ["/r7", "/m/x", "/m/x"]
    # A route equal to the one it replaces (Starlette: same path, endpoint and methods)
    # would decide the same: the cached answer stands.
    inner.routes[0] = Route("/x", other, methods=["POST"])
    ask("/m/x")
    assert decided == ["/r7", "/m/x", "/m/x"]

"""A guarded request's cached route decision, timed: ``python -m bench.route_cache``.

Every guarded (non-safe) request asks :class:`~asgi_idempotency.http.policy.RouteResolver`
for its path's decision; after the first request to a path the answer comes from a dict,
checked against the route lists it was read from. This times that check, per call, on a
Starlette app and on a FastAPI app with included routers, of growing size; run it
before and after a change to the resolver and compare.
"""

from __future__ import annotations

import timeit
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from asgi_idempotency.http.policy import RouteResolver


async def _endpoint(request: Request) -> Response:
    return Response()


def starlette_app(n: int) -> Starlette:
    """``n`` routes, the last of them the one requested, behind a Mount."""
    routes: list[Any] = [Route(f"/r{i}", _endpoint, methods=["POST"]) for i in range(n - 1)]
    routes.append(Mount("/api", routes=[Route("/refunds", _endpoint, methods=["POST"])]))
    return Starlette(routes=routes)


def fastapi_app(n: int) -> FastAPI:
    """``n`` routes over three included routers; the request goes to the last one."""
    app = FastAPI()
    for r in range(3):
        router = APIRouter()
        for i in range(n // 3):
            router.add_api_route(f"/r{i}", _endpoint, methods=["POST"])
        app.include_router(router, prefix=f"/v{r}")
    return app


def per_call_ns(app: Any, path: str, number: int = 200_000) -> float:
    """Nanoseconds per cached decision (the best of five runs)."""
    resolve = RouteResolver(lambda scope, resolved, routed: resolved)
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "app": app}
    assert resolve(scope) is not None, path
    best = min(timeit.repeat(lambda: resolve(scope), number=number, repeat=5))
    return best / number * 1e9


def main() -> None:
    print(f"{'app':<10} {'routes':>6} {'ns/decision':>12}")
    for n in (10, 100, 500):
        print(f"{'starlette':<10} {n:>6} {per_call_ns(starlette_app(n), '/api/refunds'):>12.0f}")
    for n in (12, 99, 501):
        path = f"/v2/r{n // 3 - 1}"
        print(f"{'fastapi':<10} {n:>6} {per_call_ns(fastapi_app(n), path):>12.0f}")


if __name__ == "__main__":
    main()

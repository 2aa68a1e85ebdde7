"""Policies resolved through the app's own router: routes, mounts, FastAPI's nested routers."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy, idempotent
from asgi_idempotency.http.policy import policy_of
from asgi_idempotency.http.principals import ANONYMOUS
from tests.apps import guarded

pytestmark = pytest.mark.anyio


def client(app: ASGIApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def fastapi_app(calls: list[str]) -> FastAPI:
    inner = APIRouter(prefix="/orders/{order_id}")

    @inner.post("/refunds", status_code=201)
    @idempotent(required=True, ttl=timedelta(hours=1))
    async def refund(order_id: int) -> dict[str, object]:
        calls.append(f"refund {order_id}")
        return {"order": order_id, "n": len(calls)}

    @inner.post("/notes")
    async def note(order_id: int) -> dict[str, int]:
        calls.append("note")
        return {"n": len(calls)}

    @inner.put("/tag")
    async def tag(order_id: int) -> dict[str, int]:
        calls.append("tag")
        return {"n": len(calls)}

    outer = APIRouter(prefix="/v1")
    outer.include_router(inner)
    app = FastAPI()
    app.include_router(outer)

    @app.post("/exempt")
    @idempotent(enabled=False)
    async def exempt() -> dict[str, int]:
        calls.append("exempt")
        return {"n": len(calls)}

    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        principal=ANONYMOUS,
        policies={"PUT /v1/orders/{order_id}/tag": Policy(required=True)},
    )
    return app


async def test_decorator_on_a_nested_included_router_is_found() -> None:
    calls: list[str] = []
    async with client(fastapi_app(calls)) as c:
        missing = await c.post("/v1/orders/7/refunds")
        first = await c.post("/v1/orders/7/refunds", headers={"Idempotency-Key": "k"})
        again = await c.post("/v1/orders/7/refunds", headers={"Idempotency-Key": "k"})
        other_order = await c.post("/v1/orders/8/refunds", headers={"Idempotency-Key": "k"})
    assert missing.status_code == 400
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    # Same key, different concrete path: a different request.
    assert other_order.status_code == 422
    assert calls == ["refund 7"]


async def test_policies_by_template_reach_nested_routes() -> None:
    calls: list[str] = []
    async with client(fastapi_app(calls)) as c:
        assert (await c.put("/v1/orders/1/tag")).status_code == 400
        await c.put("/v1/orders/1/tag", headers={"Idempotency-Key": "t"})
        await c.put("/v1/orders/1/tag", headers={"Idempotency-Key": "t"})
    assert calls == ["tag"]


async def test_default_guards_post_with_a_key_and_exemptions_hold() -> None:
    calls: list[str] = []
    async with client(fastapi_app(calls)) as c:
        for _ in range(2):
            await c.post("/v1/orders/1/notes", headers={"Idempotency-Key": "n"})
            await c.post("/exempt", headers={"Idempotency-Key": "e"})
        await c.post("/v1/orders/1/notes")  # no key: optional by default, runs unguarded
    assert calls == ["note", "exempt", "exempt", "note"]


async def test_unmatched_routes_pass_through_to_the_router() -> None:
    calls: list[str] = []
    store = MemoryStore()
    app = fastapi_app(calls)
    app.user_middleware.clear()
    app.add_middleware(IdempotencyMiddleware, store=store, principal=ANONYMOUS)
    async with client(app) as c:
        r = await c.post("/nope", headers={"Idempotency-Key": "x"})
        wrong_method = await c.patch("/v1/orders/1/refunds", headers={"Idempotency-Key": "x"})
    assert r.status_code == 404
    assert wrong_method.status_code == 405
    assert await store.prune(now=datetime.max.replace(tzinfo=UTC)) == 0  # nothing was stored


async def test_a_bare_asgi_app_is_guarded_by_path() -> None:
    calls: list[str] = []

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["path"])
        await JSONResponse({"n": len(calls)})(scope, receive, send)

    app = IdempotencyMiddleware(
        bare, store=MemoryStore(), principal=ANONYMOUS, policies={"/pay": Policy(required=True)}
    )
    async with client(app) as c:
        assert (await c.post("/pay")).status_code == 400
        await c.post("/pay", headers={"Idempotency-Key": "b"})
        again = await c.post("/pay", headers={"Idempotency-Key": "b"})
        reused = await c.post("/other", headers={"Idempotency-Key": "b"})
        other = await c.post("/other", headers={"Idempotency-Key": "c"})
    assert again.headers["idempotent-replayed"] == "true"
    assert reused.status_code == 422
    assert other.status_code == 200
    assert calls == ["/pay", "/other"]


async def test_starlette_mounts_resolve_with_their_prefix() -> None:
    calls: list[str] = []

    @idempotent(required=True)
    async def pay(request: Request) -> JSONResponse:
        calls.append(request.path_params["acct"])
        return JSONResponse({"n": len(calls)}, status_code=201)

    api = Starlette(routes=[Route("/accounts/{acct}/pay", pay, methods=["POST"])])
    app = guarded(MemoryStore(), [Mount("/api", routes=[Mount("/v2", app=api)])])
    async with client(app) as c:
        assert (await c.post("/api/v2/accounts/a/pay")).status_code == 400
        first = await c.post("/api/v2/accounts/a/pay", headers={"Idempotency-Key": "m"})
        again = await c.post("/api/v2/accounts/a/pay", headers={"Idempotency-Key": "m"})
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert calls == ["a"]


def test_a_ttl_alone_gets_the_smaller_of_30_s_and_the_ttl_as_lease() -> None:
    short = Policy(ttl=timedelta(seconds=1))
    assert short.lease == timedelta(seconds=1)
    assert short.renew_every == pytest.approx(1 / 3)
    assert Policy(ttl=timedelta(minutes=10)).lease == timedelta(seconds=30)
    assert Policy().lease == timedelta(seconds=30)
    assert Policy().renew_every == pytest.approx(10.0)

    @idempotent(ttl=timedelta(seconds=1))
    async def handler() -> None: ...

    assert policy_of(handler) == short


def test_replace_derives_a_default_lease_again_and_keeps_an_explicit_one() -> None:
    short = dataclasses.replace(Policy(), ttl=timedelta(seconds=1))
    assert short.lease == timedelta(seconds=1)
    assert dataclasses.replace(short, ttl=timedelta(hours=1)).lease == timedelta(seconds=30)
    assert repr(short).count("lease=datetime.timedelta(seconds=1)") == 1
    explicit = Policy(ttl=timedelta(hours=1), lease=timedelta(seconds=20))
    assert dataclasses.replace(explicit, ttl=timedelta(hours=2)).lease == timedelta(seconds=20)
    with pytest.raises(ValueError, match="exceeds ttl"):
        dataclasses.replace(explicit, ttl=timedelta(seconds=10))


def test_an_explicit_lease_may_equal_the_ttl() -> None:
    policy = Policy(ttl=timedelta(seconds=5), lease=timedelta(seconds=5))
    assert policy.lease == timedelta(seconds=5)


LONG_LEASE = re.escape("lease (0:00:30) exceeds ttl (0:00:01): pass lease <= ttl, or a longer ttl")


def test_an_explicit_lease_longer_than_the_ttl_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=f"^{LONG_LEASE}$"):
        Policy(ttl=timedelta(seconds=1), lease=timedelta(seconds=30))
    with pytest.raises(ValueError, match=f"^{LONG_LEASE}$"):
        idempotent(ttl=timedelta(seconds=1), lease=timedelta(seconds=30))


@pytest.mark.parametrize("name", ["ttl", "lease"])
@pytest.mark.parametrize("value", [30, 1.5, 0, True, None, "30s"])
def test_durations_must_be_timedeltas(name: str, value: object) -> None:
    """A bare number could mean seconds or milliseconds: refused, never guessed."""
    expected = "^" + re.escape(f"{name} must be a datetime.timedelta, e.g. timedelta(seconds=30)")
    with pytest.raises(TypeError, match=expected) as caught:
        Policy(**{name: value})  # type: ignore[arg-type]  # deliberately the wrong type
    number = isinstance(value, int | float) and not isinstance(value, bool)
    assert ("seconds or milliseconds" in str(caught.value)) is number
    with pytest.raises(TypeError, match=expected):
        idempotent(**{name: value})  # type: ignore[arg-type]  # the wrong type, again


@pytest.mark.parametrize("name", ["ttl", "lease"])
@pytest.mark.parametrize("value", [timedelta(0), timedelta(seconds=-1)])
def test_non_positive_durations_are_refused_by_name(name: str, value: timedelta) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be positive, got "):
        Policy(**{name: value})  # type: ignore[arg-type]  # one field by name; mypy sees all


async def test_routes_added_after_the_first_request_are_resolved() -> None:
    # The policy is the endpoint's: a policies-map entry naming a route the app does not
    # serve yet is refused at the first request (test_startup_refusals.py).
    calls: list[str] = []

    @idempotent(required=True)
    async def late(request: Request) -> JSONResponse:
        calls.append("late")
        return JSONResponse({}, status_code=201)

    async def early(request: Request) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    app = guarded(MemoryStore(), [Route("/early", early, methods=["POST"])])
    async with client(app) as c:
        assert (await c.post("/late")).status_code == 404
        app.router.routes.append(Route("/late", late, methods=["POST"]))
        assert (await c.post("/late")).status_code == 400  # now resolved, and required


async def test_host_routes_resolve_by_host_every_time() -> None:
    from starlette.routing import Host, Router

    calls: list[str] = []

    def endpoint(name: str) -> Callable[[Request], Awaitable[JSONResponse]]:
        @idempotent(required=name == "strict")
        async def handle(request: Request) -> JSONResponse:
            calls.append(name)
            return JSONResponse({}, status_code=201)

        return handle

    app = guarded(
        MemoryStore(),
        [
            Host(
                "strict.example", app=Router([Route("/pay", endpoint("strict"), methods=["POST"])])
            ),
            Host("lax.example", app=Router([Route("/pay", endpoint("lax"), methods=["POST"])])),
        ],
    )
    async with client(app) as c:
        lax = await c.post("http://lax.example/pay")
        strict = await c.post("http://strict.example/pay")
        lax_again = await c.post("http://lax.example/pay")
    assert (lax.status_code, strict.status_code, lax_again.status_code) == (201, 400, 201)
    assert calls == ["lax", "lax"]


async def test_routes_added_inside_a_mount_after_the_first_request_are_resolved() -> None:
    # The top-level route list keeps its length here; the Mount's list is what grows.
    @idempotent(required=True)
    async def late(request: Request) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    async def early(request: Request) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    app = guarded(MemoryStore(), [Mount("/api", routes=[Route("/early", early, methods=["POST"])])])
    async with client(app) as c:
        assert (await c.post("/api/late")).status_code == 404
        mount = app.router.routes[0]
        assert isinstance(mount, Mount)
        mount.routes.append(Route("/late", late, methods=["POST"]))
        assert (await c.post("/api/late")).status_code == 400  # now resolved, and required


def _bare_ok() -> Callable[[Any, Any, Any], Awaitable[None]]:
    async def ok(scope: Any, receive: Any, send: Any) -> None:
        await JSONResponse({}, status_code=201)(scope, receive, send)

    return ok


async def test_settings_assigned_after_the_first_request_take_effect() -> None:
    guard = IdempotencyMiddleware(_bare_ok(), store=MemoryStore(), principal=ANONYMOUS)
    async with client(guard) as c:
        assert (await c.post("/pay")).status_code == 201  # default policy: key optional
        guard.policies = {"/pay": Policy(required=True)}
        assert (await c.post("/pay")).status_code == 400
        guard.policies = {}
        guard.default_policy = Policy(required=True)
        assert (await c.post("/pay")).status_code == 400
        guard.methods = frozenset({"PATCH"})
        assert (await c.post("/pay")).status_code == 201  # POST is no longer guarded
    with pytest.raises(TypeError):
        guard.policies["/pay"] = Policy()  # read-only: assign anew


async def test_one_middleware_resolves_each_router_it_is_given_on_its_own() -> None:
    # The same middleware object in front of two apps (scope["app"] differs): a path's
    # cached answer for one router is not the other's.
    @idempotent(required=True)
    async def strict(request: Request) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    async def lax(request: Request) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    guard = IdempotencyMiddleware(_bare_ok(), store=MemoryStore(), principal=ANONYMOUS)
    apps = {
        name: Starlette(routes=[Route("/pay", endpoint, methods=["POST"])])
        for name, endpoint in (("strict", strict), ("lax", lax))
    }

    async def front(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope["app"] = apps[dict(scope["headers"])[b"x-app"].decode()]
        await guard(scope, receive, send)

    async with client(front) as c:
        for _ in range(2):
            strict_status = (await c.post("/pay", headers={"x-app": "strict"})).status_code
            lax_status = (await c.post("/pay", headers={"x-app": "lax"})).status_code
            assert (strict_status, lax_status) == (400, 201)


@pytest.mark.parametrize(
    ("pointer", "reason"),
    [
        ("timestamp", "must start with '/'"),
        ("", "must start with '/'"),  # the whole document: every body would be one request
        ("/a~2b", "'~' must be followed by 0"),
        ("/a~", "'~' must be followed by 0"),
    ],
)
def test_fingerprint_exclude_refuses_what_is_not_a_json_pointer(pointer: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        Policy(fingerprint_exclude=("/ok", pointer))
    with pytest.raises(ValueError, match=re.escape(reason)):
        idempotent(fingerprint_exclude=[pointer])


def test_fingerprint_exclude_refuses_a_lone_string_and_keeps_a_tuple() -> None:
    with pytest.raises(TypeError, match=re.escape("('/timestamp',)")):
        Policy(fingerprint_exclude="/timestamp")  # type: ignore[arg-type]  # a str, not a tuple
    listed = Policy(fingerprint_exclude=["/timestamp", "/a~1b/0"])  # type: ignore[arg-type]
    assert listed.fingerprint_exclude == ("/timestamp", "/a~1b/0")
    assert listed == Policy(fingerprint_exclude=("/timestamp", "/a~1b/0"))

    @idempotent(fingerprint_exclude=iter(["/timestamp"]))
    async def endpoint() -> None: ...

    found = policy_of(endpoint)
    assert found is not None
    assert found.fingerprint_exclude == ("/timestamp",)

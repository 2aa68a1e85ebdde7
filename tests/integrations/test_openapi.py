"""The guard's contract in a FastAPI app's OpenAPI schema: documented as enforced."""

from __future__ import annotations

import copy
import importlib
import importlib.util
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Header
from fastapi.openapi.models import OpenAPI
from fastapi.responses import StreamingResponse
from fastapi.routing import iter_route_contexts
from starlette.applications import Starlette
from starlette.types import ASGIApp

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy, idempotent
from asgi_idempotency.http.middleware import SAFE_METHODS
from asgi_idempotency.http.policy import ResolvedRoute, lookup, policy_of
from asgi_idempotency.http.principals import ANONYMOUS, from_headers
from asgi_idempotency.http.responder import STREAM_KEEP_LIMIT
from asgi_idempotency.integrations.openapi import (
    _SAFE_METHODS,
    PROBLEM_SCHEMA_NAME,
    apply_to_schema,
    guard_of_for,
    install_openapi,
)

pytestmark = pytest.mark.anyio

PROBLEM = "application/problem+json"
URN = "urn:asgi-idempotency:problem:"
REFUNDS = "/v1/orders/{order_id}/refunds"
NOTES = "/v1/orders/{order_id}/notes"
NOTE = "/v1/orders/{order_id}/notes/{note_id}"
CANCEL = "/v1/orders/{order_id}/cancel"
COMMENTS = "/v1/orders/{order_id}/comments"
TAG = "/v1/orders/{order_id}/tag"
ORDER = "/v1/orders/{order_id}"

# The middleware's settings, given once to the app's middleware and once to the
# instance whose answers document the schema.
POLICIES = {
    f"POST {CANCEL}": Policy(required=True),  # by method and template
    COMMENTS: Policy(enabled=False),  # a bare template: every method, exempt
}


def shop() -> FastAPI:
    """Guarded every way the middleware knows, under two included routers."""
    orders = APIRouter(prefix="/orders/{order_id}")

    @orders.post("/refunds", status_code=201)
    @idempotent(required=True, max_body_bytes=2048)
    async def refund(order_id: int) -> dict[str, int]:
        return {"order": order_id}

    @orders.post("/notes")  # the default policy: key optional
    async def note(order_id: int) -> dict[str, int]:
        return {"order": order_id}

    @orders.patch("/notes/{note_id}")  # PATCH is guarded by default too
    async def edit_note(order_id: int, note_id: int) -> dict[str, int]:
        return {"note": note_id}

    @orders.post("/cancel")
    async def cancel(order_id: int) -> dict[str, int]:
        return {"order": order_id}

    @orders.post("/comments")
    async def comment(order_id: int) -> dict[str, int]:
        return {"order": order_id}

    @orders.put("/tag")  # PUT is not in the middleware's default methods
    async def tag(order_id: int) -> dict[str, int]:
        return {"order": order_id}

    @orders.get("")
    async def order(order_id: int) -> dict[str, int]:
        return {"order": order_id}

    v1 = APIRouter(prefix="/v1")
    v1.include_router(orders)
    app = FastAPI()
    app.include_router(v1)

    @app.post("/exempt")
    @idempotent(enabled=False)
    async def exempt() -> dict[str, str]:
        return {"ok": "yes"}

    @app.post(
        "/transfers",
        responses={
            409: {
                "description": "Transfer already settled",
                "content": {"application/json": {"schema": {"type": "object"}}},
            }
        },
    )
    @idempotent(required=True)
    async def transfer() -> dict[str, str]:
        return {"ok": "yes"}

    @app.post("/files/{name:path}")  # a convertor: the schema and the policies say {name}
    @idempotent(required=True)
    async def upload(name: str) -> dict[str, str]:
        return {"name": name}

    @app.post("/payments")
    async def pay(idempotency_key: Annotated[str, Header()]) -> dict[str, str]:
        return {"key": idempotency_key}

    return app


def guarded(app: FastAPI) -> FastAPI:
    """``app`` behind the middleware, its schema documented with the middleware's answers."""
    store = MemoryStore()
    app.add_middleware(IdempotencyMiddleware, store=store, principal=ANONYMOUS, policies=POLICIES)
    answers = IdempotencyMiddleware(app, store=store, principal=ANONYMOUS, policies=POLICIES)
    assert install_openapi(app, guard_of_for(answers, app))
    return app


def client(app: ASGIApp, root_path: str = "") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, root_path=root_path)
    return httpx.AsyncClient(transport=transport, base_url="http://t")


async def served_schema(app: FastAPI, root_path: str = "") -> dict[str, Any]:
    async with client(app, root_path) as c:
        r = await c.get(f"{root_path}/openapi.json")
    assert r.status_code == 200
    schema: dict[str, Any] = r.json()
    return schema


def key_parameters(operation: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        p
        for p in operation.get("parameters", [])
        if p["in"] == "header" and p["name"].lower() == "idempotency-key"
    ]


def key_parameter(operation: dict[str, Any]) -> dict[str, Any] | None:
    found = key_parameters(operation)
    assert len(found) <= 1, found
    return found[0] if found else None


def problem_types(response: dict[str, Any]) -> list[str]:
    examples = response["content"][PROBLEM]["examples"]
    return [e["value"]["type"] for e in examples.values()]


async def test_required_optional_and_unguarded_operations() -> None:
    paths = (await served_schema(guarded(shop())))["paths"]
    for template, method, required in [
        (REFUNDS, "post", True),  # @idempotent(required=True), under two prefixes
        (CANCEL, "post", True),  # the policies map, "METHOD /template"
        (NOTES, "post", False),  # the default policy: key optional
        (NOTE, "patch", False),
        ("/files/{name}", "post", True),
    ]:
        parameter = key_parameter(paths[template][method])
        assert parameter is not None, (method, template)
        assert parameter["required"] is required, (method, template)
        assert parameter["schema"] == {"type": "string", "minLength": 1, "maxLength": 255}
        assert "same key on every retry" in parameter["description"]
    for template, method in [
        (ORDER, "get"),  # safe methods are never guarded
        (TAG, "put"),  # not in the middleware's methods
        (COMMENTS, "post"),  # Policy(enabled=False) in the map
        ("/exempt", "post"),  # @idempotent(enabled=False)
    ]:
        operation = paths[template][method]
        assert key_parameter(operation) is None, (method, template)
        assert not {"400", "401", "409", "410", "413", "503"} & set(operation["responses"]), (
            method,
            template,
        )
        assert all(PROBLEM not in r.get("content", {}) for r in operation["responses"].values())


async def test_problem_responses_and_headers() -> None:
    schema = await served_schema(guarded(shop()))
    refunds = schema["paths"][REFUNDS]["post"]["responses"]
    assert problem_types(refunds["400"]) == [URN + "missing-key", URN + "invalid-key"]
    assert problem_types(refunds["409"]) == [URN + "in-progress"]
    assert problem_types(refunds["413"]) == [URN + "body-too-large"]
    assert problem_types(refunds["422"]) == [URN + "key-reused"]
    assert problem_types(refunds["503"]) == [URN + "store-unavailable"]
    assert problem_types(refunds["410"]) == [URN + "response-not-kept"]
    assert "401" not in refunds  # the default principal never answers 401 (see below)
    assert "2048 bytes" in refunds["413"]["description"]  # the policy's own limit
    for status in ("400", "409", "413", "422", "503"):
        media = refunds[status]["content"][PROBLEM]
        assert media["schema"] == {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA_NAME}"}
    assert set(refunds["409"]["headers"]) == {"Retry-After"}
    assert set(refunds["503"]["headers"]) == {"Retry-After"}
    assert "headers" not in refunds["400"]
    assert set(refunds["201"]["headers"]) == {"Idempotent-Replayed"}
    # FastAPI's own 422 (path parameter validation) keeps its description and content.
    assert refunds["422"]["description"] == "Validation Error"
    assert set(refunds["422"]["content"]) == {"application/json", PROBLEM}
    # A missing key on an optional-key route runs the handler: no missing-key example.
    notes = schema["paths"][NOTES]["post"]["responses"]
    assert problem_types(notes["400"]) == [URN + "invalid-key"]
    assert set(notes["200"]["headers"]) == {"Idempotent-Replayed"}
    problem = schema["components"]["schemas"][PROBLEM_SCHEMA_NAME]
    assert set(problem["properties"]) == {"type", "title", "status", "detail"}
    assert set(problem["required"]) == {"type", "title", "status", "detail"}
    assert "HTTPValidationError" in schema["components"]["schemas"]  # FastAPI's kept


async def test_the_apps_own_response_and_parameter_are_kept() -> None:
    paths = (await served_schema(guarded(shop())))["paths"]
    conflict = paths["/transfers"]["post"]["responses"]["409"]
    assert conflict["description"] == "Transfer already settled"
    assert conflict["content"]["application/json"] == {"schema": {"type": "object"}}
    assert problem_types(conflict) == [URN + "in-progress"]
    assert set(conflict["headers"]) == {"Retry-After"}
    # /payments declares the header itself (required): default-guarded, not re-added.
    payments = paths["/payments"]["post"]
    assert len(key_parameters(payments)) == 1
    assert key_parameters(payments)[0]["required"] is True
    assert "409" in payments["responses"]


async def test_included_router_under_a_root_path() -> None:
    # Behind a proxy at /api: the schema's paths keep the include prefixes and leave
    # the root path to "servers", as the router's templates (and so the policies) do.
    app = guarded(shop())
    schema = await served_schema(app, root_path="/api")
    assert schema["servers"] == [{"url": "/api"}]
    assert key_parameter(schema["paths"][REFUNDS]["post"]) is not None
    assert not any(p.startswith("/api") for p in schema["paths"])
    async with client(app, root_path="/api") as c:
        r = await c.post("/api/v1/orders/7/refunds")
    assert (r.status_code, r.json()["type"]) == (400, URN + "missing-key")


async def test_what_is_documented_is_what_the_middleware_enforces() -> None:
    app = guarded(shop())
    paths = (await served_schema(app))["paths"]
    concrete = {"{order_id}": "7", "{note_id}": "3", "{name}": "a/b.txt"}
    checked = 0
    async with client(app) as c:
        for template, item in paths.items():
            if template == "/payments":
                continue  # its handler requires the header itself
            url = template
            for name, value in concrete.items():
                url = url.replace(name, value)
            for method, operation in item.items():
                parameter = key_parameter(operation)
                # An empty key is refused by the guard, and ignored where nothing guards.
                empty = await c.request(method, url, headers={"Idempotency-Key": ""})
                assert (empty.status_code == 400) is (parameter is not None), (method, template)
                none = await c.request(method, url)
                required = parameter is not None and parameter["required"]
                assert (none.status_code == 400) is required, (method, template)
                if parameter is not None:
                    # A key per operation: the same key on another route is a 422.
                    key = {"Idempotency-Key": f"{method}-{url}"}
                    sent = [await c.request(method, url, headers=key)]
                    sent.append(await c.request(method, url, headers=key))
                    assert "idempotent-replayed" not in sent[0].headers
                    assert sent[1].headers["idempotent-replayed"] == "true"
                    assert str(sent[1].status_code) in operation["responses"]
                checked += 1
    assert checked >= 10


async def test_openapi_twice_and_install_twice() -> None:
    app = guarded(shop())
    first = copy.deepcopy(app.openapi())
    assert app.openapi() == first
    # Installing again re-wraps FastAPI's own openapi, not our wrapper: a fresh schema
    # is completed once per call, so guard_of is asked once per operation.
    asked: list[tuple[str, str]] = []
    mw = IdempotencyMiddleware(app, store=MemoryStore(), principal=ANONYMOUS, policies=POLICIES)
    answer = guard_of_for(mw, app)

    def counting(method: str, template: str, /) -> Policy | None:
        asked.append((method, template))
        return answer(method, template)

    assert install_openapi(app, counting)
    assert install_openapi(app, counting)
    app.openapi_schema = None  # as FastAPI does when a route is added: build anew
    assert app.openapi() == first
    assert len(asked) == len(set(asked)) > 0
    assert app.openapi() == first
    assert len(asked) == len(set(asked))  # the cached schema is not completed again
    # Applying to an already documented schema changes nothing.
    assert apply_to_schema(copy.deepcopy(first), answer) == first
    async with client(app) as c:
        assert (await c.get("/openapi.json")).json() == first


async def test_a_route_added_after_the_first_schema_is_documented() -> None:
    app = guarded(shop())
    assert "/late" not in app.openapi()["paths"]

    @app.post("/late")
    @idempotent(required=True)
    async def late() -> dict[str, str]:
        return {"ok": "yes"}

    parameter = key_parameter((await served_schema(app))["paths"]["/late"]["post"])
    assert parameter is not None
    assert parameter["required"] is True


def by_hand(mw: IdempotencyMiddleware, app: FastAPI) -> Callable[[str, str], Policy | None]:
    """The middleware's decision written out with the public lookup and policy_of."""
    endpoints = {
        (method, str(route.path_format)): route.endpoint
        for route in iter_route_contexts(app.routes)
        for method in route.methods or ()
    }

    def guard_of(method: str, template: str, /) -> Policy | None:
        if method in SAFE_METHODS or (method, template) not in endpoints:
            return None
        endpoint = endpoints[method, template]
        policy = lookup(mw.policies, method, ResolvedRoute(template, endpoint), template)
        if policy is not None:
            assert policy is policy_of(endpoint) or policy in mw.policies.values()
        elif method in mw.methods:
            policy = mw.default_policy
        return policy if policy is not None and policy.enabled else None

    return guard_of


def test_guard_of_for_agrees_with_the_policy_lookup_by_hand() -> None:
    app = shop()
    mw = IdempotencyMiddleware(app, store=MemoryStore(), principal=ANONYMOUS, policies=POLICIES)
    hand = copy.deepcopy(app.openapi())
    apply_to_schema(hand, by_hand(mw, app))
    assert install_openapi(app, guard_of_for(mw, app))
    assert app.openapi() == hand
    assert SAFE_METHODS == _SAFE_METHODS  # the copy in openapi.py


def test_guard_of_for_answers_as_the_middleware_decides() -> None:
    app = shop()
    mw = IdempotencyMiddleware(app, store=MemoryStore(), principal=ANONYMOUS, policies=POLICIES)
    guard_of = guard_of_for(mw, app)
    assert guard_of("POST", REFUNDS) == Policy(required=True, max_body_bytes=2048)
    assert guard_of("POST", CANCEL) is POLICIES[f"POST {CANCEL}"]
    assert guard_of("POST", NOTES) is mw.default_policy
    assert guard_of("POST", COMMENTS) is None  # Policy(enabled=False) in the map
    assert guard_of("POST", "/exempt") is None  # @idempotent(enabled=False)
    assert guard_of("GET", ORDER) is None
    assert guard_of("PUT", TAG) is None
    assert guard_of("POST", "/nowhere") is None  # the router would answer 404
    assert guard_of("PATCH", REFUNDS) is None  # ... and 405
    # The settings are read at each call, as the middleware reads them per request.
    mw.methods = frozenset({"POST", "PATCH", "PUT"})
    assert guard_of("PUT", TAG) is mw.default_policy


def test_safe_methods_stay_untouched_whatever_guard_of_says() -> None:
    # The middleware lets safe methods through before any policy is looked up.
    schema = shop().openapi()
    apply_to_schema(schema, lambda method, template, /: Policy(required=True))
    assert key_parameter(schema["paths"][ORDER]["get"]) is None
    assert "409" not in schema["paths"][ORDER]["get"]["responses"]
    assert key_parameter(schema["paths"][TAG]["put"]) is not None


def test_the_schema_is_valid_openapi() -> None:
    app = guarded(shop())
    schema = app.openapi()
    OpenAPI.model_validate(schema)  # FastAPI's own model of the document
    # The full validator, where it is installed (not a dependency of the project).
    if importlib.util.find_spec("openapi_spec_validator") is not None:
        validator: Any = importlib.import_module("openapi_spec_validator")
        validator.validate(schema)


def test_an_app_without_openapi_is_left_alone() -> None:
    app = Starlette()
    mw = IdempotencyMiddleware(app, store=MemoryStore(), principal=ANONYMOUS)
    assert install_openapi(app, guard_of_for(mw, app)) is False
    assert install_openapi(None, guard_of_for(mw, app)) is False
    assert not hasattr(app, "openapi")


async def test_a_webhook_route_documents_its_signature_not_the_key_header() -> None:
    from asgi_idempotency.integrations.webhooks import github

    app = FastAPI()

    @app.post("/hooks/github")
    async def on_push() -> dict[str, bool]:
        return {"ok": True}

    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        principal=ANONYMOUS,
        policies={"POST /hooks/github": Policy(key_from=github("secret"))},
    )
    operation = (await served_schema(app))["paths"]["/hooks/github"]["post"]
    assert key_parameter(operation) is None  # the delivery id is the key, not this header
    assert "urn:asgi-idempotency:problem:invalid-signature" in problem_types(
        operation["responses"]["400"]
    )


# --- The guard's own 401 and 410, documented as the middleware sends them.


def _caller_app(principal: Any) -> FastAPI:
    app = FastAPI()

    @app.post("/refunds", status_code=201)
    @idempotent(required=True)
    async def refund() -> dict[str, int]:
        return {"refund": 1}

    @app.post("/exports")
    @idempotent(required=True)
    async def export() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):  # past what the guard keeps of a stream
                yield b"x" * (STREAM_KEEP_LIMIT // 2 + 1)

        return StreamingResponse(chunks(), media_type="text/csv")

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), principal=principal)
    return app


async def test_a_principal_that_can_name_no_caller_documents_the_401_it_sends() -> None:
    app = _caller_app(from_headers("X-User-Id"))
    refunds = (await served_schema(app))["paths"]["/refunds"]["post"]["responses"]
    documented = refunds["401"]["content"][PROBLEM]["examples"]
    async with client(app) as c:
        sent = await c.post("/refunds", headers={"Idempotency-Key": "k-1"})  # no X-User-Id
    assert sent.status_code == 401
    assert sent.headers["content-type"] == PROBLEM
    (example,) = documented.values()
    assert example["value"]["type"] == sent.json()["type"] == URN + "unauthenticated"
    assert example["value"]["status"] == 401
    assert refunds["401"]["content"][PROBLEM]["schema"] == {
        "$ref": f"#/components/schemas/{PROBLEM_SCHEMA_NAME}"
    }


async def test_no_401_where_the_guard_never_answers_one() -> None:
    app = _caller_app(ANONYMOUS)
    refunds = (await served_schema(app))["paths"]["/refunds"]["post"]["responses"]
    assert "401" not in refunds
    async with client(app) as c:
        sent = await c.post("/refunds", headers={"Idempotency-Key": "k-1"})
    assert sent.status_code == 201


async def test_the_410_documented_is_the_one_a_retry_of_an_unkept_stream_gets() -> None:
    app = _caller_app(ANONYMOUS)
    exports = (await served_schema(app))["paths"]["/exports"]["post"]["responses"]
    (example,) = exports["410"]["content"][PROBLEM]["examples"].values()
    async with client(app) as c:
        first = await c.post("/exports", headers={"Idempotency-Key": "e-1"})
        retry = await c.post("/exports", headers={"Idempotency-Key": "e-1"})
    assert first.status_code == 200
    assert retry.status_code == 410
    assert example["value"]["type"] == retry.json()["type"] == URN + "response-not-kept"

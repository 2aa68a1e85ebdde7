"""A namespace per service: services sharing one store never answer each other.

Two services (billing, shipping) on one Postgres table or one Redis, reached under one
host and path, by one caller sending one key and one body: without a namespace the
second answered from the first's record and did none of its own work (issue 41).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Header
from sqlalchemy import text
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, SQLStore
from asgi_idempotency.core.keys import scope_digest, scoped_key
from asgi_idempotency.http.principals import from_dependency, from_headers
from asgi_idempotency.integrations.webhooks import from_header
from asgi_idempotency.stores.base import Store
from tests.conftest import open_store, redis_store
from tests.helpers.lifespan import served

pytestmark = pytest.mark.anyio

KEY = "refund-A-88214"
BODY = {"order": "A-88214", "amount_p": 4500}
HOST = "api.shop.example"
CALLER = {"Idempotency-Key": KEY, "X-User-Id": "merchant-7"}
PRINCIPAL = "10:merchant-7"  # what from_headers("X-User-Id") names the caller


def service(name: str, store: Store, runs: list[str], **guard: Any) -> Starlette:
    """One service: ``POST /refunds`` notes ``name`` in ``runs`` each time it runs."""

    async def refund(request: Request) -> Response:
        runs.append(name)
        return JSONResponse({"service": name, "run": len(runs)}, status_code=201)

    return Starlette(
        routes=[Route("/refunds", refund, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware, store=store, principal=from_headers("X-User-Id"), **guard
            )
        ],
    )


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{HOST}")


@asynccontextmanager
async def two_stores(
    request: pytest.FixtureRequest, kind: str
) -> AsyncIterator[tuple[Store, Store]]:
    """Each service's own store object on one shared table (one Redis): as two deployments
    are. The memory store is shared by object, the only way it is shared."""
    async with open_store(request, kind) as first:
        if kind == "memory":
            yield first, first
            return
        if kind == "postgres":
            second: Store = SQLStore(request.getfixturevalue("pg_url"))
        else:
            second = await redis_store(request.getfixturevalue("redis_url"))
        try:
            yield first, second
        finally:
            await second.close()


KINDS = [
    "memory",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("billing_ns", "shipping_ns", "shared"),
    [
        ("billing", "shipping", False),
        ("billing", None, False),  # one service named, the other not: apart as well
        ("billing", "billing", True),
        (None, None, True),  # today's behaviour, unchanged
    ],
)
async def test_services_share_records_only_within_one_namespace(
    request: pytest.FixtureRequest,
    kind: str,
    billing_ns: str | None,
    shipping_ns: str | None,
    shared: bool,
) -> None:
    runs: list[str] = []
    async with two_stores(request, kind) as (store_a, store_b):
        billing = service("billing", store_a, runs, namespace=billing_ns)
        shipping = service("shipping", store_b, runs, namespace=shipping_ns)
        async with client(billing) as b, client(shipping) as s:
            first = await b.post("/refunds", json=BODY, headers=CALLER)
            second = await s.post("/refunds", json=BODY, headers=CALLER)
            # Each service's own retry replays its own answer, whatever the others do.
            again_b = await b.post("/refunds", json=BODY, headers=CALLER)
            again_s = await s.post("/refunds", json=BODY, headers=CALLER)
    assert first.status_code == 201
    assert first.json() == {"service": "billing", "run": 1}
    assert "idempotent-replayed" not in first.headers
    assert again_b.headers["idempotent-replayed"] == "true"
    assert again_b.json() == first.json()
    assert again_s.headers["idempotent-replayed"] == "true"
    if shared:
        # One namespace (or none on both): one record, the second service replays it.
        assert runs == ["billing"]
        assert second.headers["idempotent-replayed"] == "true"
        assert second.json() == first.json()
    else:
        assert runs == ["billing", "shipping"]
        assert second.status_code == 201
        assert second.json() == {"service": "shipping", "run": 2}
        assert "idempotent-replayed" not in second.headers
        assert again_s.json() == second.json()


@pytest.mark.parametrize("namespace", [None, "billing"])
async def test_the_record_key_is_the_scoped_key_with_the_namespace(namespace: str | None) -> None:
    """Without a namespace a record keeps the key it always had (records written before the
    argument existed still answer); with one, the namespace is in the key."""
    store = MemoryStore()
    async with client(service("billing", store, [], namespace=namespace)) as c:
        assert (await c.post("/refunds", json=BODY, headers=CALLER)).status_code == 201
    assert await store.get(scoped_key(PRINCIPAL, KEY, HOST, namespace or "")) is not None
    if namespace is not None:
        assert await store.get(scoped_key(PRINCIPAL, KEY, HOST)) is None


@pytest.mark.postgres
async def test_the_audit_digest_of_the_caller_carries_the_namespace(pg_store: SQLStore) -> None:
    async with client(service("billing", pg_store, [], namespace="billing")) as c:
        assert (await c.post("/refunds", json=BODY, headers=CALLER)).status_code == 201
    async with pg_store.engine.connect() as conn:
        row = (await conn.execute(text("SELECT key, scope_digest FROM idempotency_records"))).one()
    assert row.key == scoped_key(PRINCIPAL, KEY, HOST, "billing")
    assert row.scope_digest == scope_digest(PRINCIPAL, HOST, "billing")


def fastapi_service(name: str, store: Store, runs: list[str], namespace: str | None) -> FastAPI:
    """A FastAPI service whose caller is named by its auth dependency: the claim is made
    once FastAPI resolves it (``Responder.claim_deferred``)."""
    app = FastAPI()

    async def current_user(authorization: str = Header()) -> str:
        return authorization.removeprefix("Bearer ")

    @app.post("/refunds", status_code=201)
    async def refund(body: dict[str, Any], user: str = Depends(current_user)) -> dict[str, Any]:
        runs.append(name)
        return {"service": name, "user": user}

    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        principal=from_dependency(current_user),
        namespace=namespace,
    )
    return app


@pytest.mark.parametrize(("other", "shared"), [("shipping", False), ("billing", True)])
async def test_the_dependency_claim_is_scoped_by_the_namespace(other: str, shared: bool) -> None:
    store = MemoryStore()
    runs: list[str] = []
    headers = {"Idempotency-Key": KEY, "Authorization": "Bearer merchant-7"}
    billing = fastapi_service("billing", store, runs, "billing")
    shipping = fastapi_service("shipping", store, runs, other)
    async with served(billing, f"http://{HOST}") as b, served(shipping, f"http://{HOST}") as s:
        first = await b.post("/refunds", json=BODY, headers=headers)
        second = await s.post("/refunds", json=BODY, headers=headers)
    assert first.status_code == second.status_code == 201
    assert runs == (["billing"] if shared else ["billing", "shipping"])
    assert (second.headers.get("idempotent-replayed") == "true") is shared
    assert await store.get(scoped_key("merchant-7", KEY, HOST, "billing")) is not None


async def test_a_webhook_delivered_to_two_services_runs_at_each() -> None:
    store = MemoryStore()
    runs: list[str] = []
    delivery = {"X-Delivery-Id": "dlv-1"}
    guard: dict[str, Any] = {
        "policies": {"POST /refunds": _webhook_policy()},
    }
    billing = service("billing", store, runs, namespace="billing", **guard)
    shipping = service("shipping", store, runs, namespace="shipping", **guard)
    async with client(billing) as b, client(shipping) as s:
        assert (await b.post("/refunds", json=BODY, headers=delivery)).status_code == 201
        assert (await s.post("/refunds", json=BODY, headers=delivery)).status_code == 201
        again = await s.post("/refunds", json=BODY, headers=delivery)
    assert runs == ["billing", "shipping"]
    assert again.headers["idempotent-replayed"] == "true"


def _webhook_policy() -> Any:
    from asgi_idempotency import Policy

    return Policy(key_from=from_header("X-Delivery-Id", sender="acme"))


async def test_the_same_request_to_two_services_is_no_regenerated_key() -> None:
    """The detector's marker is per service: one caller sending one request to billing and
    to shipping, each under its own key, is two requests, not a key minted per retry."""
    store = MemoryStore()
    window = {"detect_regenerated_keys": timedelta(seconds=60)}
    billing = service("billing", store, [], namespace="billing", **window)
    shipping = service("shipping", store, [], namespace="shipping", **window)
    async with client(billing) as b, client(shipping) as s:
        await b.post("/refunds", json=BODY, headers={**CALLER, "Idempotency-Key": "k-1"})
        await s.post("/refunds", json=BODY, headers={**CALLER, "Idempotency-Key": "k-2"})
        # Within one service, the same request under another key is still flagged.
        await b.post("/refunds", json=BODY, headers={**CALLER, "Idempotency-Key": "k-3"})
    assert IdempotencyMiddleware.of(shipping).snapshot().suspected_regenerated_keys == {}
    flagged = IdempotencyMiddleware.of(billing).snapshot().suspected_regenerated_keys
    assert flagged == {"/refunds": 1}


@pytest.mark.parametrize(
    "namespace",
    [
        *("", " ", "billing ", "bill ing", "billing/eu", "billing:eu", "façade", "a" * 65, "\n"),
        *(42, b"billing"),
    ],
)
def test_a_namespace_that_is_not_a_service_name_is_refused_naming_it(namespace: Any) -> None:
    with pytest.raises(ValueError, match="namespace") as refused:
        IdempotencyMiddleware(
            Starlette(), store=MemoryStore(), principal=from_headers("X-User-Id"),
            namespace=namespace,
        )  # fmt: skip
    assert repr(namespace) in str(refused.value)


@pytest.mark.parametrize("namespace", ["billing", "payments.eu-1", "A_b", "7", "a" * 64])
def test_a_service_name_is_accepted_and_read_back(namespace: str) -> None:
    guard = IdempotencyMiddleware(
        Starlette(), store=MemoryStore(), principal=from_headers("X-User-Id"), namespace=namespace
    )
    assert guard.namespace == namespace
    unnamed = IdempotencyMiddleware(
        Starlette(), store=MemoryStore(), principal=from_headers("X-User-Id")
    )
    assert unnamed.namespace is None


def test_keys_differ_between_namespaces_and_from_none() -> None:
    keys = {scoped_key("p", KEY, HOST, ns) for ns in ("", "billing", "shipping")}
    assert len(keys) == 3

"""The request flow of the middleware, on every store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy, SQLStore
from asgi_idempotency.http.capture import storable_headers
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.stores.base import Store
from tests.conftest import TinyFactory

pytestmark = pytest.mark.anyio

KEY = {"Idempotency-Key": "order-42"}
PROBLEM = "application/problem+json"


async def test_first_request_runs_then_replays_identical_bytes(
    store: Store, tiny: TinyFactory
) -> None:
    t = tiny(store)
    async with t.client() as c:
        first = await c.post("/pay", json={"amount": 4500}, headers=KEY)
        second = await c.post("/pay", json={"amount": 4500}, headers=KEY)
    assert first.status_code == second.status_code == 201
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert second.headers["content-type"] == first.headers["content-type"]
    assert t.calls == {"pay": 1}


async def test_reserialised_json_is_the_same_request(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store)
    async with t.client() as c:
        await c.post(
            "/pay",
            content=b'{"amount": 4500, "currency": "EUR"}',
            headers={**KEY, "content-type": "application/json"},
        )
        again = await c.post(
            "/pay",
            content=b'{"currency":"EUR","amount":4500.0}',
            headers={**KEY, "content-type": "application/json"},
        )
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert t.calls == {"pay": 1}


async def test_handler_receives_the_original_bytes(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store)
    raw = b'{"amount":  4500.0,"z":1}'
    async with t.client() as c:
        r = await c.post("/pay", content=raw, headers={**KEY, "content-type": "application/json"})
    assert r.json()["echo"] == {"amount": 4500.0, "z": 1}


@pytest.mark.parametrize(
    ("second_body", "query"),
    [({"amount": 4501}, ""), ({"amount": 4500}, "?currency=USD")],
)
async def test_same_key_different_request_is_422(
    store: Store, tiny: TinyFactory, second_body: dict[str, int], query: str
) -> None:
    t = tiny(store)
    async with t.client() as c:
        await c.post("/pay", json={"amount": 4500}, headers=KEY)
        r = await c.post("/pay" + query, json=second_body, headers=KEY)
    assert r.status_code == 422
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["type"].endswith("key-reused")
    assert t.calls == {"pay": 1}


async def test_duplicate_while_in_flight_is_409_with_retry_after(
    store: Store, tiny: TinyFactory
) -> None:
    t = tiny(store, policies={"POST /pay": Policy(required=True)})
    async with t.client() as c:
        first = asyncio.create_task(c.post("/pay", json={"wait": True}, headers=KEY))
        await asyncio.wait_for(t.entered.wait(), 5)  # the first request is inside its handler
        dup = await c.post("/pay", json={"wait": True}, headers=KEY)
        mismatch = await c.post("/pay", json={"wait": False}, headers=KEY)
        t.gate.set()
        done = await first
        replay = await c.post("/pay", json={"wait": True}, headers=KEY)
    assert dup.status_code == 409
    assert dup.headers["content-type"] == PROBLEM
    assert 1 <= int(dup.headers["retry-after"]) <= 30
    assert mismatch.status_code == 422
    assert done.status_code == 201
    assert replay.content == done.content
    assert t.calls == {"pay": 1}


@pytest.mark.parametrize("status", [500, 503, 408, 409, 425, 429])
async def test_retryable_failures_release_the_key(
    store: Store, tiny: TinyFactory, status: int
) -> None:
    t = tiny(store)
    async with t.client() as c:
        first = await c.post(f"/fail/{status}", headers=KEY)
        second = await c.post(f"/fail/{status}", headers=KEY)
    assert first.status_code == second.status_code == status
    assert second.json() == {"n": 2}
    assert "idempotent-replayed" not in second.headers
    assert t.calls == {"fail": 2}


@pytest.mark.parametrize("status", [200, 302, 400, 404, 410])
async def test_final_answers_are_stored(store: Store, tiny: TinyFactory, status: int) -> None:
    t = tiny(store)
    async with t.client() as c:
        first = await c.post(f"/fail/{status}", headers=KEY)
        second = await c.post(f"/fail/{status}", headers=KEY)
    assert second.status_code == status
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert t.calls == {"fail": 1}


async def test_exception_releases_the_key(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store)
    async with t.client() as c:
        with pytest.raises(RuntimeError):
            await c.post("/boom", headers=KEY)
        with pytest.raises(RuntimeError):
            await c.post("/boom", headers=KEY)
    assert t.calls == {"boom": 2}


async def test_set_cookie_and_date_are_never_replayed(store: Store, tiny: TinyFactory) -> None:
    # ANONYMOUS: the client sends the cookie back, which the default would refuse to guess at.
    t = tiny(store, principal=ANONYMOUS)
    async with t.client() as c:
        first = await c.post("/cookie", headers=KEY)
        second = await c.post("/cookie", headers=KEY)
    assert "set-cookie" in first.headers
    assert second.headers["idempotent-replayed"] == "true"
    assert "set-cookie" not in second.headers
    assert second.json() == {"n": 1}


def test_hop_by_hop_headers_and_those_connection_names_are_not_stored() -> None:
    sent = [
        (b"Content-Type", b"application/json"),
        (b"Connection", b"close, X-Trace-Hop"),
        (b"x-trace-hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Date", b"Wed, 02 Dec 2026 16:00:00 GMT"),
        (b"X-Request-Id", b"r-1"),
        (b"set-cookie", b"s=1"),
    ]
    json_type = (b"content-type", b"application/json")  # stored ready to send: lower case
    assert storable_headers(sent) == (json_type, (b"x-request-id", b"r-1"))
    assert storable_headers(sent[:1]) == (json_type,)


async def test_required_key_missing_is_400(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store, policies={"POST /pay": Policy(required=True)})
    async with t.client() as c:
        r = await c.post("/pay", json={})
    assert r.status_code == 400
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["type"].endswith("missing-key")
    assert t.calls == {}


async def test_optional_key_missing_runs_unguarded(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store)
    async with t.client() as c:
        await c.post("/pay", json={})
        await c.post("/pay", json={})
    assert t.calls == {"pay": 2}


@pytest.mark.parametrize(
    "value",
    [b"", b"   ", b"a" * 256, b"caf\xc3\xa9", b"a b", b"a\x01", b'"unterminated', b'"a"b"', b'""'],
)
async def test_invalid_keys_are_400_and_store_nothing(
    store: Store, tiny: TinyFactory, value: bytes
) -> None:
    t = tiny(store)
    async with t.client() as c:
        r = await c.post("/pay", json={}, headers=[(b"idempotency-key", value)])
    assert r.status_code == 400
    assert r.json()["type"].endswith("invalid-key")
    assert t.calls == {}


async def test_key_sent_twice_is_400(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store)
    async with t.client() as c:
        r = await c.post(
            "/pay", json={}, headers=[(b"idempotency-key", b"a"), (b"idempotency-key", b"a")]
        )
    assert r.status_code == 400
    assert t.calls == {}


async def test_quoted_and_bare_forms_are_the_same_key(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store)
    async with t.client() as c:
        await c.post("/pay", json={}, headers={"Idempotency-Key": "abc"})
        r = await c.post("/pay", json={}, headers={"Idempotency-Key": '"abc"'})
    assert r.headers["idempotent-replayed"] == "true"
    assert t.calls == {"pay": 1}


async def test_oversized_body_is_413_without_touching_the_store(
    store: Store, tiny: TinyFactory
) -> None:
    t = tiny(store, default_policy=Policy(max_body_bytes=100))
    async with t.client() as c:
        declared = await c.post("/pay", content=b"x" * 101, headers=KEY)

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"x" * 50

        streamed = await c.post("/pay", content=chunks(), headers=KEY)
        at_limit = await c.post("/pay", json={"p": "x" * 80}, headers=KEY)
    assert declared.status_code == streamed.status_code == 413
    assert declared.headers["content-type"] == PROBLEM
    assert at_limit.status_code == 201
    assert t.calls == {"pay": 1}


async def test_safe_methods_and_exempt_routes_pass_through(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store, policies={"POST /cookie": Policy(enabled=False)})
    async with t.client() as c:
        for _ in range(2):
            assert (await c.get("/pay", headers=KEY)).status_code == 200
            await c.post("/cookie", headers=KEY)
    assert t.calls == {"get": 2, "cookie": 2}


async def test_principals_never_see_each_others_responses(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store, principal=lambda scope: dict(scope["headers"]).get(b"x-user", b"").decode())
    async with t.client() as c:
        alice = await c.post("/pay", json={"a": 1}, headers={**KEY, "x-user": "alice"})
        bob = await c.post("/pay", json={"a": 1}, headers={**KEY, "x-user": "bob"})
        alice2 = await c.post("/pay", json={"a": 1}, headers={**KEY, "x-user": "alice"})
    assert bob.status_code == 201
    assert "idempotent-replayed" not in bob.headers
    assert bob.json()["id"] != alice.json()["id"]
    assert alice2.content == alice.content
    assert t.calls == {"pay": 2}


async def test_async_principal_is_awaited(store: Store, tiny: TinyFactory) -> None:
    async def principal(scope: Any) -> str:
        headers: dict[bytes, bytes] = dict(scope["headers"])
        return "tenant-" + headers.get(b"x-tenant", b"").decode()

    t = tiny(store, principal=principal)
    async with t.client() as c:
        await c.post("/pay", json={}, headers={**KEY, "x-tenant": "1"})
        await c.post("/pay", json={}, headers={**KEY, "x-tenant": "2"})
    assert t.calls == {"pay": 2}


async def test_unreachable_store_is_503_and_the_handler_does_not_run(tiny: TinyFactory) -> None:
    # A real Postgres URL on a port where nothing listens.
    dead = SQLStore("postgresql+asyncpg://postgres@127.0.0.1:9/nowhere", command_timeout=2)
    t = tiny(dead, policies={"POST /pay": Policy(required=True)})
    try:
        async with t.client() as c:
            r = await c.post("/pay", json={}, headers=KEY)
            unguarded = await c.get("/pay")
    finally:
        await dead.close()
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.headers["content-type"] == PROBLEM
    assert unguarded.status_code == 200
    assert t.calls == {"get": 1}


async def test_fail_open_runs_unguarded_when_the_store_fails(tiny: TinyFactory) -> None:
    dead = SQLStore("postgresql+asyncpg://postgres@127.0.0.1:9/nowhere", command_timeout=2)
    t = tiny(dead, fail_open=True)
    try:
        async with t.client() as c:
            r = await c.post("/pay", json={"a": 1}, headers=KEY)
    finally:
        await dead.close()
    assert r.status_code == 201
    assert r.json()["echo"] == {"a": 1}


async def test_problem_bodies_follow_rfc9457(store: Store, tiny: TinyFactory) -> None:
    t = tiny(store, policies={"POST /pay": Policy(required=True)})
    async with t.client() as c:
        r = await c.post("/pay", json={})
    body = r.json()
    assert set(body) == {"type", "title", "status", "detail"}
    assert body["status"] == 400
    assert body["type"].startswith("urn:asgi-idempotency:problem:")


def test_retry_after_must_be_a_positive_number() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError

    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="retry_after"):
            IdempotencyMiddleware(app, store=MemoryStore(), principal=ANONYMOUS, retry_after=bad)
    with pytest.raises(TypeError, match="retry_after"):
        IdempotencyMiddleware(app, store=MemoryStore(), principal=ANONYMOUS, retry_after="1")  # type: ignore[arg-type]


async def test_the_guard_added_with_add_middleware_is_reachable_for_its_snapshot() -> None:
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/pay", status_code=201)
    async def pay() -> dict[str, int]:
        return {"ok": 1}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS)
    with pytest.raises(LookupError, match="once the app has started"):
        IdempotencyMiddleware.of(app)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        await c.post("/pay", headers={"Idempotency-Key": "k"})
        await c.post("/pay", headers={"Idempotency-Key": "k"})
    snapshot = IdempotencyMiddleware.of(app).snapshot()
    assert snapshot.replay_rate() == 0.5

"""The request path leaves nothing for the cyclic collector, on every store kind.

Objects a request builds must die by reference counting when it ends: whatever only
the collector can free makes its full passes longer and more frequent, and those
passes are what a service sees as its p99. Each test drives the guarded app with the
collector off and counts what a forced collection then finds, against the same app
unguarded driven the same way.
"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

import pytest
from fastapi import Depends, FastAPI, Header
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore
from asgi_idempotency.http.asgi import ASGIApp, Message
from asgi_idempotency.http.principals import ANONYMOUS, from_dependency
from asgi_idempotency.stores.base import Store
from tests.helpers.lifespan import start

pytestmark = pytest.mark.anyio

ROUNDS = 40


class Gate:
    """Holds a request in its handler: ``entered`` once it is there, until ``opened``."""

    def __init__(self) -> None:
        self.entered, self.opened = asyncio.Event(), asyncio.Event()


def _app(gate: Gate) -> Starlette:
    async def pay(request: Request) -> Response:
        body = await request.json()
        if body.get("wait"):
            gate.entered.set()
            await gate.opened.wait()
        return JSONResponse({"ok": True, "n": body.get("n")}, status_code=201)

    return Starlette(routes=[Route("/pay", pay, methods=["POST"])])


async def _call(app: ASGIApp, key: str, body: bytes) -> int:
    """One request, straight through ASGI (no client whose own objects would count)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/pay", "raw_path": b"/pay", "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5000), "server": ("test", 80),
        "headers": [
            (b"host", b"test"), (b"content-type", b"application/json"),
            (b"idempotency-key", key.encode()),
        ],
    }  # fmt: skip
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    statuses: list[int] = []

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # no disconnect while the request runs
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive, send)
    return statuses[0]


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _garbage(run: Callable[[], Awaitable[None]]) -> Counter[str]:
    """What only the collector frees after ``run``, by type."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await run()
        gc.collect()
        found = Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


async def _per_outcome(app: ASGIApp, outcome: str, gate: Gate, tag: str, *, guarded: bool) -> None:
    """``ROUNDS`` requests that end in ``outcome`` when ``guarded`` (the same requests,
    answered by the handler, when not)."""
    conflict, busy = (422, 409) if guarded else (201, 201)
    for i in range(ROUNDS):
        key = f"{tag}-{outcome}-{i}"
        if outcome == "fresh":
            assert await _call(app, key, b'{"n": %d}' % i) == 201
        elif outcome == "replay":
            assert await _call(app, key, b'{"n": 1}') == 201
            assert await _call(app, key, b'{"n": 1}') == 201
        elif outcome == "mismatch":
            assert await _call(app, key, b'{"n": 1}') == 201
            assert await _call(app, key, b'{"n": 2}') == conflict
        else:
            gate.entered.clear()
            gate.opened.clear()
            first = asyncio.ensure_future(_call(app, key, b'{"wait": true}'))
            await gate.entered.wait()  # claimed (when guarded) and in its handler
            if guarded:
                assert await _call(app, key, b'{"wait": true}') == busy
            gate.opened.set()
            assert await first == 201
            del first


@pytest.mark.parametrize("outcome", ["fresh", "replay", "mismatch", "in_progress"])
@pytest.mark.usefixtures("collector_off")
async def test_a_guarded_request_leaves_no_more_cyclic_garbage_than_unguarded(
    each_store: Store, outcome: str
) -> None:
    # Every store kind (each_store), not the HTTP suite's three: the garbage measured
    # here is each store's own code's as much as the middleware's.
    gate = Gate()
    unguarded = _app(gate)
    guarded = IdempotencyMiddleware(_app(gate), store=each_store, principal=ANONYMOUS)
    # Warm both: first-request work (route caches, connections, prepared statements,
    # lazily built tables) is not per request.
    await _per_outcome(unguarded, outcome, gate, "warm", guarded=False)
    await _per_outcome(guarded, outcome, gate, "warm", guarded=True)

    base = await _garbage(lambda: _per_outcome(unguarded, outcome, gate, "u", guarded=False))
    ours = await _garbage(lambda: _per_outcome(guarded, outcome, gate, "g", guarded=True))

    extra = ours - base
    # A few objects may be collected once per run (a pool refilled, a timer handle);
    # none may be collected per request.
    assert sum(extra.values()) < ROUNDS, f"{outcome}: cyclic garbage left: {extra.most_common(8)}"


def _caller(x_user: str = Header("alice")) -> str:
    return x_user


def _fastapi_app(gate: Gate) -> FastAPI:
    api = FastAPI()

    @api.post("/pay", status_code=201)
    async def pay(body: dict[str, object], who: str = Depends(_caller)) -> dict[str, object]:
        if body.get("wait"):
            gate.entered.set()
            await gate.opened.wait()
        return {"ok": True, "n": body.get("n"), "who": who}

    return api


@pytest.mark.parametrize("outcome", ["fresh", "replay", "mismatch", "in_progress"])
@pytest.mark.usefixtures("collector_off")
async def test_the_fastapi_dependency_claim_leaves_no_more_cyclic_garbage_than_unguarded(
    outcome: str,
) -> None:
    gate = Gate()
    unguarded = _fastapi_app(gate)
    app = _fastapi_app(gate)
    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), principal=from_dependency(_caller)
    )
    answer, stop = await start(app)
    assert answer["type"] == "lifespan.startup.complete", answer
    try:
        await _per_outcome(unguarded, outcome, gate, "warm", guarded=False)
        await _per_outcome(app, outcome, gate, "warm", guarded=True)
        base = await _garbage(lambda: _per_outcome(unguarded, outcome, gate, "u", guarded=False))
        ours = await _garbage(lambda: _per_outcome(app, outcome, gate, "g", guarded=True))
    finally:
        await stop()
    extra = ours - base
    assert sum(extra.values()) < ROUNDS, f"{outcome}: cyclic garbage left: {extra.most_common(8)}"

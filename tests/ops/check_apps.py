"""Apps for the ``asgi-idempotency check`` tests, served by real uvicorn processes.

``guarded``: a FastAPI refund service behind :class:`IdempotencyMiddleware` on a
:class:`MemoryStore`, two callers by ``X-API-Key``; ``CHECK_APP_GUARD`` is ``caller``
(``from_dependency``, the default), ``anonymous`` (``ANONYMOUS``: one scope for both
callers) or ``none`` (no guard at all).

``flawed``: a hand-written guard (in memory) that conforms, except for the flaws a
request names in ``X-Flaws`` (comma-separated), each breaking one guarantee; see
:data:`FLAWS`.

Both serve ``POST /refunds`` (0.2 s), ``POST /slow-refunds`` (1.5 s), an ``X-Fail``
header that makes either answer 503 without an effect, ``GET /refunds/count`` (the
effects so far, and ``uvicorn_process``'s readiness path) and ``GET /requests`` (every
request received but these, counted at the outermost layer). ``flawed`` also answers
``POST /elsewhere?to=URL`` with a 307 to that URL.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi.security import APIKeyHeader
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from asgi_idempotency.core.keys import parse_key
from asgi_idempotency.http.principals import ANONYMOUS, from_dependency

GUARDED = "tests.ops.check_apps:guarded"
FLAWED = "tests.ops.check_apps:flawed"
CALLERS = {"key-a": "acme", "key-b": "globex"}
DELAYS = {"/refunds": 0.2, "/slow-refunds": 1.5}
UNCOUNTED = ("/requests", "/refunds/count")

#: Each flaw of the ``flawed`` app, and the check built to catch it.
FLAWS = {
    "refuses-keys": "first-request",  # answers 400 to any key
    "replay-differs": "replay",  # replays a re-serialised body
    "no-mark": "replay-marked",  # replays without Idempotent-Replayed
    "claim-after": "storm-one-effect",  # records the key after the handler ran
    "quoted-distinct": "quoted-key",  # takes the quotes as part of the key
    "cross-caller": "other-caller",  # one scope for every caller
    "ignores-body": "key-reuse",  # the fingerprint leaves the body out
    "lists-ok": "key-list",  # takes `"a", "b"` as one key
    "two-headers-ok": "two-key-headers",  # takes the first of two headers
    "key-optional": "missing-key",  # runs a request without a key
    "no-retry-after": "in-flight-409",  # 409 without Retry-After
    "keeps-5xx": "5xx-releases-key",  # stores a 503 and replays it
}


class _Counts:
    effects = 0
    requests = 0


class CountRequests:
    """Counts every HTTP request that reaches the server (but the counters' own)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in UNCOUNTED:
            _Counts.requests += 1
        await self.app(scope, receive, send)


async def _effect(request: Request, body: bytes) -> Response:
    if request.headers.get("x-fail"):
        return JSONResponse({"error": "injected failure"}, status_code=503)
    await asyncio.sleep(DELAYS[request.url.path])
    _Counts.effects += 1
    amount = (await request.json()).get("amount") if body else None
    return JSONResponse({"refund_id": str(uuid.uuid4()), "amount": amount}, status_code=201)


async def _count(request: Request) -> Response:
    return JSONResponse({"count": _Counts.effects})


async def _requests(request: Request) -> Response:
    return JSONResponse({"count": _Counts.requests})


# --- guarded: our middleware ------------------------------------------------------

api_key = APIKeyHeader(name="X-API-Key")


def current_client(key: str = Depends(api_key)) -> str:
    if key not in CALLERS:
        raise HTTPException(401, "unknown API key")
    return CALLERS[key]


def _guarded() -> FastAPI:
    app = FastAPI()
    guard = os.environ.get("CHECK_APP_GUARD", "caller")
    if guard != "none":
        principal = from_dependency(current_client) if guard == "caller" else ANONYMOUS
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), principal=principal)

    async def refund(request: Request, client: str = Depends(current_client)) -> Response:
        return await _effect(request, await request.body())

    for path in DELAYS:
        app.post(path, status_code=201)(idempotent(required=True)(refund))
    app.get("/refunds/count")(_count)
    app.get("/requests")(_requests)
    app.add_middleware(CountRequests)
    return app


guarded = _guarded()


# --- flawed: a hand-written guard, broken on request --------------------------------


class _Record:
    def __init__(self, fingerprint: bytes) -> None:
        self.fingerprint = fingerprint
        self.response: tuple[int, bytes] | None = None


_records: dict[tuple[str, str], _Record] = {}


def _problem(status: int, title: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"title": title}, status_code=status, headers=headers)


async def _flawed_refund(request: Request) -> Response:
    flaws = set(filter(None, request.headers.get("x-flaws", "").split(",")))
    caller = CALLERS.get(request.headers.get("x-api-key", ""))
    if caller is None:
        return _problem(401, "unknown API key")
    body = await request.body()
    raw = request.headers.getlist("idempotency-key")
    if not raw:
        if "key-optional" in flaws:
            return await _effect(request, body)
        return _problem(400, "Idempotency-Key required")
    if len(raw) > 1 and "two-headers-ok" not in flaws:
        return _problem(400, "one Idempotency-Key header, please")
    if "refuses-keys" in flaws:
        return _problem(400, "keys not supported")
    key = raw[0]
    if "quoted-distinct" not in flaws:
        try:
            key = parse_key(key.encode())
        except Exception:
            if "lists-ok" not in flaws:
                return _problem(400, "invalid Idempotency-Key")
    scope = ("" if "cross-caller" in flaws else caller, key)
    fingerprint = b"" if "ignores-body" in flaws else body
    record = _records.get(scope)
    if record is not None:
        if record.fingerprint != fingerprint:
            return _problem(422, "key reused with another request")
        if record.response is None:
            retry = {} if "no-retry-after" in flaws else {"Retry-After": "1"}
            return _problem(409, "in progress", retry)
        status, stored = record.response
        if "replay-differs" in flaws:
            stored += b" "
        marked = {} if "no-mark" in flaws else {"Idempotent-Replayed": "true"}
        return Response(stored, status, headers=marked, media_type="application/json")
    record = _Record(fingerprint)
    if "claim-after" not in flaws:
        _records[scope] = record
    response = await _effect(request, body)
    if response.status_code >= 500 and "keeps-5xx" not in flaws:
        _records.pop(scope, None)
        return response
    record.response = (response.status_code, bytes(response.body))
    _records[scope] = record
    return response


async def _elsewhere(request: Request) -> Response:
    """A redirect to the URL in ``?to=``: the checker must not follow it."""
    return RedirectResponse(request.query_params["to"], status_code=307)


def _flawed() -> Any:
    app = Starlette(
        routes=[
            *(Route(path, _flawed_refund, methods=["POST"]) for path in DELAYS),
            Route("/elsewhere", _elsewhere, methods=["POST"]),
            Route("/refunds/count", _count),
            Route("/requests", _requests),
        ]
    )
    return CountRequests(app)


flawed = _flawed()

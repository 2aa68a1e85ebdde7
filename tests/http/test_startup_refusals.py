"""A guard that refuses the app it wraps: where it says so, and what requests get after.

A refusal at startup fails startup as the app's own lifespan error would (a
``TestClient``'s ``with`` raises; uvicorn prints the reason and exits non-zero); no
guarded request runs its handler after a failed or unfinished startup; without
lifespan the same checks run at the first request; a store's failure reaches
uvicorn's default output (issue 33, items 6, 7 and 16).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from fastapi import FastAPI, Header
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy, SQLStore
from asgi_idempotency.http.principals import ANONYMOUS, from_dependency
from asgi_idempotency.ops._serve import uvicorn_process
from tests.conftest import PgServer
from tests.helpers.lifespan import served

with warnings.catch_warnings():
    # Starlette asks for httpx2 instead of httpx; the client works the same with either.
    warnings.filterwarnings("ignore", "Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

PROBLEM = "urn:asgi-idempotency:problem:"
KEY = {"Idempotency-Key": "refund-1"}


def _entered(client: TestClient) -> BaseException | None:
    """What ``with client:`` raised (``None``: startup passed), run in a thread so that a
    block that hangs (as one did in ``__exit__`` after a swallowed refusal) fails the test."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            with client:
                outcome.append(None)
        except BaseException as exc:  # handed to the test to look at
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the TestClient's with block hung"
    return outcome[0]


def _refunds(calls: list[str], **guard: Any) -> FastAPI:
    """A FastAPI refunds service; its handler records who ran it."""

    async def current_user(x_token: Annotated[str, Header()]) -> str:
        return x_token

    app = FastAPI()

    @app.post("/refunds", status_code=201)
    async def refund(x_token: Annotated[str, Header()]) -> dict[str, str]:
        calls.append(x_token)
        return {"refunded_to": x_token}

    @app.get("/refunds")
    async def listed() -> list[str]:
        return calls

    guard.setdefault("principal", from_dependency(current_user))
    app.add_middleware(IdempotencyMiddleware, **guard)
    return app


# --- 6. with TestClient(app): the refusal raises; nothing is served after ----------------


def test_a_principal_refusal_raises_from_the_test_clients_with() -> None:
    # /refunds reads the caller's header itself, not through current_user, so the
    # principal cannot name its caller: Bob would get Alice's stored refund.
    calls: list[str] = []
    policies = {"POST /refunds": Policy(required=True)}
    client = TestClient(_refunds(calls, store=MemoryStore(), policies=policies))
    raised = _entered(client)
    assert isinstance(raised, ValueError), raised
    assert "POST /refunds is guarded, but does not use current_user" in str(raised)
    # The same app, used afterwards without `with`: the handler never runs.
    for who in ("alice", "bob"):
        r = client.post("/refunds", headers={**KEY, "X-Token": who})
        assert r.status_code == 500, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert "does not use current_user" in r.json()["detail"]
    assert calls == []


def test_a_policy_for_no_route_raises_from_the_test_clients_with() -> None:
    calls: list[str] = []
    guard = {"store": MemoryStore(), "principal": ANONYMOUS}
    client = TestClient(_refunds(calls, policies={"POST /refund": Policy(required=True)}, **guard))
    raised = _entered(client)
    assert isinstance(raised, ValueError), raised
    assert "policies['POST /refund'] names no route the app serves" in str(raised)
    r = client.post("/refunds", headers={**KEY, "X-Token": "alice"})
    assert r.status_code == 500, r.text
    assert r.json()["type"] == PROBLEM + "guard-misconfigured"
    assert calls == []


@pytest.fixture
def unmigrated_pg(pg_server: PgServer) -> Any:
    with pg_server.database("idem_refusal") as url:
        yield url


@pytest.mark.postgres
def test_unmigrated_postgres_raises_from_the_test_clients_with(unmigrated_pg: str) -> None:
    from asgi_idempotency import SchemaMissing

    calls: list[str] = []
    store = SQLStore(unmigrated_pg)
    try:
        client = TestClient(_refunds(calls, store=store, principal=ANONYMOUS))
        raised = _entered(client)
        assert isinstance(raised, SchemaMissing), raised
        assert "asgi-idempotency migrate" in str(raised)
        r = client.post("/refunds", headers={**KEY, "X-Token": "alice"})
        assert r.status_code == 503, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert calls == []
    finally:
        asyncio.run(store.close())


@pytest.mark.slow
def test_uvicorn_exits_non_zero_printing_the_refusal(tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text(
        textwrap.dedent(
            """
            from starlette.applications import Starlette
            from starlette.responses import Response
            from starlette.routing import Route

            from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy
            from asgi_idempotency.http.principals import ANONYMOUS

            async def refund(request):
                return Response(status_code=201)

            app = Starlette(routes=[Route("/refunds", refund, methods=["POST"])])
            app.add_middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                principal=ANONYMOUS,
                policies={"POST /refund": Policy(required=True)},
            )
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "uvicorn", "main:app", "--port", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0, done.stderr
    assert "policies['POST /refund'] names no route the app serves" in done.stderr
    assert "Application startup failed" in done.stderr


# --- 6. a startup that has not completed, or failed: the handler never runs -------------


class _Lifespan:
    """Drives one app's lifespan by hand, as a server would."""

    def __init__(self, app: Any) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.task = asyncio.create_task(app(scope, self.inbox.get, self.outbox.put))

    async def answer(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.outbox.get(), 10)


def _paying(calls: list[str], lifespan: Any) -> Starlette:
    async def pay(request: Request) -> Response:
        calls.append("pay")
        return JSONResponse({}, status_code=201)

    return Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS)],
        lifespan=lifespan,
    )


def _client(app: Any) -> httpx.AsyncClient:
    # httpx's ASGITransport sends no lifespan: requests reach the app whatever its startup did.
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.mark.anyio
async def test_no_guarded_request_runs_before_startup_completes() -> None:
    calls: list[str] = []
    entered, release = asyncio.Event(), asyncio.Event()

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        entered.set()
        await release.wait()  # the app's own startup, still running
        yield

    app = _paying(calls, lifespan)
    server = _Lifespan(app)
    await server.inbox.put({"type": "lifespan.startup"})
    await asyncio.wait_for(entered.wait(), 10)
    async with _client(app) as c:
        early = await c.post("/pay", headers=KEY)
        assert early.status_code == 503, early.text
        assert early.json()["type"] == PROBLEM + "not-started"
        assert early.headers["retry-after"] == "1"
        assert calls == []
        release.set()
        assert (await server.answer())["type"] == "lifespan.startup.complete"
        later = await c.post("/pay", headers=KEY)
        assert later.status_code == 201, later.text
        assert calls == ["pay"]
    await server.inbox.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(server.task, 10)


@pytest.mark.anyio
async def test_no_guarded_request_runs_after_the_apps_own_startup_failed() -> None:
    calls: list[str] = []

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        raise RuntimeError("postgresql://shop:hunter2@db/orders is down")
        yield

    app = _paying(calls, lifespan)
    server = _Lifespan(app)
    await server.inbox.put({"type": "lifespan.startup"})
    assert (await server.answer())["type"] == "lifespan.startup.failed"
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(server.task, 10)
    async with _client(app) as c:
        r = await c.post("/pay", headers=KEY)
    assert r.status_code == 503, r.text
    assert r.json()["type"] == PROBLEM + "not-started"
    assert "hunter2" not in r.text  # the app's reason is the log's
    assert "orders" not in r.text
    assert calls == []


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["returns", "raises"])
async def test_an_app_that_does_not_speak_lifespan_is_served_as_without_it(how: str) -> None:
    # uvicorn's default (--lifespan auto) serves such an app; so does the guard.
    calls: list[str] = []

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            if how == "raises":
                raise RuntimeError("no lifespan here")
            return
        calls.append("pay")
        await JSONResponse({}, status_code=201)(scope, receive, send)

    guard = IdempotencyMiddleware(bare, store=MemoryStore(), principal=ANONYMOUS)
    server = _Lifespan(guard)
    await server.inbox.put({"type": "lifespan.startup"})
    if how == "raises":
        with pytest.raises(RuntimeError):
            await asyncio.wait_for(server.task, 10)
    else:
        await asyncio.wait_for(server.task, 10)
    async with _client(guard) as c:
        r = await c.post("/pay", headers=KEY)
    assert r.status_code == 201, r.text
    assert calls == ["pay"]


# --- 7. the policies map, and the checks without lifespan --------------------------------


@pytest.mark.anyio
async def test_a_lower_case_method_in_the_policies_map_is_applied() -> None:
    calls: list[str] = []
    guard = {"store": MemoryStore(), "principal": ANONYMOUS}
    app = _refunds(calls, policies={"post /refunds": Policy(required=True)}, **guard)
    async with served(app) as c:
        r = await c.post("/refunds", headers={"X-Token": "alice"})
    assert r.status_code == 400, r.text  # required=True holds
    assert r.json()["type"] == PROBLEM + "missing-key"
    assert calls == []


def test_two_spellings_of_one_entry_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"policies\['POST /refunds'\] and policies\['post"):
        IdempotencyMiddleware(
            _paying([], None),
            store=MemoryStore(),
            principal=ANONYMOUS,
            policies={"POST /refunds": Policy(), "post  /refunds": Policy(required=True)},
        )


@pytest.mark.anyio
async def test_without_lifespan_a_policy_for_no_route_refuses_guarded_requests() -> None:
    calls: list[str] = []
    guard = {"store": MemoryStore(), "principal": ANONYMOUS}
    app = _refunds(calls, policies={"POST /refund": Policy(required=True)}, **guard)
    async with _client(app) as c:
        r = await c.post("/refunds", headers={**KEY, "X-Token": "alice"})
        unguarded = await c.get("/refunds")
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == PROBLEM + "guard-misconfigured"
    assert "policies['POST /refund'] names no route the app serves" in r.json()["detail"]
    assert calls == []
    assert unguarded.status_code == 200  # safe methods pass, as ever


@pytest.mark.anyio
async def test_without_lifespan_a_middleware_order_refusal_says_so() -> None:
    async def pay(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS),
            Middleware(GZipMiddleware),  # inside the guard
        ],
    )
    async with _client(app) as c:
        r = await c.post("/pay", headers=KEY)
    assert r.status_code == 500, r.text
    problem = r.json()
    assert problem["type"] == PROBLEM + "middleware-order"
    assert problem["title"] == "Middleware is in the wrong order around the idempotency guard"
    assert "GZipMiddleware is inside IdempotencyMiddleware" in problem["detail"]


# --- 16. a store's failure reaches uvicorn's default output -------------------------------


@pytest.mark.slow
def test_a_failing_stores_reason_reaches_uvicorns_default_output(
    tmp_path: Path, refused_url: str
) -> None:
    port = refused_url.rsplit(":", 1)[1]
    database = f"postgresql+asyncpg://alice:s3cret-pw@127.0.0.1:{port}/shopdb"
    (tmp_path / "main.py").write_text(
        textwrap.dedent(
            f"""
            from starlette.applications import Starlette
            from starlette.responses import JSONResponse, Response
            from starlette.routing import Route

            from asgi_idempotency import IdempotencyMiddleware, Policy, SQLStore
            from asgi_idempotency.http.principals import ANONYMOUS

            async def refund(request):
                return JSONResponse({{}}, status_code=201)

            async def health(request):
                return Response()

            app = Starlette(
                routes=[
                    Route("/refunds", refund, methods=["POST"]),
                    Route("/health", health),
                ]
            )
            app.add_middleware(
                IdempotencyMiddleware,
                store=SQLStore({database!r}),
                principal=ANONYMOUS,
                policies={{"POST /refunds": Policy(required=True)}},
            )
            """
        )
    )
    log = tmp_path / "uvicorn.log"
    with uvicorn_process(
        "main:app", env={}, log=log, cwd=tmp_path, ready_path="/health", log_level=None
    ) as server:
        r = httpx.post(server.base_url + "/refunds", headers=KEY, timeout=30)
    assert r.status_code == 503, r.text
    for secret in ("alice", "s3cret", "shopdb", port, "127.0.0.1"):
        assert secret not in r.text, secret
    out = log.read_text()
    assert "idempotency.not_ready phase=startup" in out, out
    assert "idempotency.store_error route=/refunds" in out, out
    assert "ConnectionRefusedError: [Errno 111] Connection refused" in out, out  # the reason
    assert "s3cret" not in out


_LOGS_ONE = """
import asyncio, logging, sys
{configure}
from asgi_idempotency import IdempotencyMiddleware, MemoryStore
from asgi_idempotency.http.principals import ANONYMOUS

async def bare(scope, receive, send):
    pass

async def main():
    guard = IdempotencyMiddleware(bare, store=MemoryStore(), principal=ANONYMOUS)
    scope = {{"type": "http", "method": "GET", "path": "/", "headers": []}}
    await guard(scope, None, None)  # starts the guard
    logging.getLogger("asgi_idempotency").error("idempotency.test detail=the reason")

asyncio.run(main())
"""


@pytest.mark.parametrize(
    ("configure", "stdout", "stderr"),
    [
        ("", 0, 1),  # nothing configured, no uvicorn: stderr, once
        ("logging.basicConfig(stream=sys.stdout)", 1, 0),  # the app's handler alone
    ],
)
def test_the_package_log_goes_to_stderr_only_while_nothing_else_shows_it(
    configure: str, stdout: int, stderr: int
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LOGS_ONE.format(configure=configure)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("idempotency.test detail=the reason") == stdout, done.stdout
    assert done.stderr.count("idempotency.test detail=the reason") == stderr, done.stderr

"""Report-only mode changes no answer at any seam: under each fault or wiring below, the
report-mode app answers exactly as the unguarded app does (same answers, same runs, same
rows written), while enforcing mode answers otherwise. The one exception is a forged
webhook: a signature is no rollout choice, so it is refused (400) in every mode."""

from __future__ import annotations

import hashlib
import hmac
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import pytest
from fastapi import Depends, FastAPI
from sqlalchemy import func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy, SQLStore
from asgi_idempotency.http.principals import ANONYMOUS, from_dependency, from_user
from asgi_idempotency.integrations.transactional import get_session
from asgi_idempotency.integrations.webhooks import github
from asgi_idempotency.ops.demo import demo_metadata, prepare, refunds
from asgi_idempotency.stores.base import Store
from tests.conftest import PgServer

pytestmark = pytest.mark.anyio

Mode = Literal["enforce", "report"] | None  # None: the app without the guard
Answer = tuple[int, bytes]
TX = Policy(required=True, transactional=True)
SECRET = "whsec_report_mode_secret"


@dataclass
class Seen:
    """What one run of a seam's traffic showed: the answers, the handler's runs, the rows."""

    answers: list[Answer]
    runs: int
    rows: int = 0


class Shop:
    """A tiny shop: ``/refunds`` guarded by ``policy`` (writing a row when asked, through
    the guard's transaction when the route is transactional and guarded, else through a
    session of its own, as the app without the guard does), ``/notes`` writing nothing."""

    def __init__(
        self, mode: Mode, store: Store, policy: Policy, engine: AsyncEngine | None = None,
        **guard: Any,
    ) -> None:  # fmt: skip
        self.runs = 0
        transactional = mode is not None and policy.transactional

        async def refund(request: Request) -> Response:
            body = await request.json()
            self.runs += 1
            n = self.runs
            if body.get("write"):
                row = insert(refunds).values(id=uuid.uuid4().hex, order_id=str(n), amount=1)
                if transactional:
                    await get_session(request).execute(row)  # committed by the guard
                else:
                    assert engine is not None
                    async with AsyncSession(engine) as session:
                        await session.execute(row)
                        await session.commit()
            return JSONResponse({"refund": n}, status_code=201)

        async def note(request: Request) -> Response:
            self.runs += 1
            return JSONResponse({"note": self.runs}, status_code=201)

        policies = {"POST /refunds": policy, "POST /notes": Policy(required=True)}
        guard.setdefault("principal", ANONYMOUS)
        middleware = []
        if mode is not None:
            middleware.append(
                Middleware(
                    IdempotencyMiddleware, store=store, policies=policies, mode=mode, **guard
                )
            )
        self.app = Starlette(
            routes=[
                Route("/refunds", refund, methods=["POST"]),
                Route("/notes", note, methods=["POST"]),
            ],
            middleware=middleware,
        )


@asynccontextmanager
async def posting(app: Any) -> AsyncIterator[Callable[..., Awaitable[Answer]]]:
    """``post(path, body, key=None, headers=None)`` to ``app``, served without lifespan."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:

        async def post(
            path: str, body: dict[str, Any] | bytes, key: str | None = None,
            headers: dict[str, str] | None = None,
        ) -> Answer:  # fmt: skip
            sent = dict(headers or {})
            if key is not None:
                sent["Idempotency-Key"] = key
            if isinstance(body, bytes):
                reply = await client.post(path, content=body, headers=sent)
            else:
                reply = await client.post(path, json=body, headers=sent)
            return reply.status_code, reply.content

        yield post


async def count_rows(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(refunds))).scalar_one())


@asynccontextmanager
async def database(
    pg: PgServer | None, *, migrated: bool
) -> AsyncIterator[tuple[str, AsyncEngine]]:
    """A throwaway database of its own with the shop's table, and the records' schema
    when ``migrated``; its URL and an engine the test reads it with."""
    assert pg is not None
    with pg.database("idem_report") as url:
        engine = create_async_engine(url)
        try:
            if migrated:
                await prepare(url)
            else:
                async with engine.begin() as conn:
                    await conn.run_sync(demo_metadata.create_all)
            yield url, engine
        finally:
            await engine.dispose()


@contextmanager
def closed_postgres() -> Iterator[str]:
    """A Postgres URL whose port refuses connections: bound for the test, never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"postgresql+asyncpg://postgres@127.0.0.1:{sock.getsockname()[1]}/shop"


# The seams. Each runs its traffic once in a mode and says what it saw.


async def retried_transactional(mode: Mode, pg: PgServer | None) -> Seen:
    """A transactional request retried: enforcing replays it; reporting runs it again in a
    transaction of its own, and its writes commit as the app's own would."""
    async with database(pg, migrated=True) as (url, engine):
        store = SQLStore(url)
        shop = Shop(mode, store, TX, engine)
        try:
            async with posting(shop.app) as post:
                answers = [await post("/refunds", {"write": True}, "a") for _ in range(2)]
            return Seen(answers, shop.runs, await count_rows(engine))
        finally:
            await store.close()


async def transactional_store_down(mode: Mode, pg: PgServer | None) -> Seen:
    """A transactional route with the store unreachable: enforcing answers 503."""
    with closed_postgres() as url:
        store = SQLStore(url)
        shop = Shop(mode, store, TX)
        try:
            async with posting(shop.app) as post:
                return Seen([await post("/refunds", {"write": False}, "a")], shop.runs)
        finally:
            await store.close()


async def claim_fails_in_transaction(mode: Mode, pg: PgServer | None) -> Seen:
    """The records table goes away after the store was found ready: the claim fails inside
    the request's transaction, and enforcing answers 503."""
    async with database(pg, migrated=True) as (url, engine):
        store = SQLStore(url)
        shop = Shop(mode, store, TX, engine)
        try:
            async with posting(shop.app) as post:
                answers = [await post("/refunds", {"write": True}, "a")]
                async with engine.begin() as conn:
                    await conn.execute(text("DROP TABLE idempotency_records"))
                answers.append(await post("/refunds", {"write": True}, "b"))
            return Seen(answers, shop.runs, await count_rows(engine))
        finally:
            await store.close()


async def transactional_without_key(mode: Mode, pg: PgServer | None) -> Seen:
    """A required transactional route called without a key: enforcing answers 400."""
    async with database(pg, migrated=True) as (url, engine):
        store = SQLStore(url)
        shop = Shop(mode, store, TX, engine)
        try:
            async with posting(shop.app) as post:
                answers = [await post("/refunds", {"write": True})]
            return Seen(answers, shop.runs, await count_rows(engine))
        finally:
            await store.close()


async def unmigrated_without_lifespan(mode: Mode, pg: PgServer | None) -> Seen:
    """Postgres whose migration never ran, served without lifespan: enforcing answers 503
    on a plain route and on a transactional one."""
    async with database(pg, migrated=False) as (url, engine):
        store = SQLStore(url)
        shop = Shop(mode, store, TX, engine)
        try:
            async with posting(shop.app) as post:
                answers = [
                    await post("/notes", {}, "a"),
                    await post("/refunds", {"write": True}, "b"),
                ]
            return Seen(answers, shop.runs, await count_rows(engine))
        finally:
            await store.close()


async def dependency_names_no_caller(mode: Mode, pg: PgServer | None) -> Seen:
    """FastAPI, ``from_dependency`` whose dependency lets an anonymous caller through
    (``None``): enforcing refuses the keyed request."""
    runs: list[str | None] = []

    def current_user() -> str | None:
        return None

    app = FastAPI()

    @app.post("/refunds", status_code=201)
    async def refund(user: str | None = Depends(current_user)) -> dict[str, int]:
        runs.append(user)
        return {"refund": len(runs)}

    if mode is not None:
        app.add_middleware(
            IdempotencyMiddleware, store=MemoryStore(), principal=from_dependency(current_user),
            mode=mode,
        )  # fmt: skip
    async with posting(app) as post:
        return Seen([await post("/refunds", {"amount": 1}, "a")], len(runs))


async def refused_at_first_request(mode: Mode, pg: PgServer | None) -> Seen:
    """A guard that cannot work as wired (``from_user()`` with no AuthenticationMiddleware),
    served without lifespan: enforcing answers every guarded request 500."""
    shop = Shop(mode, MemoryStore(), Policy(required=True), principal=from_user())
    async with posting(shop.app) as post:
        return Seen([await post("/refunds", {}, "a")], shop.runs)


async def forged_webhook(mode: Mode, pg: PgServer | None) -> Seen:
    """A GitHub delivery signed with the wrong secret: refused in every mode."""
    shop = Shop(mode, MemoryStore(), Policy(key_from=github(SECRET)))
    body = b'{"action": "opened"}'
    forged = hmac.new(b"not the secret", body, hashlib.sha256).hexdigest()
    headers = {
        "X-Hub-Signature-256": f"sha256={forged}",
        "X-GitHub-Delivery": "d1",
        "Content-Type": "application/json",
    }
    async with posting(shop.app) as post:
        return Seen([await post("/refunds", body, headers=headers)], shop.runs)


@dataclass(frozen=True)
class Seam:
    run: Callable[[Mode, PgServer | None], Awaitable[Seen]]
    enforced: list[int | tuple[int, ...]]  # enforcing mode's statuses (a tuple: any of)
    postgres: bool = True
    signed: bool = False  # a signature check: refused in report mode too


SEAMS = {
    "retried transactional request": Seam(retried_transactional, [201, 201]),
    "transactional route, store down": Seam(transactional_store_down, [503]),
    "claim fails inside the transaction": Seam(claim_fails_in_transaction, [201, 503]),
    "transactional route without its key": Seam(transactional_without_key, [400]),
    "unmigrated Postgres without lifespan": Seam(unmigrated_without_lifespan, [503, 503]),
    "from_dependency names no caller": Seam(dependency_names_no_caller, [(401, 500)], False),
    "guard refused at the first request": Seam(refused_at_first_request, [500], False),
    "forged webhook": Seam(forged_webhook, [400], False, signed=True),
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.postgres] if seam.postgres else [])
        for name, seam in SEAMS.items()
    ],
)
async def test_report_mode_answers_as_the_unguarded_app(
    name: str, request: pytest.FixtureRequest
) -> None:
    seam = SEAMS[name]
    pg: PgServer | None = request.getfixturevalue("pg_server") if seam.postgres else None
    plain = await seam.run(None, pg)
    enforced = await seam.run("enforce", pg)
    reported = await seam.run("report", pg)

    statuses = [status for status, _ in enforced.answers]
    assert len(statuses) == len(seam.enforced)
    for status, expected in zip(statuses, seam.enforced, strict=True):
        assert status in (expected if isinstance(expected, tuple) else (expected,)), statuses
    assert enforced != plain  # the seam is one where enforcing changes something
    if seam.signed:
        assert reported == enforced == Seen([(400, reported.answers[0][1])], 0)
        assert plain.runs == 1
    else:
        assert reported == plain


async def test_fail_open_runs_a_transactional_route_when_the_store_is_down() -> None:
    """``fail_open`` on a transactional route whose store cannot open a transaction: the
    handler runs unguarded and answers (it used to get no response at all)."""
    with closed_postgres() as url:
        store = SQLStore(url)
        shop = Shop("enforce", store, TX, fail_open=True)
        try:
            async with posting(shop.app) as post:
                answer = await post("/refunds", {"write": False}, "a")
        finally:
            await store.close()
    assert answer == (201, b'{"refund":1}')
    assert shop.runs == 1

"""A small refund service: the demo's server and the multi-process tests' app.

Configured from the environment so that ``uvicorn asgi_idempotency.ops.demo:app
--workers N`` gives every worker the same setup:

- ``IDEMPOTENCY_DEMO_DATABASE_URL``: store and refunds table (default ``sqlite+aiosqlite:///./idempotency-demo.db``)
- ``IDEMPOTENCY_DEMO_GUARDED``: ``0`` serves without the middleware (default ``1``)
- ``IDEMPOTENCY_DEMO_LEASE``: lease in seconds (default 30)
- ``IDEMPOTENCY_DEMO_TRANSACTIONAL``: ``1`` writes refunds in the idempotency transaction
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.http.middleware import IdempotencyMiddleware
from asgi_idempotency.http.policy import Policy
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.integrations.transactional import get_connection
from asgi_idempotency.stores.sql.store import SQLStore

# and `app`, built on access
__all__ = [
    "CannotCreateDatabase",
    "count_refunds",
    "create_app",
    "refunds",
    "run_demo",
    "scratch_database",
]


class CannotCreateDatabase(StoreError):
    """The demo's user may not create its scratch databases (no ``CREATEDB``)."""


demo_metadata = MetaData()
refunds = Table(
    "demo_refunds",
    demo_metadata,
    Column("id", String(36), primary_key=True),
    Column("order_id", String(64), nullable=False),
    Column("amount", Integer, nullable=False),
)

DEFAULT_URL = "sqlite+aiosqlite:///./idempotency-demo.db"
_APP = "asgi_idempotency.ops.demo:app"  # for uvicorn in a child process, configured by _from_env


def create_app(
    url: str, *, guarded: bool = True, lease: float = 30.0, transactional: bool = False
) -> Starlette:
    """The refund app: ``POST /orders/{order_id}/refunds`` with a JSON body.

    Body: ``amount`` (int), ``delay`` (seconds before the refund is written) and
    ``after`` (seconds between writing it and answering: the window a crash can hit).
    With ``transactional`` the refund is written in the idempotency transaction.
    """
    store = SQLStore(url)

    async def refund(request: Request) -> JSONResponse:
        payload: dict[str, Any] = await request.json()
        await asyncio.sleep(float(payload.get("delay", 0)))
        refund_id = str(uuid.uuid4())
        row = insert(refunds).values(
            id=refund_id, order_id=request.path_params["order_id"], amount=int(payload["amount"])
        )
        if transactional:
            await get_connection(request).execute(row)
        else:
            async with store.engine.begin() as conn:
                await conn.execute(row)
        await asyncio.sleep(float(payload.get("after", 0)))
        return JSONResponse({"refund_id": refund_id, "amount": payload["amount"]}, status_code=201)

    async def count(request: Request) -> JSONResponse:
        return JSONResponse({"refunds": await count_refunds(store)})

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        await store.close()

    middleware = []
    if guarded:
        policy = Policy(required=True, lease=timedelta(seconds=lease), transactional=transactional)
        middleware.append(
            Middleware(
                IdempotencyMiddleware,
                store=store,
                principal=ANONYMOUS,
                policies={"POST /orders/{order_id}/refunds": policy},
            )
        )
    return Starlette(
        routes=[
            Route("/orders/{order_id}/refunds", refund, methods=["POST"]),
            Route("/refunds/count", count, methods=["GET"]),
        ],
        middleware=middleware,
        lifespan=lifespan,
    )


async def prepare(url: str) -> None:
    """Create the records and refunds tables (idempotent)."""
    store = SQLStore(url)
    try:
        await store.create_all()
        async with store.engine.begin() as conn:
            await conn.run_sync(demo_metadata.create_all)
    finally:
        await store.close()


async def count_refunds(store: SQLStore) -> int:
    async with store.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(refunds))).scalar_one())


def _from_env() -> Starlette:
    return create_app(
        os.environ.get("IDEMPOTENCY_DEMO_DATABASE_URL", DEFAULT_URL),
        guarded=os.environ.get("IDEMPOTENCY_DEMO_GUARDED", "1") != "0",
        lease=float(os.environ.get("IDEMPOTENCY_DEMO_LEASE", "30")),
        transactional=os.environ.get("IDEMPOTENCY_DEMO_TRANSACTIONAL", "0") == "1",
    )


async def play_incident(
    url: str, *, guarded: bool, client_timeout: float = 1.0, delay: float = 1.5
) -> int:
    """Serve the refund app on loopback and replay the incident; return the refunds issued."""
    import httpx

    from asgi_idempotency.ops._serve import serve_in_thread

    label = "guarded  " if guarded else "unguarded"
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"  [{label} +{time.monotonic() - started:4.1f}s] {text}", flush=True)

    key = {"Idempotency-Key": f"refund-order-42-{uuid.uuid4().hex[:8]}"}
    body = {"amount": 4500, "delay": delay}
    with serve_in_thread(create_app(url, guarded=guarded), lifespan="on") as base:
        async with httpx.AsyncClient(base_url=base, timeout=client_timeout) as client:
            say(f"POST /orders/42/refunds (handler takes {delay}s, client waits {client_timeout}s)")
            try:
                await client.post("/orders/42/refunds", json=body, headers=key)
            except httpx.ReadTimeout:
                say("client timed out: did the refund happen? unknown. Retrying with the same key")
            for _ in range(20):
                # The retry waits long enough to see an answer this time.
                r = await client.post(
                    "/orders/42/refunds", json=body, headers=key, timeout=delay + 5
                )
                replayed = r.headers.get("idempotent-replayed") == "true"
                if r.status_code == 409:
                    wait = float(r.headers.get("retry-after", "1"))
                    say("409 in progress: the first attempt is still running; retrying shortly")
                    await asyncio.sleep(min(wait, delay))
                    continue
                detail = r.json().get("refund_id", "")
                say(f"{r.status_code} refund_id={detail}" + (" (replayed)" if replayed else ""))
                break
            await asyncio.sleep(delay)  # let any straggling handler finish before counting
            count = (await client.get("/refunds/count")).json()["refunds"]
    say(f"refunds issued: {count}")
    return int(count)


_IDLE_IN_TRANSACTION = text(
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE state LIKE 'idle in transaction%' AND datname = current_database()"
)
# MariaDB: the open InnoDB transactions of this database's sessions.
_OPEN_TRANSACTIONS = text(
    "SELECT count(*) FROM information_schema.innodb_trx t"
    " JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id"
    " WHERE p.db = DATABASE() AND p.id <> CONNECTION_ID()"
)


async def kill_after_write(
    url: str, *, transactional: bool, lease: float = 1.0, say: Any = print
) -> tuple[int, int]:
    """SIGKILL a worker between its refund write and its answer, then retry after the lease.

    Needs Postgres or MariaDB. Returns (refunds right after the kill, refunds after the retry):
    (1, 2) in the default mode — the abandoned claim is taken over and the refund
    runs again — and (0, 1) in transactional mode, where the write died with the claim.
    """
    import signal
    import tempfile
    from pathlib import Path

    import httpx

    from asgi_idempotency.ops._serve import uvicorn_process

    await prepare(url)
    store = SQLStore(url)
    mode = "transactional" if transactional else "default mode"
    env = {
        "IDEMPOTENCY_DEMO_DATABASE_URL": url,
        "IDEMPOTENCY_DEMO_LEASE": str(lease),
        "IDEMPOTENCY_DEMO_TRANSACTIONAL": "1" if transactional else "0",
    }
    body = {"amount": 4500, "after": 2}  # the refund is written 2 s before the answer
    key = {"Idempotency-Key": f"kill-after-write-{uuid.uuid4().hex[:8]}"}

    pg = store.dialect == "postgresql"
    open_transactions = _IDLE_IN_TRANSACTION if pg else _OPEN_TRANSACTIONS

    async def busy() -> bool:
        async with store.engine.connect() as conn:
            in_tx = (await conn.execute(open_transactions)).scalar_one()
        return bool(in_tx) or await count_refunds(store) > before

    try:
        before = await count_refunds(store)
        with tempfile.TemporaryDirectory() as tmp:
            crash_log, retry_log = Path(tmp) / "uvicorn-crash.log", Path(tmp) / "uvicorn-retry.log"
            with uvicorn_process(_APP, env=env, log=crash_log) as server:
                async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
                    say(f"[{mode}] POST a refund; the worker writes it, then is SIGKILLed")
                    pending = asyncio.create_task(
                        client.post("/orders/1/refunds", json=body, headers=key)
                    )
                    for _ in range(300):
                        await asyncio.sleep(0.05)
                        if await busy():
                            break
                    await asyncio.sleep(0.2)
                    server.kill(signal.SIGKILL)
                    try:
                        await pending
                    except httpx.TransportError:
                        say(f"[{mode}] connection lost: the client cannot tell what happened")
            for _ in range(100):  # the server notices the dead session and rolls it back
                if not await busy() or not transactional:
                    break
                await asyncio.sleep(0.05)
            after_kill = await count_refunds(store) - before
            say(f"[{mode}] refunds after the crash: {after_kill}")
            await asyncio.sleep(lease + 0.2)
            with uvicorn_process(_APP, env=env, log=retry_log) as server:
                async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
                    r = await client.post("/orders/1/refunds", json=body, headers=key)
                    say(f"[{mode}] retry after the {lease:g}s lease: {r.status_code}")
                    if r.status_code != 201:
                        raise RuntimeError(f"retry answered {r.status_code}: {r.text}")
        final = await count_refunds(store) - before
        say(f"[{mode}] refunds in the end: {final}")
        return after_kill, final
    finally:
        await store.close()


async def run_demo(url: str | None = None) -> int:
    """The incident twice: guarded (1 refund), unguarded (2).

    On throwaway SQLite files, or with a Postgres ``url`` on two scratch databases
    created on that server and dropped afterwards (:func:`scratch_database`).
    """
    import tempfile

    print("A refund handler slower than its client's timeout, then a retry.\n")
    async with AsyncExitStack() as stack:
        if url is not None and url.startswith("postgresql"):
            guarded_url = await stack.enter_async_context(scratch_database(url))
            unguarded_url = await stack.enter_async_context(scratch_database(url))
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            guarded_url = f"sqlite+aiosqlite:///{tmp}/guarded.db"
            unguarded_url = f"sqlite+aiosqlite:///{tmp}/unguarded.db"
        await prepare(guarded_url)
        await prepare(unguarded_url)
        guarded = await play_incident(guarded_url, guarded=True)
        print()
        unguarded = await play_incident(unguarded_url, guarded=False)
    with_guard, without = (f"{n} refund{'' if n == 1 else 's'}" for n in (guarded, unguarded))
    print(f"\nWith asgi-idempotency: {with_guard}. Without: {without}.")
    return 0 if (guarded, unguarded) == (1, 2) else 1


#: The name every scratch database starts with: a crashed demo's leftovers are easy to find.
SCRATCH_PREFIX = "asgi_idempotency_demo_"


_INSUFFICIENT_PRIVILEGE = "42501"  # Postgres's SQLSTATE for a permission denied


@asynccontextmanager
async def scratch_database(url: str, *, say: Any = print) -> AsyncIterator[str]:
    """A new, empty Postgres database beside the one ``url`` names; yields its URL.

    The demo writes a records table and a refunds table: in the user's own database
    they would stay behind (and mix with a real store's records). A database of its
    own is dropped whole afterwards, with any connection a killed worker left open.
    Needs a user who may create databases (``CREATEDB``).
    """
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.pool import NullPool

    from asgi_idempotency.stores.urls import redact

    given = make_url(url)
    name = f"{SCRATCH_PREFIX}{uuid.uuid4().hex[:12]}"
    admin = create_async_engine(given, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        try:
            async with admin.connect() as conn:
                await conn.execute(text(f'CREATE DATABASE "{name}"'))
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != _INSUFFICIENT_PRIVILEGE:
                raise
            raise CannotCreateDatabase(StoreError.wrap(exc.orig or exc).args[0]) from exc
        scratch = given.set(database=name).render_as_string(hide_password=False)
        say(f"(scratch database {redact(scratch)}, dropped afterwards)")
        try:
            yield scratch
        finally:
            async with admin.connect() as conn:
                await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        await admin.dispose()


def __getattr__(name: str) -> Any:
    # Built on first access so importing this module has no side effects.
    if name == "app":
        return _from_env()
    raise AttributeError(name)

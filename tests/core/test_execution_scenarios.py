"""One scenario table, run through every adapter of the runner alike.

HTTP (the middleware), FastAPI's dependency claim (``from_dependency``) and the function
guard are adapters over one runner (:mod:`asgi_idempotency.core.execution`), so every
lifecycle event must look the same through each: each row is run through a tiny guarded
Starlette app, a FastAPI app whose claim waits for its auth dependency, and
:class:`Once`, on the memory store and on a real Postgres, and the columns' traces must
equal each other and the table's. Transactional mode is a variant of the runner, not a
path of its own: the rows it shares with the default mode run through the same three
adapters in transactions, on Postgres and MariaDB, and agree the same way.
Faults come from a thin wrapper over the real store (a completion or release it
refuses, a claim that lands and whose answer never comes back), never a mock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, Literal, NamedTuple

import httpx
import pytest
from fastapi import Depends, FastAPI
from fastapi.security import APIKeyHeader
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, Once, Policy, idempotent
from asgi_idempotency.core.errors import InProgress, KeyReused, StoreError
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.functions.once import record_key
from asgi_idempotency.http.principals import from_dependency
from asgi_idempotency.stores.base import Busy, NewClaim, Record, RecordStatus, Store
from tests.apps import guarded
from tests.conftest import open_store

pytestmark = pytest.mark.anyio

WAIT = 20.0  # seconds before a step fails rather than hangs (a shared, loaded machine)
LEASE = timedelta(seconds=2)  # short: an orphan whose release keeps failing gives up within it
KEY = "order-1"
HOST = "shop.test"
NAMESPACE = "scenarios"
HEADERS = {"Idempotency-Key": KEY}

# (row, steps, the trace both columns must give). Steps: "call N" calls with argument
# N (a body {"amount": N} or the function's ``amount``); "hold" makes the next call's
# handler wait until "let go", which reports that call; "fail" makes the next handler
# raise; "refuse complete" / "refuse releases" make the store refuse its next
# completion / every release; "hang claim" makes the next claim land and its answer
# never come back, and the call is cancelled there; "record" reports the key's record;
# "settle" waits until it is no longer in progress, then reports it; "await error"
# waits for the guard's next store_error log, and reports its phase and whether it
# names the route (or namespace) the call was made on. A row starting with "wait"
# guards with a bounded wait for a duplicate in flight (Policy(wait=...), Once(wait=...));
# "waiting call N" starts a call that waits for the held one, "waited" reports it.
ROWS: list[tuple[str, list[str], list[str]]] = [
    ("fresh", ["call 1", "record"], ["executed #1", "completed"]),
    ("same key again", ["call 1", "call 1"], ["executed #1", "replayed #1"]),
    ("different arguments", ["call 1", "call 2"], ["executed #1", "mismatch"]),
    (
        "in flight",
        ["hold", "call 1", "record", "let go", "call 1"],
        ["held", "in progress", "in_progress", "executed #1", "replayed #1"],
    ),
    (
        "handler raises",
        ["fail", "call 1", "record", "call 1", "call 1"],
        ["raised", "free", "executed #2", "replayed #2"],
    ),
    (
        "completion fails once",
        ["refuse complete", "call 1", "await error", "settle", "call 1"],
        ["executed #1", "store_error complete on its route", "completed", "replayed #1"],
    ),
    (
        "cancelled mid-claim",
        ["hang claim", "call 1", "settle", "call 1"],
        ["cancelled", "free", "executed #1"],
    ),
    (
        "a duplicate waits for its first",
        ["wait", "hold", "waiting call 1", "let go", "waited"],
        ["held", "waiting", "executed #1", "replayed #1"],
    ),
    (
        "a duplicate waits, its first raises",
        ["wait", "fail", "hold", "waiting call 1", "let go", "waited"],
        ["held", "waiting", "raised", "executed #2"],
    ),
    (
        "cancelled mid-claim, its release refused",
        ["refuse releases", "hang claim", "call 1", "await error", "record"],
        ["cancelled", "store_error release on its route", "in_progress"],
    ),
]


# The rows transactional mode shares with the default (a bounded wait, completion
# retries and orphaned claims are the default mode's: a transaction rolls back instead).
# A claim in flight is an uncommitted transaction, so a reader sees its key free.
TX_ROWS: list[tuple[str, list[str], list[str]]] = [
    ("fresh", ["call 1", "record"], ["executed #1", "completed"]),
    ("same key again", ["call 1", "call 1"], ["executed #1", "replayed #1"]),
    ("different arguments", ["call 1", "call 2"], ["executed #1", "mismatch"]),
    (
        "in flight",
        ["hold", "call 1", "record", "let go", "call 1"],
        ["held", "in progress", "free", "executed #1", "replayed #1"],
    ),
    (
        "handler raises",
        ["fail", "call 1", "record", "call 1", "call 1"],
        ["raised", "free", "executed #2", "replayed #2"],
    ),
    (
        "the commit fails",
        ["refuse commit", "call 1", "record", "call 1"],
        ["unavailable", "free", "executed #2"],
    ),
]


class Faults:
    """The real store, with the faults a step asks for; every other call goes through."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.refuse_complete = False
        self.refuse_releases = False
        self.hang_claim = False
        self.refuse_commit = False
        self.landed = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.inner.transaction() as tx:  # type: ignore[attr-defined]
            if self.refuse_commit:
                self.refuse_commit = False
                yield _RefusingCommit(tx)
            else:
                yield tx

    async def insert(self, new: NewClaim) -> Record | Literal[Busy.BUSY] | None:
        got = await self.inner.insert(new)
        if self.hang_claim:
            self.hang_claim = False
            self.landed.set()
            await asyncio.Event().wait()  # until cancelled
        return got

    async def complete(self, *args: Any, **kwargs: Any) -> bool:
        if self.refuse_complete:
            self.refuse_complete = False
            raise StoreError("connection lost while completing")
        return bool(await self.inner.complete(*args, **kwargs))

    async def release(self, key: str, token: str) -> bool:
        if self.refuse_releases:
            raise StoreError("connection lost while releasing")
        return await self.inner.release(key, token)


class _RefusingCommit:
    """A transaction whose commit fails as a lost connection would: nothing commits."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def commit(self, *args: Any, **kwargs: Any) -> None:
        raise StoreError("connection lost while committing")


class Handler:
    """The guarded operation, the same for both columns: counts its runs."""

    def __init__(self) -> None:
        self.runs = 0
        self.fail_next = self.hold_next = False
        self.gate, self.entered = asyncio.Event(), asyncio.Event()

    async def __call__(self, amount: int) -> dict[str, int]:
        self.runs += 1
        if self.hold_next:
            self.hold_next = False
            self.entered.set()
            await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the payment provider failed")
        return {"amount": amount, "run": self.runs}


# A call's outcome: "executed #run", "replayed #run", "mismatch", "in progress", "raised".
Call = Callable[[int], Coroutine[Any, Any, str]]


class Column(NamedTuple):
    call: Call
    key: str  # the record's key in the store
    route: str  # what logs name: the route template, or the namespace
    waiting: Callable[[], int]  # duplicates waiting here for a first in flight


def over_http(
    store: Faults, handler: Handler, wait: timedelta | None, transactional: bool = False
) -> Column:
    """The middleware over a tiny Starlette app."""

    async def pay(request: Request) -> JSONResponse:
        data = await request.json()
        return JSONResponse(await handler(data["amount"]), status_code=201)

    app = guarded(
        store,
        [Route("/pay", pay, methods=["POST"])],
        policies={"POST /pay": Policy(lease=LEASE, wait=wait, transactional=transactional)},
    )
    return Column(_http_call(app), scoped_key("", KEY, HOST), "/pay", _waiting(app))


def over_fastapi_dependency(
    store: Faults, handler: Handler, wait: timedelta | None, transactional: bool = False
) -> Column:
    """The middleware over a FastAPI app whose caller is named by its auth dependency:
    the claim waits until FastAPI has resolved it."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, principal=from_dependency(caller))

    @app.post("/pay", status_code=201)
    @idempotent(lease=LEASE, wait=wait, transactional=transactional)
    async def pay(body: Amount, who: str = Depends(caller)) -> dict[str, int]:
        return await handler(body.amount)

    return Column(_http_call(app), scoped_key(CALLER, KEY, HOST), "/pay", _waiting(app))


class Amount(BaseModel):
    amount: int


CALLER = "acme"


def caller(key: str = Depends(APIKeyHeader(name="X-API-Key"))) -> str:
    return CALLER if key == "key-acme" else ""


def _http_call(app: Any) -> Call:
    # raise_app_exceptions=False: the handler's error is the server's 500, as served.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"Idempotency-Key": KEY, "X-API-Key": "key-acme"}

    async def call(amount: int) -> str:
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{HOST}") as client:
            got = await client.post("/pay", json={"amount": amount}, headers=headers)
        if got.status_code == 201:
            replayed = got.headers.get("idempotent-replayed") == "true"
            return f"{'replayed' if replayed else 'executed'} #{got.json()['run']}"
        outcomes = {422: "mismatch", 409: "in progress", 500: "raised", 503: "unavailable"}
        return outcomes[got.status_code]

    return call


def _waiting(app: Any) -> Callable[[], int]:
    def waiting() -> int:
        return IdempotencyMiddleware.of(app)._runtime.runner.waiters.waiting()

    return waiting


def over_once(
    store: Faults, handler: Handler, wait: timedelta | None, transactional: bool = False
) -> Column:
    """The function guard."""
    once = Once(store, lease=LEASE, namespace=NAMESPACE, wait=wait)
    pay: Callable[[str, int], Awaitable[dict[str, int]]]
    if transactional:

        @once(key=lambda order, amount: order, transactional=True)
        async def pay_in_transaction(order: str, amount: int, *, session: Any) -> dict[str, int]:
            return await handler(amount)

        pay = pay_in_transaction
    else:

        @once(key=lambda order, amount: order)
        async def pay_alone(order: str, amount: int) -> dict[str, int]:
            return await handler(amount)

        pay = pay_alone

    async def call(amount: int) -> str:
        runs = handler.runs
        try:
            result = await pay(KEY, amount)
        except KeyReused:
            return "mismatch"
        except InProgress:
            return "in progress"
        except RuntimeError:
            return "raised"
        except StoreError:
            return "unavailable"
        ran = handler.runs > runs
        return f"{'executed' if ran else 'replayed'} #{result['run']}"

    return Column(call, record_key(NAMESPACE, KEY), NAMESPACE, once._core.waiters.waiting)


async def record_state(store: Store, key: str) -> str:
    record = await store.get(key)
    if record is None:
        return "free"
    return "completed" if record.status is RecordStatus.COMPLETED else "in_progress"


Adapter = Callable[[Faults, Handler, timedelta | None, bool], Column]
ADAPTERS: dict[str, Adapter] = {
    "http": over_http,
    "fastapi dependency": over_fastapi_dependency,
    "once": over_once,
}


async def play(
    adapter: Adapter,
    store: Store,
    steps: list[str],
    caplog: pytest.LogCaptureFixture,
    transactional: bool = False,
) -> list[str]:
    faults, handler = Faults(store), Handler()
    wait = LEASE if steps[0] == "wait" else None
    call, key, route, waiting = adapter(faults, handler, wait, transactional)
    trace: list[str] = []
    held: asyncio.Task[str] | None = None
    waiter: asyncio.Task[str] | None = None
    seen = len(caplog.records)
    async with asyncio.timeout(WAIT):
        for step in steps:
            if step.startswith("call "):
                amount = int(step.removeprefix("call "))
                if not faults.hang_claim:
                    trace.append(await call(amount))
                    continue
                cut = asyncio.create_task(call(amount))
                await faults.landed.wait()
                cut.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await cut
                trace.append("cancelled")
            elif step == "hold":
                handler.hold_next = True
                held = asyncio.create_task(call(1))
                await handler.entered.wait()
                trace.append("held")
            elif step == "wait":
                pass  # the adapter was built with a bounded wait
            elif step == "waiting call 1":
                waiter = asyncio.create_task(call(1))
                while not waiting():  # noqa: ASYNC110  # polled: joining has no signal
                    await asyncio.sleep(0.01)
                trace.append("waiting")
            elif step == "waited":
                assert waiter is not None
                trace.append(await waiter)
            elif step == "let go":
                assert held is not None
                handler.gate.set()
                trace.append(await held)
            elif step == "fail":
                handler.fail_next = True
            elif step == "refuse complete":
                faults.refuse_complete = True
            elif step == "refuse commit":
                faults.refuse_commit = True
            elif step == "refuse releases":
                faults.refuse_releases = True
            elif step == "hang claim":
                faults.hang_claim = True
            elif step == "record":
                trace.append(await record_state(store, key))
            elif step == "settle":
                # Polled: the completion's retry and the orphan's release run in the
                # guard's background, which has no signal to wait on.
                while (state := await record_state(store, key)) == "in_progress":  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                trace.append(state)
            elif step == "await error":
                while not (errors := _store_errors(caplog.records[seen:])):  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                error = errors[0]
                seen = caplog.records.index(error) + 1
                where = "on its route" if error.__dict__["route"] == route else "elsewhere"
                trace.append(f"store_error {error.__dict__['phase']} {where}")
            else:
                raise AssertionError(f"unknown step {step!r}")
    return trace


def _store_errors(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.__dict__.get("event") == "idempotency.store_error"]


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.postgres)])
async def real_store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    async with open_store(request, request.param) as opened:
        yield opened


@pytest.mark.parametrize(("row", "steps", "expected"), ROWS, ids=[row for row, _, _ in ROWS])
async def test_http_and_once_agree_on_every_lifecycle_event(
    real_store: Store,
    caplog: pytest.LogCaptureFixture,
    row: str,
    steps: list[str],
    expected: list[str],
) -> None:
    traces = {}  # each adapter's record has a key of its own: they share the store
    with caplog.at_level(logging.WARNING, logger="asgi_idempotency"):
        for name, adapter in ADAPTERS.items():
            traces[name] = await play(adapter, real_store, steps, caplog)
    assert traces == dict.fromkeys(ADAPTERS, expected)


@pytest.mark.parametrize(("row", "steps", "expected"), TX_ROWS, ids=[row for row, _, _ in TX_ROWS])
async def test_every_adapter_agrees_in_transactional_mode(
    tx_store: Store,
    caplog: pytest.LogCaptureFixture,
    row: str,
    steps: list[str],
    expected: list[str],
) -> None:
    traces = {}
    with caplog.at_level(logging.WARNING, logger="asgi_idempotency"):
        for name, adapter in ADAPTERS.items():
            traces[name] = await play(adapter, tx_store, steps, caplog, transactional=True)
    assert traces == dict.fromkeys(ADAPTERS, expected)

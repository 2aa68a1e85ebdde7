"""OutboundLedger against a real non-idempotent refund service on loopback, SQLite and Postgres.

The service creates a refund on every POST, key or no key, and sometimes answers
after the client has stopped waiting. Each scenario counts refunds per order: the
ledger must keep that count at one wherever its read-back can see the effect.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import pytest
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency.client import (
    AsyncIdempotentTransport,
    LedgerConflict,
    LedgerStatus,
    OutboundLedger,
    OutcomeUnknown,
    RetryPolicy,
    canonical_json,
    derive_key,
    ledger_metadata,
    ledger_table,
    random_key,
)
from asgi_idempotency.ops._serve import serve_in_thread

pytestmark = pytest.mark.anyio

READ_TIMEOUT = 0.5
FAST = RetryPolicy(attempts=4, timeout=10.0, wait_initial=0.01, wait_max=0.05, wait_jitter=0.01)


@dataclass(frozen=True)
class Plan:
    """One call at the service: sleep ``before``, create the refund, sleep ``after``, answer."""

    before: float = 0.0
    after: float = 0.0
    status: int = 201


@dataclass
class RefundService:
    """POST /refunds creates a refund every time; GET /refunds?order_id= lists an order's."""

    plans: dict[str, list[Plan]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    refunds: list[dict[str, object]] = field(default_factory=list)
    active: dict[str, int] = field(default_factory=dict)  # handlers still running, per order

    def app(self) -> Starlette:
        async def create(request: Request) -> Response:
            body = await request.json()
            order = str(body["order_id"])
            n = self.calls.get(order, 0)
            self.calls[order] = n + 1
            plans = self.plans.get(order, [Plan()])
            plan = plans[min(n, len(plans) - 1)]
            self.active[order] = self.active.get(order, 0) + 1
            try:
                await anyio.sleep(plan.before)
                if plan.status >= 400:
                    return JSONResponse({"error": "refused"}, plan.status)
                refund = {
                    "id": f"re_{len(self.refunds) + 1}",
                    "order_id": order,
                    "amount": body["amount"],
                }
                self.refunds.append(refund)
                await anyio.sleep(plan.after)
                return JSONResponse(refund, plan.status)
            finally:
                self.active[order] -= 1

        async def listing(request: Request) -> Response:
            order = request.query_params["order_id"]
            return JSONResponse([r for r in self.refunds if r["order_id"] == order])

        return Starlette(
            routes=[
                Route("/refunds", create, methods=["POST"]),
                Route("/refunds", listing, methods=["GET"]),
            ]
        )

    def count(self, order: str) -> int:
        return sum(1 for r in self.refunds if r["order_id"] == order)


@pytest.fixture(scope="module")
def _refund_server() -> Iterator[tuple[RefundService, str]]:
    service = RefundService()
    with serve_in_thread(service.app()) as url:
        yield service, url


@pytest.fixture
def refunds(_refund_server: tuple[RefundService, str]) -> tuple[RefundService, str]:
    """The module's service; tests use fresh order ids, so state never crosses tests."""
    return _refund_server


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def engine(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    engine = create_async_engine(url)
    try:
        await OutboundLedger(engine).create_all()
        yield engine
    finally:
        await engine.dispose()


def _order() -> str:
    return f"ord_{uuid.uuid4().hex[:10]}"


@dataclass
class Caller:
    """The refund call and its read-back, as an application would write them."""

    http: httpx.AsyncClient
    order: str
    amount: int = 4500
    read_backs: int = 0

    async def call(self) -> bytes:
        response = await self.http.post(
            "/refunds", json={"order_id": self.order, "amount": self.amount}
        )
        response.raise_for_status()
        return canonical_json(response.json())

    async def read_back(self) -> bytes | None:
        # "List refunds for this order": the service's own view of what happened.
        self.read_backs += 1
        response = await self.http.get("/refunds", params={"order_id": self.order})
        response.raise_for_status()
        found = response.json()
        return canonical_json(found[0]) if found else None


async def _settled(service: RefundService, order: str, within: float = 3.0) -> int:
    """Wait (bounded) until no handler for ``order`` is still running; its refund count."""
    with anyio.fail_after(within):
        # Polling, not an Event: the handlers run on the server thread's own loop.
        while service.active.get(order, 0):  # noqa: ASYNC110
            await anyio.sleep(0.01)
    return service.count(order)


def _client(url: str, read: float = READ_TIMEOUT) -> httpx.AsyncClient:
    # Only reads are cut short; connects get room on a loaded machine.
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(5.0, read=read))


# --- the scenario: the service acts, then answers after the client's timeout ----------


async def test_without_the_ledger_a_retry_duplicates(refunds: tuple[RefundService, str]) -> None:
    """Control: a key the service ignores does not help; the retry refunds twice."""
    service, url = refunds
    order = _order()
    service.plans[order] = [Plan(after=1.0), Plan()]
    transport = AsyncIdempotentTransport(policy=FAST, key_for=random_key)
    timeout = httpx.Timeout(5.0, read=READ_TIMEOUT)
    async with httpx.AsyncClient(transport=transport, base_url=url, timeout=timeout) as http:
        response = await http.post("/refunds", json={"order_id": order, "amount": 4500})
    assert response.status_code == 201
    assert await _settled(service, order) == 2


async def test_ledger_reads_back_instead_of_duplicating(
    refunds: tuple[RefundService, str], engine: AsyncEngine
) -> None:
    service, url = refunds
    order = _order()
    service.plans[order] = [Plan(after=1.0), Plan()]
    ledger = OutboundLedger(engine, policy=FAST)
    key = derive_key("run-1", 0, "refund", {"order_id": order, "amount": 4500})
    async with _client(url) as http:
        caller = Caller(http, order)
        result = await ledger.run(key, caller.call, read_back=caller.read_back)
    assert json.loads(result)["order_id"] == order
    assert caller.read_backs == 1
    assert await _settled(service, order) == 1
    entry = await ledger.get(key)
    assert entry is not None
    assert entry.status is LedgerStatus.SUCCEEDED
    assert entry.result == result
    assert entry.created_at <= entry.updated_at
    assert entry.created_at.tzinfo is not None


@pytest.mark.parametrize(
    ("lands_after", "settle", "refunds_settled"),
    [
        # The effect happens 0.8 s in, after the client's 0.5 s timeout, before read-back.
        pytest.param(0.8, 0.7, 1, id="lands-within-settle-is-found"),
        # Documented limit: a request still in flight when read-back runs lands later.
        pytest.param(1.5, 0.05, 2, id="the-window-read-back-cannot-close"),
    ],
)
async def test_a_slow_request_and_read_back(
    refunds: tuple[RefundService, str],
    engine: AsyncEngine,
    lands_after: float,
    settle: float,
    refunds_settled: int,
) -> None:
    service, url = refunds
    order = _order()
    service.plans[order] = [Plan(before=lands_after), Plan()]
    ledger = OutboundLedger(engine, policy=FAST, settle=settle)
    async with _client(url) as http:
        caller = Caller(http, order)
        await ledger.run(f"k-{order}", caller.call, read_back=caller.read_back)
    assert await _settled(service, order) == refunds_settled


async def test_duplicate_rate_is_zero_across_mixed_timings(
    refunds: tuple[RefundService, str], engine: AsyncEngine
) -> None:
    """Twelve refunds at once; some answer late, some land late but within settle."""
    service, url = refunds
    rng = random.Random(20240501)
    shapes = [[Plan()], [Plan(after=0.9), Plan()], [Plan(before=0.7), Plan()]]
    orders = [_order() for _ in range(12)]
    for order in orders:
        service.plans[order] = rng.choice(shapes)
    ledger = OutboundLedger(engine, policy=FAST, settle=0.6)

    async with _client(url) as http:

        async def one(order: str) -> None:
            caller = Caller(http, order)
            key = derive_key("run-mixed", orders.index(order), "refund", {"order_id": order})
            await ledger.run(key, caller.call, read_back=caller.read_back)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for order in orders:
                    tg.start_soon(one, order)

    counts = [await _settled(service, order) for order in orders]
    assert counts == [1] * len(orders)
    assert {len(service.plans[o]) for o in orders} == {1, 2}  # the mix really was mixed


# --- racing workers -------------------------------------------------------------------


async def test_a_racing_worker_loses_at_the_insert(
    refunds: tuple[RefundService, str], engine: AsyncEngine
) -> None:
    service, url = refunds
    order = _order()
    service.plans[order] = [Plan(after=0.3)]
    ledger = OutboundLedger(engine, policy=FAST)
    key = f"k-{order}"
    started = anyio.Event()

    async with _client(url, read=5.0) as http:
        caller = Caller(http, order)

        async def first_call() -> bytes:
            started.set()
            return await caller.call()

        results: list[bytes] = []

        async def first() -> None:
            results.append(await ledger.run(key, first_call))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                await started.wait()  # the first worker holds the row and is calling
                with pytest.raises(LedgerConflict) as conflict:
                    await ledger.run(key, caller.call)
        assert conflict.value.entry.status is LedgerStatus.PENDING
        # Once the first worker finished, a late worker gets the recorded result.
        assert await ledger.run(key, caller.call) == results[0]
    assert service.calls[order] == 1


async def test_many_simultaneous_workers_call_once(
    refunds: tuple[RefundService, str], engine: AsyncEngine
) -> None:
    service, url = refunds
    order = _order()
    service.plans[order] = [Plan(after=0.2)]
    ledger = OutboundLedger(engine, policy=FAST)
    outcomes: list[str] = []

    async with _client(url, read=5.0) as http:
        caller = Caller(http, order)

        async def worker() -> None:
            try:
                await ledger.run(f"k-{order}", caller.call)
                outcomes.append("result")
            except LedgerConflict:
                outcomes.append("conflict")

        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(worker)
    assert service.calls[order] == 1
    assert len(outcomes) == 6
    assert "result" in outcomes


# --- the other outcomes ---------------------------------------------------------------


async def test_nothing_sent_is_retried_without_read_back(
    engine: AsyncEngine, refused_url: str
) -> None:
    ledger = OutboundLedger(engine, policy=FAST)
    attempts = 0
    read_backs = 0

    async def call() -> bytes:
        nonlocal attempts
        attempts += 1
        async with httpx.AsyncClient(timeout=1.0) as http:
            if attempts < 3:  # nothing listens there: a ConnectError, nothing sent
                await http.post(f"{refused_url}/refunds")
        return b"done"

    async def read_back() -> bytes | None:
        nonlocal read_backs
        read_backs += 1
        return None

    assert await ledger.run(f"k-{uuid.uuid4()}", call, read_back=read_back) == b"done"
    assert (attempts, read_backs) == (3, 0)


async def test_a_refusal_is_failed_and_may_be_claimed_again(
    refunds: tuple[RefundService, str], engine: AsyncEngine
) -> None:
    service, url = refunds
    order = _order()
    service.plans[order] = [Plan(status=422), Plan()]
    ledger = OutboundLedger(engine, policy=FAST)
    key = f"k-{order}"
    async with _client(url) as http:
        caller = Caller(http, order)
        with pytest.raises(httpx.HTTPStatusError):
            await ledger.run(key, caller.call, read_back=caller.read_back)
        entry = await ledger.get(key)
        assert entry is not None
        assert entry.status is LedgerStatus.FAILED
        assert caller.read_backs == 0  # a refusal is not ambiguous
        await ledger.run(key, caller.call, read_back=caller.read_back)
    assert service.count(order) == 1
    assert service.calls[order] == 2


async def test_without_read_back_an_ambiguous_failure_is_unknown(
    refunds: tuple[RefundService, str], engine: AsyncEngine
) -> None:
    service, url = refunds
    order = _order()
    service.plans[order] = [Plan(after=1.0), Plan()]
    ledger = OutboundLedger(engine, policy=FAST)
    key = f"k-{order}"
    async with _client(url) as http:
        caller = Caller(http, order)
        with pytest.raises(OutcomeUnknown) as unknown:
            await ledger.run(key, caller.call)
        assert isinstance(unknown.value.__cause__, httpx.ReadTimeout)
        assert "no read-back, not retried" in str(unknown.value)
        # Never called blindly again...
        with pytest.raises(LedgerConflict) as conflict:
            await ledger.run(key, caller.call)
        assert conflict.value.entry.status is LedgerStatus.UNKNOWN
        # ...but a later run with a read-back settles it without calling.
        found = await ledger.run(key, caller.call, read_back=caller.read_back)
    assert json.loads(found)["order_id"] == order
    entry = await ledger.get(key)
    assert entry is not None
    assert entry.status is LedgerStatus.SUCCEEDED
    assert service.calls[order] == 1


async def test_read_back_finding_nothing_until_the_budget_ends_is_unknown(
    refunds: tuple[RefundService, str], engine: AsyncEngine
) -> None:
    service, url = refunds
    order = _order()
    # Attempt 1 lands at 1.8 s; both read-backs (about 0.5 s and 1.0 s) come before it.
    service.plans[order] = [Plan(before=1.8)]
    policy = RetryPolicy(attempts=2, timeout=10.0, wait_initial=0.01, wait_max=0.01, wait_jitter=0)
    ledger = OutboundLedger(engine, policy=policy)
    async with _client(url) as http:
        caller = Caller(http, order)
        with pytest.raises(OutcomeUnknown) as unknown:
            await ledger.run(f"k-{order}", caller.call, read_back=caller.read_back)
    reasons = [a.reason for a in unknown.value.attempts]
    assert reasons == ["ReadTimeout; read-back found nothing; retrying"] * 2
    entry = await ledger.get(f"k-{order}")
    assert entry is not None
    assert entry.status is LedgerStatus.UNKNOWN


async def test_cancellation_mid_call_leaves_unknown_not_pending(
    refunds: tuple[RefundService, str], engine: AsyncEngine
) -> None:
    service, url = refunds
    order = _order()
    service.plans[order] = [Plan(after=0.5)]
    ledger = OutboundLedger(engine, policy=FAST)
    key = f"k-{order}"
    async with _client(url, read=5.0) as http:
        caller = Caller(http, order)
        with anyio.move_on_after(0.2) as scope:
            await ledger.run(key, caller.call)
    assert scope.cancelled_caught
    entry = await ledger.get(key)
    assert entry is not None
    assert entry.status is LedgerStatus.UNKNOWN


async def test_cancellation_during_backoff_after_nothing_was_sent_is_failed(
    engine: AsyncEngine, refused_url: str
) -> None:
    slow_backoff = RetryPolicy(attempts=5, timeout=10.0, wait_initial=5.0, wait_jitter=0)
    ledger = OutboundLedger(engine, policy=slow_backoff)
    key = f"k-{uuid.uuid4()}"

    async def call() -> bytes:
        async with httpx.AsyncClient(timeout=1.0) as http:
            await http.post(f"{refused_url}/refunds")
        return b"unreachable"

    with anyio.move_on_after(0.5) as scope:
        await ledger.run(key, call)
    assert scope.cancelled_caught
    entry = await ledger.get(key)
    assert entry is not None
    assert entry.status is LedgerStatus.FAILED


async def test_forget_lets_an_operator_reopen_a_key(engine: AsyncEngine) -> None:
    ledger = OutboundLedger(engine, policy=FAST)
    key = f"k-{uuid.uuid4()}"

    async def call() -> bytes:
        return b"first"

    async def again() -> bytes:
        return b"second"

    assert await ledger.run(key, call) == b"first"
    assert await ledger.run(key, again) == b"first"
    assert await ledger.forget(key)
    assert not await ledger.forget(key)
    assert await ledger.run(key, again) == b"second"


async def test_the_table(engine: AsyncEngine) -> None:
    assert ledger_table.name == "idempotency_outbound_ledger"
    assert ledger_table.metadata is ledger_metadata
    assert [c.name for c in ledger_table.primary_key] == ["key"]

    def columns(sync_conn: object) -> set[str]:
        return {c["name"] for c in inspect(sync_conn).get_columns(ledger_table.name)}

    async with engine.connect() as conn:
        found = await conn.run_sync(columns)
    assert found == {"key", "status", "result", "created_at", "updated_at"}


async def test_settle_must_not_be_negative(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="settle"):
        OutboundLedger(engine, settle=-1)

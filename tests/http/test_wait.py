"""``Policy(wait=...)`` and ``Once(wait=...)``: a duplicate may wait for the first's answer.

On every store: a duplicate that arrives while the first runs waits and gets the
first's stored response byte for byte (the handler ran once); past ``wait`` it gets
409; a first that fails (5xx, released) lets exactly one waiter run the handler and
the others get that one's answer, never a stale one. Each both with the first in the
same process (its waiters are told when it ends) and in another (a second middleware
on the same store: its waiters read the store). Waiting costs one read per pause per
process and key, however many duplicates wait. The storm over real uvicorn and
Postgres is ``tests/reliability/test_wait_storm.py``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Header
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asgi_idempotency import (
    IdempotencyMiddleware,
    InProgress,
    MemoryStore,
    Once,
    Policy,
    StoreError,
    idempotent,
)
from asgi_idempotency.core.waiting import POLL_FIRST, POLL_MAX, Waiters
from asgi_idempotency.http.principals import ANONYMOUS, from_dependency
from asgi_idempotency.stores.base import Record
from tests.apps import guarded
from tests.conftest import open_store
from tests.http.test_garbage import ROUNDS as GARBAGE_ROUNDS
from tests.http.test_garbage import Gate
from tests.http.test_garbage import _app as garbage_app
from tests.http.test_garbage import _call as call
from tests.http.test_garbage import _garbage as garbage

pytestmark = pytest.mark.anyio

LONG = timedelta(seconds=20)  # a wait no passing test comes near (at most the lease)
KEY = {"Idempotency-Key": "refund-A-88214"}
BODY = {"order": "A-88214", "amount_p": 4500}


async def until(condition: Callable[[], bool], within: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


@dataclass
class Handler:
    """``POST /refunds``: the first run waits on ``gate``; run n answers ``statuses[n-1]``
    (the last one for every later run) after ``slow[n]`` seconds."""

    statuses: list[int] = field(default_factory=lambda: [201])
    slow: dict[int, float] = field(default_factory=dict)  # run -> seconds it takes
    runs: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def endpoint(self, request: Request) -> Response:
        self.runs += 1
        run = self.runs
        await request.body()
        if run == 1:
            self.started.set()
            await self.gate.wait()
        await asyncio.sleep(self.slow.get(run, 0))
        status = self.statuses[min(run, len(self.statuses)) - 1]
        return JSONResponse(
            {"run": run, "refund": uuid.uuid4().hex},
            status_code=status,
            headers={"x-run": str(run)},
        )


def build(store: Any, handler: Handler, wait: timedelta) -> Starlette:
    """One app: a middleware of its own, as one process has (its own waiters)."""
    policy = Policy(required=True, wait=wait, lease=timedelta(seconds=30))
    return guarded(
        store, handler.endpoint, path="/refunds", retry_after=1.0,
        policies={"POST /refunds": policy},
    )  # fmt: skip


def waiters(app: Starlette) -> Waiters:
    return IdempotencyMiddleware.of(app)._runtime.runner.waiters


def waiting(app: Starlette) -> int:
    """How many duplicates wait in ``app`` (0 before its first request built it)."""
    try:
        return waiters(app).waiting()
    except LookupError:
        return 0


@pytest.fixture
async def clients() -> AsyncIterator[Callable[[Starlette], httpx.AsyncClient]]:
    async with AsyncExitStack() as stack:

        def client(app: Starlette) -> httpx.AsyncClient:
            made = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30
            )
            stack.push_async_callback(made.aclose)
            return made

        yield client


def post(client: httpx.AsyncClient) -> asyncio.Task[httpx.Response]:
    return asyncio.ensure_future(client.post("/refunds", headers=KEY, json=BODY))


def waited_outcomes(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The outcomes of the ``idempotency.waited`` events logged (digests only, no key)."""
    events = [r for r in caplog.records if getattr(r, "event", "") == "idempotency.waited"]
    assert all(KEY["Idempotency-Key"] not in r.getMessage() for r in events)
    return [str(getattr(r, "outcome", "")) for r in events]


def replayed(response: httpx.Response) -> bool:
    return bool(response.headers.get("idempotent-replayed") == "true")


def without_replay_mark(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in response.headers.raw if k.lower() != b"idempotent-replayed"]


@pytest.mark.parametrize("first_runs", ["here", "elsewhere"])
async def test_a_duplicate_waits_and_gets_the_first_answer_byte_for_byte(
    store: Any,
    clients: Callable[[Starlette], httpx.AsyncClient],
    first_runs: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_idempotency")
    handler = Handler()
    first_app = build(store, handler, LONG)
    dup_app = first_app if first_runs == "here" else build(store, handler, LONG)
    first = post(clients(first_app))
    await asyncio.wait_for(handler.started.wait(), 15)
    duplicate = post(clients(dup_app))
    await until(lambda: waiting(dup_app) == 1)
    await asyncio.sleep(0.2)  # a few pauses of reading, for the first elsewhere
    assert not duplicate.done()  # it waits, where it used to get 409 at once
    handler.gate.set()
    original, again = await first, await duplicate
    assert handler.runs == 1
    assert original.status_code == 201
    assert not replayed(original)
    assert again.status_code == 201
    assert replayed(again)
    assert again.content == original.content
    assert sorted(without_replay_mark(again)) == sorted(original.headers.raw)
    assert waiting(dup_app) == 0
    assert waited_outcomes(caplog) == ["completed"]


@pytest.mark.parametrize("first_runs", ["here", "elsewhere"])
async def test_past_its_wait_a_duplicate_gets_409_and_the_first_still_answers(
    store: Any,
    clients: Callable[[Starlette], httpx.AsyncClient],
    first_runs: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_idempotency")
    handler = Handler()
    bound = timedelta(seconds=0.5)
    first_app = build(store, handler, bound)
    dup_app = first_app if first_runs == "here" else build(store, handler, bound)
    first = post(clients(first_app))
    await asyncio.wait_for(handler.started.wait(), 15)
    began = time.monotonic()
    conflict = await post(clients(dup_app))
    waited = time.monotonic() - began
    assert conflict.status_code == 409
    assert conflict.headers["content-type"] == "application/problem+json"
    assert 0 < float(conflict.headers["retry-after"]) <= 1
    assert waited >= bound.total_seconds()
    assert not first.done()
    handler.gate.set()
    original = await first
    assert original.status_code == 201
    assert handler.runs == 1
    assert waiting(dup_app) == 0
    assert waited_outcomes(caplog) == ["in_progress"]


@pytest.mark.parametrize("first_runs", ["here", "elsewhere", "two other processes"])
async def test_when_the_first_fails_one_waiter_runs_and_the_others_get_its_answer(
    store: Any, clients: Callable[[Starlette], httpx.AsyncClient], first_runs: str
) -> None:
    handler = Handler(statuses=[503, 201])
    first_app = build(store, handler, LONG)
    if first_runs == "here":
        apps = [first_app] * 4
    elif first_runs == "elsewhere":
        apps = [build(store, handler, LONG)] * 4
    else:  # each of two processes has waiters, and one claimant of its own
        one, two = build(store, handler, LONG), build(store, handler, LONG)
        apps = [one, one, two, two]
    first = post(clients(first_app))
    await asyncio.wait_for(handler.started.wait(), 15)
    duplicates = [post(clients(app)) for app in apps]
    await until(lambda: sum(waiting(app) for app in set(apps)) == len(apps))
    handler.gate.set()
    failed = await first
    answers = [await d for d in duplicates]
    assert failed.status_code == 503  # released: nothing stored
    assert handler.runs == 2  # the first, and exactly one waiter
    assert [a.status_code for a in answers] == [201] * len(answers)
    ran = [a for a in answers if not replayed(a)]
    assert len(ran) == 1
    assert ran[0].json()["run"] == 2
    for other in answers:  # every other waiter: the one that ran, never the failure
        assert other.content == ran[0].content


async def test_a_waiter_whose_first_fails_gets_409_if_the_rerun_outlasts_its_wait(
    clients: Callable[[Starlette], httpx.AsyncClient],
) -> None:
    handler = Handler(statuses=[500, 201], slow={2: 3.0})  # the waiter that claims runs long
    app = build(MemoryStore(), handler, timedelta(seconds=1))
    first = post(clients(app))
    await asyncio.wait_for(handler.started.wait(), 15)
    duplicates = [post(clients(app)) for _ in range(2)]
    await until(lambda: waiting(app) == 2)
    handler.gate.set()
    assert (await first).status_code == 500
    answers = sorted(r.status_code for r in await asyncio.gather(*duplicates))
    assert answers == [201, 409]  # the one that ran; the other, past its wait
    assert handler.runs == 2


class UnreadableStore(MemoryStore):
    """Claims work; every read fails, as when the store stops answering mid-wait."""

    async def get(self, key: str) -> Record | None:
        raise StoreError("the store did not answer")


async def test_a_waiter_whose_reads_fail_gets_503_not_409(
    clients: Callable[[Starlette], httpx.AsyncClient],
) -> None:
    store = UnreadableStore()
    handler = Handler()
    bound = timedelta(seconds=0.5)
    first_app, dup_app = build(store, handler, bound), build(store, handler, bound)
    first = post(clients(first_app))
    await asyncio.wait_for(handler.started.wait(), 15)
    unavailable = await post(clients(dup_app))
    assert unavailable.status_code == 503  # not known whether the first ended
    assert "retry-after" in unavailable.headers
    assert "did not answer" not in unavailable.text  # the reason goes to the log only
    handler.gate.set()
    assert (await first).status_code == 201
    assert handler.runs == 1


async def test_a_duplicate_waits_when_the_claim_waits_for_fastapis_auth_dependency() -> None:
    """``from_dependency``: the claim, and so the wait, happen inside FastAPI's
    resolution of the route's dependencies; another caller's key is not waited on."""
    app = FastAPI()
    gate, started, runs = asyncio.Event(), asyncio.Event(), [0]
    users = {"tok-alice": "alice", "tok-bob": "bob"}

    def current_user(authorization: Annotated[str, Header()]) -> str:
        return users[authorization]

    @app.post("/refunds", status_code=201)
    @idempotent(required=True, wait=LONG, lease=timedelta(seconds=30))
    async def refund(user: str = Depends(current_user)) -> dict[str, Any]:
        runs[0] += 1
        run = runs[0]
        if run == 1:
            started.set()
            await gate.wait()
        return {"user": user, "run": run}

    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), principal=from_dependency(current_user)
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        alice = {**KEY, "authorization": "tok-alice"}
        first = asyncio.ensure_future(c.post("/refunds", headers=alice))
        await asyncio.wait_for(started.wait(), 15)
        duplicate = asyncio.ensure_future(c.post("/refunds", headers=alice))
        await until(lambda: waiters(app).waiting() == 1)
        bob = await c.post("/refunds", headers={**KEY, "authorization": "tok-bob"})
        assert bob.json() == {"user": "bob", "run": 2}  # his own key: runs at once
        gate.set()
        original, again = await first, await duplicate
    assert original.json() == {"user": "alice", "run": 1}
    assert again.content == original.content
    assert replayed(again)
    assert runs[0] == 2


# -- the policy ----------------------------------------------------------------


def test_wait_is_opt_in_and_bounded_by_the_lease() -> None:
    assert Policy().wait is None
    assert Policy(wait=timedelta(seconds=30)).wait == timedelta(seconds=30)  # = the lease
    with pytest.raises(ValueError, match="exceeds lease"):
        Policy(wait=timedelta(seconds=31))
    with pytest.raises(ValueError, match="exceeds lease"):
        Policy(lease=timedelta(seconds=5), wait=timedelta(seconds=6))
    with pytest.raises(ValueError, match="exceeds lease"):
        idempotent(ttl=timedelta(seconds=2), wait=timedelta(seconds=3))  # lease from ttl
    with pytest.raises(ValueError, match="transactional"):
        Policy(transactional=True, wait=timedelta(seconds=1))
    with pytest.raises(TypeError, match="bare number"):
        Policy(wait=5)  # type: ignore[arg-type]  # seconds or milliseconds?
    with pytest.raises(ValueError, match="positive"):
        Policy(wait=timedelta(0))


async def test_report_mode_does_not_wait(
    clients: Callable[[Starlette], httpx.AsyncClient],
) -> None:
    handler = Handler()
    policy = Policy(required=True, wait=LONG, mode="report")
    app = guarded(
        MemoryStore(), handler.endpoint, path="/refunds", policies={"POST /refunds": policy}
    )
    first = post(clients(app))
    await asyncio.wait_for(handler.started.wait(), 15)
    second = await asyncio.wait_for(post(clients(app)), 5)  # runs at once, unguarded answer
    assert second.status_code == 201
    assert handler.runs == 2
    handler.gate.set()
    assert (await first).status_code == 201


# -- the cost of waiting ----------------------------------------------------------


class CountingStore(MemoryStore):
    """A memory store that counts its reads and claims."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0
        self.inserts = 0

    async def get(self, key: str) -> Record | None:
        self.gets += 1
        return await super().get(key)

    async def insert(self, new: Any) -> Any:
        self.inserts += 1
        return await super().insert(new)


def reads_bound(seconds: float, poll_max: float = POLL_MAX) -> int:
    """Reads one watch makes in ``seconds``: doubling from POLL_FIRST to ``poll_max``."""
    reads, delay, spent = 0, POLL_FIRST, 0.0
    while spent < seconds:
        spent += delay
        reads += 1
        delay = min(delay * 2, poll_max)
    return reads + 2  # the read that finds the answer, and one in flight


@pytest.mark.parametrize("storm", [1, 100])
async def test_a_storm_of_waiters_elsewhere_costs_what_one_waiter_costs(
    clients: Callable[[Starlette], httpx.AsyncClient], storm: int
) -> None:
    store = CountingStore()
    handler = Handler()
    first_app, dup_app = build(store, handler, LONG), build(store, handler, LONG)
    first = post(clients(first_app))
    await asyncio.wait_for(handler.started.wait(), 15)
    dup_client = clients(dup_app)
    duplicates = [post(dup_client) for _ in range(storm)]
    await until(lambda: waiting(dup_app) == storm)
    began, gets, inserts = time.monotonic(), store.gets, store.inserts
    await asyncio.sleep(1.5)
    handler.gate.set()
    answers = await asyncio.gather(*duplicates)
    held = time.monotonic() - began
    assert {(a.status_code, replayed(a)) for a in answers} == {(201, True)}
    assert handler.runs == 1
    assert store.gets - gets <= reads_bound(held), (store.gets - gets, held)
    assert store.inserts == inserts  # no waiter claims again while the first runs
    await first


async def test_waiters_of_a_first_in_the_same_process_read_the_store_once(
    clients: Callable[[Starlette], httpx.AsyncClient],
) -> None:
    store = CountingStore()
    handler = Handler()
    app = build(store, handler, LONG)
    first = post(clients(app))
    await asyncio.wait_for(handler.started.wait(), 15)
    duplicates = [post(clients(app)) for _ in range(100)]
    await until(lambda: waiting(app) == 100)
    await asyncio.sleep(1.0)
    assert store.gets == 0  # told when the first ends; nothing read meanwhile
    handler.gate.set()
    answers = await asyncio.gather(*duplicates)
    assert {(a.status_code, replayed(a)) for a in answers} == {(201, True)}
    assert store.gets <= 2
    await first


# -- Once, through the same waiters -----------------------------------------------


async def test_once_waiters_elsewhere_read_the_store_once_per_pause() -> None:
    store = CountingStore()
    gate = asyncio.Event()
    runs: list[int] = []

    async def charge(order: str) -> dict[str, Any]:
        runs.append(1)
        await gate.wait()
        return {"order": order, "run": len(runs)}

    holder = Once(store, namespace="charges")
    waiting = Once(store, namespace="charges", wait=LONG)  # another process's guard
    first = asyncio.ensure_future(holder.call("A-1", charge, "A-1"))
    await until(lambda: len(runs) == 1)
    calls = [asyncio.ensure_future(waiting.call("A-1", charge, "A-1")) for _ in range(50)]
    await until(lambda: waiting._core.waiters.waiting() == 50)
    began, gets = time.monotonic(), store.gets
    await asyncio.sleep(1.0)
    gate.set()
    results = await asyncio.gather(first, *calls)
    assert results == [{"order": "A-1", "run": 1}] * 51
    assert len(runs) == 1
    assert store.gets - gets <= reads_bound(time.monotonic() - began)


async def test_once_waiters_of_a_failing_holder_run_it_once_more() -> None:
    store = CountingStore()
    gate = asyncio.Event()
    runs: list[int] = []

    async def charge(order: str) -> dict[str, Any]:
        runs.append(1)
        if len(runs) == 1:
            await gate.wait()
            raise RuntimeError("the card network is down")
        return {"order": order, "run": len(runs)}

    once = Once(store, namespace="charges", wait=LONG)
    first = asyncio.ensure_future(once.call("A-1", charge, "A-1"))
    await until(lambda: len(runs) == 1)
    calls = [asyncio.ensure_future(once.call("A-1", charge, "A-1")) for _ in range(10)]
    await until(lambda: once._core.waiters.waiting() == 10)
    gate.set()
    with pytest.raises(RuntimeError, match="card network"):
        await first
    assert await asyncio.gather(*calls) == [{"order": "A-1", "run": 2}] * 10
    assert len(runs) == 2


async def test_once_without_wait_raises_in_progress_at_once() -> None:
    store = MemoryStore()
    gate = asyncio.Event()

    async def charge(order: str) -> str:
        await gate.wait()
        return order

    once = Once(store, namespace="charges")
    first = asyncio.ensure_future(once.call("A-1", charge, "A-1"))
    await asyncio.sleep(0.05)
    with pytest.raises(InProgress):
        await asyncio.wait_for(once.call("A-1", charge, "A-1"), 1)
    gate.set()
    assert await first == "A-1"


# -- no cyclic garbage (tests/http/test_garbage.py's measure, for a duplicate that waits) --


@pytest.mark.parametrize("ends", ["replayed", "past its wait"])
@pytest.mark.parametrize(
    "kind",
    ["memory", pytest.param("postgres_batched", marks=pytest.mark.postgres),
     pytest.param("redis", marks=pytest.mark.redis)],
)  # fmt: skip
async def test_a_waiting_duplicate_leaves_no_cyclic_garbage(
    request: pytest.FixtureRequest, kind: str, ends: str
) -> None:
    async with open_store(request, kind) as store:
        await waits_without_garbage(store, ends)


async def waits_without_garbage(store: Any, ends: str) -> None:
    gate = Gate()
    wait = timedelta(seconds=20 if ends == "replayed" else 0.05)
    app = IdempotencyMiddleware(
        garbage_app(gate), store=store, principal=ANONYMOUS, default_policy=Policy(wait=wait)
    )

    async def rounds(tag: str) -> None:
        for i in range(GARBAGE_ROUNDS):
            gate.entered.clear()
            gate.opened.clear()
            first = asyncio.ensure_future(call(app, f"{tag}-{i}", b'{"wait": true}'))
            await gate.entered.wait()
            duplicate = asyncio.ensure_future(call(app, f"{tag}-{i}", b'{"wait": true}'))
            if ends == "replayed":
                await until(lambda: app._runtime.runner.waiters.waiting() == 1)
                gate.opened.set()
                assert await duplicate == 201
            else:
                assert await duplicate == 409
                gate.opened.set()
            assert await first == 201
            del first, duplicate

    gc.collect()
    gc.disable()
    try:
        await rounds("warm")
        extra = await garbage(lambda: rounds("counted"))
    finally:
        gc.enable()
    assert sum(extra.values()) < GARBAGE_ROUNDS, f"cyclic garbage left: {extra.most_common(8)}"

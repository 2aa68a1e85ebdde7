"""A claim whose requester went away while it was in flight is released, on every store.

The claim's statement lands, and its requester is cancelled before the answer reaches
it (a client gone, a server shutting down, a consumer stopped): nothing ran, so the
key must not answer 409 until the lease ends. The middleware and the function guard
hand such a claim to :func:`lifecycle.release_orphan`; the next attempt runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Literal

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_idempotency import Once
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.functions.once import record_key
from asgi_idempotency.stores.base import Busy, NewClaim, Record, Store
from asgi_idempotency.stores.memory import MemoryStore
from tests.apps import guarded

pytestmark = pytest.mark.anyio

WAIT = 10.0  # seconds before a test fails rather than hangs


class LandsThenHangs:
    """The store, except that its first claim lands and its answer never comes back."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.landed = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def insert(self, new: NewClaim) -> Record | Literal[Busy.BUSY] | None:
        got = await self.inner.insert(new)
        if not self.landed.is_set():
            self.landed.set()
            await asyncio.Event().wait()  # until cancelled
        return got


async def gone(store: Store, key: str) -> None:
    # Polled: the release runs in the guard's background task, which has no signal.
    async with asyncio.timeout(WAIT):
        while await store.get(key) is not None:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_a_request_cancelled_during_its_claim_leaves_the_key_free(store: Store) -> None:
    runs = 0

    async def refund(request: Request) -> JSONResponse:
        nonlocal runs
        runs += 1
        return JSONResponse({"refund": runs}, status_code=201)

    hanging = LandsThenHangs(store)
    app = guarded(hanging, [Route("/refunds", refund, methods=["POST"])])
    headers = {"idempotency-key": "order-7"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://shop.test"
    ) as client:
        first = asyncio.create_task(client.post("/refunds", json={"a": 1}, headers=headers))
        async with asyncio.timeout(WAIT):
            await hanging.landed.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await gone(store, scoped_key("", "order-7", "shop.test"))
        retry = await client.post("/refunds", json={"a": 1}, headers=headers)
    assert (retry.status_code, runs) == (201, 1)


async def test_a_call_cancelled_during_its_claim_leaves_the_key_free(store: Store) -> None:
    hanging = LandsThenHangs(store)
    once = Once(hanging, namespace="orphans")
    runs = 0

    @once(key=lambda order: order)
    async def refund(order: str) -> int:
        nonlocal runs
        runs += 1
        return runs

    first = asyncio.create_task(refund("order-7"))
    async with asyncio.timeout(WAIT):
        await hanging.landed.wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await gone(store, record_key("orphans", "order-7"))
    assert (await refund("order-7"), runs) == (1, 1)


class MarkerHangs:
    """The store, except that the insert after the first (the regenerated-key detector's
    marker, made once the claim is the request's) never answers."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.inserts = 0
        self.marking = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def insert(self, new: NewClaim) -> Record | Literal[Busy.BUSY] | None:
        self.inserts += 1
        if self.inserts == 2:
            self.marking.set()
            await asyncio.Event().wait()  # until cancelled
        return await self.inner.insert(new)


async def test_a_request_cancelled_between_its_claim_and_its_handler_leaves_the_key_free(
    store: Store,
) -> None:
    # The claim is the request's (it landed and was answered); the detector's marker is
    # in flight when the request is cancelled: nothing ran, so the key must not answer
    # 409 until the lease ends.
    runs = 0

    async def refund(request: Request) -> JSONResponse:
        nonlocal runs
        runs += 1
        return JSONResponse({"refund": runs}, status_code=201)

    hanging = MarkerHangs(store)
    app = guarded(
        hanging,
        [Route("/refunds", refund, methods=["POST"])],
        detect_regenerated_keys=timedelta(seconds=60),
    )
    headers = {"idempotency-key": "order-8"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://shop.test"
    ) as client:
        first = asyncio.create_task(client.post("/refunds", json={"a": 1}, headers=headers))
        async with asyncio.timeout(WAIT):
            await hanging.marking.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await gone(store, scoped_key("", "order-8", "shop.test"))
        retry = await client.post("/refunds", json={"a": 1}, headers=headers)
    assert (retry.status_code, runs) == (201, 1)


class SignalsInsert(MemoryStore):
    """A memory store that says, across threads, when a claim's insert has answered."""

    def __init__(self) -> None:
        super().__init__()
        self.inserted = threading.Event()

    async def insert(self, new: NewClaim) -> Record | None:
        found = await super().insert(new)
        self.inserted.set()
        return found


async def test_a_call_cancelled_as_its_claim_comes_back_across_loops_leaves_the_key_free() -> None:
    # Once a synchronous call has started the guard's own loop, async calls claim there
    # too, and the answer crosses back to the caller's loop. A caller cancelled after
    # the claim was answered as its own, before the answer reached it, never runs the
    # function: the claim must not stay in progress, renewed, for as long as the
    # process lives.
    store = SignalsInsert()
    once = Once(store, namespace="crossing")
    runs = 0

    @once(key=lambda order: order)
    def warm_up(order: str) -> str:
        return order

    @once(key=lambda order: order)
    async def refund(order: str) -> int:
        nonlocal runs
        runs += 1
        return runs

    try:
        await asyncio.to_thread(warm_up, "warm-up")  # starts the guard's loop
        store.inserted.clear()
        first = asyncio.create_task(refund("order-7"))
        await asyncio.sleep(0)  # it sends its claim to the guard's loop and waits
        # This loop stays blocked (so the answer cannot reach the call) until the claim
        # was answered over there and its result settled.
        assert store.inserted.wait(WAIT)
        time.sleep(0.1)  # noqa: ASYNC251  # blocking on purpose: see above
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await gone(store, record_key("crossing", "order-7"))
        assert (await refund("order-7"), runs) == (1, 1)
    finally:
        once.close()


async def test_a_replay_whose_caller_was_cancelled_across_loops_is_dropped_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # As above, but the answer that never reaches its cancelled caller is a replay:
    # there is no claim to release, and nothing may fail on the guard's loop.
    store = SignalsInsert()
    once = Once(store, namespace="crossing")

    @once(key=lambda order: order)
    def warm_up(order: str) -> str:
        return order

    @once(key=lambda order: order)
    async def refund(order: str) -> str:
        return order

    try:
        await asyncio.to_thread(warm_up, "warm-up")  # starts the guard's loop
        assert await refund("order-9") == "order-9"
        store.inserted.clear()
        with caplog.at_level(logging.ERROR):
            second = asyncio.create_task(refund("order-9"))
            await asyncio.sleep(0)
            assert store.inserted.wait(WAIT)
            time.sleep(0.1)  # noqa: ASYNC251  # blocking on purpose, as above
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            # Through the guard's loop, after whatever the cancelled answer left there.
            assert await asyncio.to_thread(warm_up, "warm-up") == "warm-up"
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        once.close()

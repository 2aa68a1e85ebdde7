"""The responder's last duty: a completion that is cancelled or fails still lands, or is logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import (
    MemoryStore,
    Policy,
    SQLStore,
    StoredResponse,
    StoreError,
)
from asgi_idempotency.http.asgi import Message
from tests.apps import guarded
from tests.conftest import TinyFactory

pytestmark = pytest.mark.anyio


class CompletionFails(MemoryStore):
    """A store whose first completion hangs (the request is cancelled there) and whose
    second, run in the background, fails."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.calls = 0

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            await asyncio.Event().wait()
        raise StoreError("connection lost while completing")


async def test_a_failed_background_completion_is_logged_with_its_route_and_key_digest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def pay(request: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    store = CompletionFails()
    app = guarded(store, [Route("/pay", pay, methods=["POST"])])
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/pay", "raw_path": b"/pay", "query_string": b"",
        "root_path": "", "headers": [(b"idempotency-key", b"k-1"), (b"content-length", b"2")],
        "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {},
    }  # fmt: skip
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    request = asyncio.ensure_future(app(scope, receive, send))
    await store.entered.wait()
    with caplog.at_level(logging.ERROR, logger="asgi_idempotency"):
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        for _ in range(5):  # the background retry runs on the next turns of the loop
            await asyncio.sleep(0)
    assert store.calls == 2
    [record] = [r for r in caplog.records if getattr(r, "event", "") == "idempotency.store_error"]
    assert record.__dict__["route"] == "/pay"
    assert record.__dict__["phase"] == "complete"
    assert len(record.__dict__["key_digest"]) == 16
    assert "k-1" not in record.getMessage()


# A completion the store fails is tried again in the background (lifecycle.completion_retries)
# while the client already has its answer, under a renewed lease.

# Retries 0.1, 0.2 and 0.4 s apart after the failure; renewals every third of a second.
LEASE = timedelta(seconds=1)
POLICY = Policy(required=True, ttl=timedelta(hours=1), lease=LEASE)
KEY = "completion-fails"


class FlakyMemory(MemoryStore):
    """Fails its first ``failures`` completions; counts completions and renewals."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures, self.completes, self.renews = failures, 0, 0

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        self.completes += 1
        if self.completes <= self.failures:
            raise StoreError("connection lost while completing")
        return await super().complete(key, token, response, now=now, ttl=ttl)

    async def renew(self, key: str, token: str, *, now: datetime, lease: timedelta) -> bool:
        self.renews += 1
        return await super().renew(key, token, now=now, lease=lease)


class FlakySQLite(SQLStore):
    """The real SQLite store, failing its first ``failures`` completions the same way."""

    def __init__(self, url: str, failures: int) -> None:
        super().__init__(url)
        self.failures, self.completes, self.renews = failures, 0, 0

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        self.completes += 1
        if self.completes <= self.failures:
            raise StoreError("connection lost while completing")
        return await super().complete(key, token, response, now=now, ttl=ttl)

    async def renew(self, key: str, token: str, *, now: datetime, lease: timedelta) -> bool:
        self.renews += 1
        return await super().renew(key, token, now=now, lease=lease)


Flaky = FlakyMemory | FlakySQLite


@pytest.fixture(params=["memory", "sqlite"])
async def flaky(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[[int], Flaky]]:
    """``flaky(failures)``: a memory or SQLite store whose first completions fail."""
    made: list[Flaky] = []

    def make(failures: int) -> Flaky:
        store: Flaky
        if request.param == "memory":
            store = FlakyMemory(failures)
        else:
            store = FlakySQLite(f"sqlite+aiosqlite:///{tmp_path / 'flaky.db'}", failures)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def until(condition: Callable[[], bool], within: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def pay(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": KEY})


async def test_a_failed_completion_is_completed_in_the_background_and_replayed(
    flaky: Callable[[int], Flaky], tiny: TinyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = flaky(1)
    app = tiny(store, policies={"POST /pay": POLICY})
    with caplog.at_level(logging.INFO, logger="asgi_idempotency"):
        async with app.client() as client:
            first = await pay(client)
            assert first.status_code == 201  # at once: the failure is not the client's
            await until(lambda: store.completes == 2)
            replay = await pay(client)
    assert replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == first.json()
    assert app.calls == {"pay": 1}
    events = [(r.levelno, r.__dict__["event"]) for r in caplog.records if "event" in r.__dict__]
    assert (logging.ERROR, "idempotency.store_error") in events
    assert (logging.WARNING, "idempotency.complete_recovered") in events
    assert all(KEY not in r.getMessage() for r in caplog.records)


async def test_a_completion_that_keeps_failing_gives_up_within_the_lease(
    flaky: Callable[[int], Flaky], tiny: TinyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = flaky(1000)
    app = tiny(store, policies={"POST /pay": POLICY})
    with caplog.at_level(logging.WARNING, logger="asgi_idempotency"):
        async with app.client() as client:
            started = asyncio.get_running_loop().time()
            assert (await pay(client)).status_code == 201
            await until(lambda: any(
                r.__dict__.get("event") == "idempotency.complete_gave_up" for r in caplog.records
            ))  # fmt: skip
            assert asyncio.get_running_loop().time() - started < LEASE.total_seconds()
            # As before: the row stays in progress (409) until its lease ends.
            assert (await pay(client)).status_code == 409
            # The lease was renewed while it tried, and no longer once it gave up.
            assert store.renews >= 1
            renews = store.renews
            await asyncio.sleep(LEASE.total_seconds() / 2)
            assert store.renews == renews
    assert store.completes == 4  # the first and three more, at 0.1, 0.2 and 0.4 s
    assert app.calls == {"pay": 1}
    gave_up = [
        r for r in caplog.records if r.__dict__.get("event") == "idempotency.complete_gave_up"
    ]
    assert [(r.levelno, r.__dict__["attempts"]) for r in gave_up] == [(logging.ERROR, 4)]
    retries = [
        r for r in caplog.records if r.__dict__.get("event") == "idempotency.complete_retry_failed"
    ]
    assert [r.levelno for r in retries] == [logging.WARNING] * 3
    assert all(len(r.__dict__["key_digest"]) == 16 for r in gave_up + retries)
    assert all(KEY not in r.getMessage() for r in caplog.records)


class AnswerLost(MemoryStore):
    """Its first completion lands, but the answer is lost (a StoreError all the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.completes = 0

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        self.completes += 1
        done = await super().complete(key, token, response, now=now, ttl=ttl)
        if self.completes == 1:
            raise StoreError("connection lost after the write")
        return done


async def test_a_completion_that_had_landed_is_recovered_not_a_lost_claim(
    tiny: TinyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = AnswerLost()
    app = tiny(store, policies={"POST /pay": POLICY})
    with caplog.at_level(logging.WARNING, logger="asgi_idempotency"):
        async with app.client() as client:
            first = await pay(client)
            await until(lambda: any(
                r.__dict__.get("event") == "idempotency.complete_recovered" for r in caplog.records
            ))  # fmt: skip
            replay = await pay(client)
    assert (first.status_code, replay.headers["idempotent-replayed"]) == (201, "true")
    assert store.completes == 2
    events = [r.__dict__.get("event") for r in caplog.records]
    assert "idempotency.claim_lost" not in events

"""Postgres goes away mid-service, through a loopback TCP proxy the test cuts and restores.

Real Postgres, real asyncpg connections, real resets; the app runs in-process so the
test can count handler calls and read the rows directly (the probe bypasses the proxy).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.stores.base import RecordStatus

from .apps import refund_app
from .support import Probe, TcpProxy, close_bounded

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

PROBLEM = "application/problem+json"


def _key(name: str) -> dict[str, str]:
    return {"Idempotency-Key": name}


async def test_outage_fails_closed_then_the_same_process_recovers(
    pg_url: str, pg_proxy: TcpProxy, probe: Probe
) -> None:
    store = SQLStore(pg_proxy.url_for(pg_url), command_timeout=2)
    t = refund_app(store)
    try:
        async with asyncio.timeout(30), t.client() as c:  # bounded: a hang fails
            # Warm the pool: the cut must break a connection the pool believes is good.
            before = await c.post("/refunds", json={"amount": 1}, headers=_key("before"))
            assert before.status_code == 201
            pg_proxy.cut()

            down = [
                await c.post("/refunds", json={"amount": 2}, headers=_key(f"down-{i}"))
                for i in range(3)
            ]
            unguarded = await c.post("/notes", json={"n": 1})
            health = await c.get("/health")
            replay_while_down = await c.post("/refunds", json={"amount": 1}, headers=_key("before"))

            assert [r.status_code for r in down] == [503, 503, 503]
            for r in down:
                assert r.headers["content-type"] == PROBLEM
                assert int(r.headers["retry-after"]) >= 1
            assert replay_while_down.status_code == 503  # not a guess from memory either
            assert unguarded.status_code == 200
            assert health.status_code == 200
            assert t.calls["refund"] == 1  # no handler ran while the store was down
            assert await probe.records() != []  # only "before"
            assert len(await probe.records()) == 1

            pg_proxy.restore()
            # No restart, no pre-ping: broken connections were invalidated when they
            # failed, so the next checkout connects afresh. Allow one failed request.
            after: list[int] = []
            for _ in range(2):
                r = await c.post("/refunds", json={"amount": 3}, headers=_key("after"))
                after.append(r.status_code)
                if r.status_code == 201:
                    break
            replay = await c.post("/refunds", json={"amount": 1}, headers=_key("before"))
        assert after[-1] == 201, after
        assert replay.status_code == 201
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json() == before.json()
        assert t.calls["refund"] == 2
    finally:
        await close_bounded(store, pg_proxy)


async def test_store_error_while_completing_returns_the_true_response_then_completes(
    pg_url: str, pg_proxy: TcpProxy, probe: Probe
) -> None:
    """The handler's effect happened, then the store went away before ``complete``.

    What the client gets: the handler's real 201 (not a 503: the effect did happen).
    What the row says: ``in_progress`` with no stored response while the store is down.
    When the store is back within the lease, the responder's background retry
    completes the record, and a retry replays the first response: the handler ran once.
    """
    lease = 1.0  # retries 0.1, 0.2 and 0.4 s after the failure
    store = SQLStore(pg_proxy.url_for(pg_url), command_timeout=2)

    async def cut_after_effect() -> None:
        if len(t.finished) == 1:
            pg_proxy.cut()

    t = refund_app(store, lease=lease, after_handler=cut_after_effect)
    body = {"amount": 7}
    try:
        async with asyncio.timeout(30), t.client() as c:  # bounded: a hang fails
            first = await c.post("/refunds", json=body, headers=_key("k"))
            assert first.status_code == 201
            assert "idempotent-replayed" not in first.headers
            assert first.json()["refund_id"] == t.finished[0]

            rows = await probe.records()  # the probe reads Postgres directly, not via the proxy
            assert [(r.status, r.response_status) for r in rows] == [
                (RecordStatus.IN_PROGRESS, None)
            ]
            assert rows[0].locked_until > datetime.now(UTC)

            pg_proxy.restore()

            async def completed() -> bool:
                return bool((await probe.records())[0].status == RecordStatus.COMPLETED)

            await probe.wait_for("the background completion", completed, within=lease)
            retry = await c.post("/refunds", json=body, headers=_key("k"))
        assert retry.status_code == 201
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.json() == first.json()
        assert t.calls["refund"] == 1
        rows = await probe.records()
        assert [(r.status, r.response_status) for r in rows] == [(RecordStatus.COMPLETED, 201)]
    finally:
        await close_bounded(store, pg_proxy)


async def test_store_down_past_the_completion_retries_leaves_the_key_as_a_crash_would(
    pg_url: str, pg_proxy: TcpProxy, probe: Probe, caplog: pytest.LogCaptureFixture
) -> None:
    """The store stays away longer than the completion's retries (one lease).

    The row stays ``in_progress`` until its lease ends. A retry before then: 409, never
    a replay of something else. After it: the claim is taken over and the handler runs
    again (the guarantee this cannot give, stated).
    """
    lease = 3.0  # retries 0.1, 0.2, 0.4 and 0.8 s after the failure, then it gives up
    store = SQLStore(pg_proxy.url_for(pg_url), command_timeout=2)

    async def cut_after_effect() -> None:
        if len(t.finished) == 1:
            pg_proxy.cut()

    async def gave_up() -> bool:
        events = [r.__dict__.get("event") for r in caplog.records]
        return "idempotency.complete_gave_up" in events

    t = refund_app(store, lease=lease, after_handler=cut_after_effect)
    body = {"amount": 7}
    caplog.set_level(logging.WARNING, logger="asgi_idempotency")
    try:
        async with asyncio.timeout(30), t.client() as c:  # bounded: a hang fails
            first = await c.post("/refunds", json=body, headers=_key("k"))
            assert first.status_code == 201
            assert first.json()["refund_id"] == t.finished[0]
            await probe.wait_for("the completion's retries to give up", gave_up, within=lease)

            rows = await probe.records()  # the probe reads Postgres directly, not via the proxy
            assert [(r.status, r.response_status) for r in rows] == [
                (RecordStatus.IN_PROGRESS, None)
            ]
            assert rows[0].locked_until > datetime.now(UTC)

            pg_proxy.restore()
            retry = await c.post("/refunds", json=body, headers=_key("k"))
            assert retry.status_code in (409, 503)  # 503 if the one broken connection fails first
            if retry.status_code == 503:
                retry = await c.post("/refunds", json=body, headers=_key("k"))
            assert retry.status_code == 409
            assert retry.headers["content-type"] == PROBLEM
            assert t.calls["refund"] == 1

            await asyncio.sleep(
                max(0.0, (rows[0].locked_until - datetime.now(UTC)).total_seconds()) + 0.1
            )
            late = await c.post("/refunds", json=body, headers=_key("k"))
        assert late.status_code == 201
        assert "idempotent-replayed" not in late.headers  # re-run, not a replay
        assert late.json()["refund_id"] == t.finished[1] != t.finished[0]
        assert t.calls["refund"] == 2
        rows = await probe.records()
        assert [(r.status, r.response_status) for r in rows] == [(RecordStatus.COMPLETED, 201)]
    finally:
        await close_bounded(store, pg_proxy)


# A store away for seconds after the effect, well within the lease: the completion is
# tried for the lease's life, not only for its first few seconds.
OUTAGE = 5.0
LONG_LEASE = 30.0


async def _completed(probe: Probe) -> bool:
    rows = await probe.records()
    return bool(rows) and rows[0].status == RecordStatus.COMPLETED


async def test_an_outage_of_seconds_after_the_effect_completes_the_record_when_the_store_returns(
    pg_url: str, pg_proxy: TcpProxy, probe: Probe
) -> None:
    store = SQLStore(pg_proxy.url_for(pg_url), command_timeout=2)

    async def cut_after_effect() -> None:
        if len(t.finished) == 1:
            pg_proxy.cut()

    t = refund_app(store, lease=LONG_LEASE, after_handler=cut_after_effect, principal=ANONYMOUS)
    body = {"amount": 7}
    try:
        async with asyncio.timeout(60), t.client() as c:  # bounded: a hang fails
            first = await c.post("/refunds", json=body, headers=_key("k"))
            assert first.status_code == 201
            await asyncio.sleep(OUTAGE)
            rows = await probe.records()  # the probe reads Postgres directly, not via the proxy
            assert [(r.status, r.response_status) for r in rows] == [
                (RecordStatus.IN_PROGRESS, None)
            ]
            pg_proxy.restore()
            await probe.wait_for("the completion", lambda: _completed(probe), within=10)
            retry = await c.post("/refunds", json=body, headers=_key("k"))
        assert retry.status_code == 201
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.json() == first.json()
        assert t.calls["refund"] == 1
    finally:
        await close_bounded(store, pg_proxy)


async def test_once_completes_after_an_outage_of_seconds_after_the_call(
    pg_url: str, pg_proxy: TcpProxy, probe: Probe
) -> None:
    store = SQLStore(pg_proxy.url_for(pg_url), command_timeout=2)
    once = Once(store, lease=timedelta(seconds=LONG_LEASE))
    ran: list[str] = []

    async def refund(amount: int) -> dict[str, object]:
        ran.append(uuid.uuid4().hex)
        if len(ran) == 1:
            pg_proxy.cut()  # after the effect, before the completion
        return {"refund_id": ran[-1], "amount": amount}

    try:
        async with asyncio.timeout(60):  # bounded: a hang fails
            first = await once.call("k", refund, 7)
            await asyncio.sleep(OUTAGE)
            assert [r.status for r in await probe.records()] == [RecordStatus.IN_PROGRESS]
            pg_proxy.restore()
            await probe.wait_for("the completion", lambda: _completed(probe), within=10)
            again = await once.call("k", refund, 7)
        assert again == first
        assert len(ran) == 1
    finally:
        await close_bounded(store, pg_proxy)

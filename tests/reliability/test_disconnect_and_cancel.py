"""The client leaves, or the request task is cancelled, while the handler runs.

- The handler finishes (the client merely went away): its response is stored and
  replayed to the retry.
- The handler itself is cancelled part-way: the effect may or may not have happened,
  so the claim is NOT released; it stays ``in_progress`` (409 to retries) until its
  lease ends, and its lease is no longer renewed.
"""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
import pytest
from sqlalchemy import text
from starlette.types import Message

from asgi_idempotency import SQLStore
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.stores.base import RecordStatus, Store

from ..conftest import StoreClock
from ..helpers.serving import UvicornProcess
from .apps import asgi_call, refund_app
from .support import Probe

pytestmark = pytest.mark.anyio
JSON = (b"content-type", b"application/json")


def _raw_post(port: int, path: str, key: str, body: dict[str, Any]) -> socket.socket:
    payload = orjson.dumps(body)
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    # Records are scoped by host name (not port): 127.0.0.1 like the retry.
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nIdempotency-Key: %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (path.encode(), port, key.encode(), len(payload), payload)
    )
    return sock


@pytest.mark.slow
@pytest.mark.postgres
async def test_client_closes_mid_request_handler_finishes_and_retry_gets_the_replay(
    demo_pair: tuple[UvicornProcess, UvicornProcess], probe: Probe
) -> None:
    path, key, body = "/orders/o-3/refunds", "refund-o-3", {"amount": 300, "delay": 0.5}
    server = demo_pair[0]
    port = int(server.base_url.rsplit(":", 1)[1])
    sock = _raw_post(port, path, key, body)
    await probe.wait_for("the claim", probe.records, within=5)
    # Reset, not a polite half-close: the server sees the connection die mid-request.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()

    async def completed() -> bool:
        return [r.status for r in await probe.records()] == [RecordStatus.COMPLETED]

    await probe.wait_for("the stored response", completed, within=5)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        retry = await c.post(path, json=body, headers={"Idempotency-Key": key})
    refunds = await probe.refunds()
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert [r[0] for r in refunds] == [retry.json()["refund_id"]]


async def test_send_failing_after_disconnect_still_stores_the_response(store: Store) -> None:
    """In-process: the server's ``send`` raises because the client is gone (ASGI allows it)."""
    t = refund_app(store)
    scope_headers = [(b"idempotency-key", b"gone"), JSON]

    class Gone(OSError):
        pass

    async def send(message: Message) -> None:
        raise Gone("client disconnected")

    async def receive() -> Message:
        return {"type": "http.request", "body": b'{"amount": 5}', "more_body": False}

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/refunds", "raw_path": b"/refunds", "root_path": "",
        "query_string": b"", "headers": scope_headers, "client": None, "server": None,
    }  # fmt: skip
    with pytest.raises(Gone):
        await t.app(scope, receive, send)
    retry = await asgi_call(t.app, "POST", "/refunds", scope_headers, [b'{"amount": 5}'])
    assert retry.status == 201
    assert retry.header(b"idempotent-replayed") == b"true"
    assert orjson.loads(retry.body)["refund_id"] == t.finished[0]
    assert t.calls["refund"] == 1


async def test_cancelled_handler_keeps_its_claim_until_the_lease_ends(store: Store) -> None:
    clock = StoreClock(store)
    t = refund_app(store, lease=clock.unit.total_seconds(), clock=clock)
    headers = [(b"idempotency-key", b"cancel-me"), JSON]
    body = [b'{"amount": 8, "wait": true}']
    task = asyncio.create_task(asgi_call(t.app, "POST", "/refunds", headers, body))
    await asyncio.wait_for(t.started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    record = await store.get(scoped_key("", "cancel-me"))
    assert record is not None
    assert record.status is RecordStatus.IN_PROGRESS  # not released as if nothing happened
    retry = await asgi_call(t.app, "POST", "/refunds", headers, body)
    assert retry.status == 409
    assert t.calls["refund"] == 1

    await clock.past(clock.unit)  # the lease ends: the claim counts as abandoned
    t.gate.set()
    late = await asgi_call(t.app, "POST", "/refunds", headers, body)
    assert late.status == 201
    assert late.header(b"idempotent-replayed") is None
    assert t.calls["refund"] == 2


@pytest.mark.postgres
async def test_cancelled_handler_stops_renewing_so_the_lease_really_ends(
    pg_store: SQLStore, probe: Probe
) -> None:
    lease = 0.6  # renewed every 0.2 s while the handler lives
    t = refund_app(pg_store, lease=lease)
    headers = [(b"idempotency-key", b"cancel-pg"), JSON]
    body = [b'{"amount": 9, "wait": true}']
    task = asyncio.create_task(asgi_call(t.app, "POST", "/refunds", headers, body))
    await asyncio.wait_for(t.started.wait(), 5)  # in the handler, so past its claim
    [claimed] = await probe.records()

    async def renewed() -> bool:
        return any(r.locked_until > claimed.locked_until for r in await probe.records())

    await probe.wait_for("a renewal", renewed, within=lease)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [at_cancel] = await probe.records()
    await asyncio.sleep(lease / 3 * 2 + 0.1)  # two renewal ticks, had renewal survived
    [later] = await probe.records()
    assert later == at_cancel
    assert later.status == RecordStatus.IN_PROGRESS

    await asyncio.sleep(max(0.0, (later.locked_until - datetime.now(UTC)).total_seconds()) + 0.05)
    t.gate.set()
    late = await asgi_call(t.app, "POST", "/refunds", headers, body)
    assert late.status == 201  # taken over after the lease, by the same request
    assert t.calls["refund"] == 2


@pytest.mark.postgres
async def test_cancelled_while_completing_the_completion_still_lands(
    pg_store: SQLStore, probe: Probe
) -> None:
    """The request task is cancelled while ``complete`` waits on a locked table: shielded."""
    t = refund_app(pg_store)
    headers = [(b"idempotency-key", b"shielded"), JSON]
    body = [b'{"amount": 10, "wait": true}']
    task = asyncio.create_task(asgi_call(t.app, "POST", "/refunds", headers, body))
    await asyncio.wait_for(t.started.wait(), 5)
    async with probe.store.engine.connect() as locker:
        await locker.execute(text("LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE"))
        t.gate.set()

        async def complete_is_waiting() -> bool:
            async with probe.store.engine.connect() as conn:
                n = await conn.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND datname = current_database() "
                        "AND query ILIKE 'UPDATE idempotency_records%'"
                    )
                )
            return bool(n)

        await probe.wait_for("complete() blocked on the lock", complete_is_waiting, within=5)
        task.cancel()
        await locker.rollback()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def completed() -> bool:
        return [r.status for r in await probe.records()] == [RecordStatus.COMPLETED]

    await probe.wait_for("the shielded completion", completed, within=5)
    retry = await asgi_call(t.app, "POST", "/refunds", headers, body)
    assert retry.status == 201
    assert retry.header(b"idempotent-replayed") == b"true"
    assert orjson.loads(retry.body)["refund_id"] == t.finished[0]
    assert t.calls["refund"] == 1

"""Response trailers (ASGI ``http.response.trailers``) through the guard.

A response whose start says ``trailers: True`` ends with its last trailers message, not
with its final body: the guard used to drop the trailers, and a server that waits for
them (hypercorn over HTTP/2) kept the stream open until its idle timeout. Now the
trailers pass through on the first answer, are stored with the response and replayed
with it to a request whose server takes trailers (and left out for one whose server
does not). Served by real servers in ``tests/http/test_servers.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from asgi_idempotency import IdempotencyMiddleware, MemoryStore
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.http.asgi import Message
from asgi_idempotency.http.capture import TRAILER_PREFIX, send_replay, stored_headers
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.stores.base import Store, StoredResponse

pytestmark = pytest.mark.anyio

KEY = b"refund-A-88214"
BODY = b'{"order": "A-88214", "amount_p": 4500}'
TRAILERS = [(b"grpc-status", b"0"), (b"x-checksum", b"sha256=abc")]
App = Callable[[Any, Any, Any], Awaitable[None]]


def scope(*, trailers: bool = True, key: bytes = KEY) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "2", "method": "POST",
        "scheme": "http", "path": "/refunds", "raw_path": b"/refunds", "query_string": b"",
        "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
        "headers": [(b"host", b"shop.example"), (b"idempotency-key", key),
                    (b"content-type", b"application/json"), (b"te", b"trailers")],
        "extensions": {"http.response.trailers": {}} if trailers else {},
    }  # fmt: skip


class Handler:
    """An app that sends its response with trailers in the way ``shape`` names, counting runs."""

    def __init__(self, shape: str = "whole", status: int = 201) -> None:
        self.shape, self.status, self.runs = shape, status, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.runs += 1
        await receive()
        offered = "http.response.trailers" in scope.get("extensions", {})
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json")],
                    "trailers": offered})  # fmt: skip
        if self.shape == "stream":
            await send({"type": "http.response.body", "body": b'{"refund":', "more_body": True})
            await send({"type": "http.response.body", "body": b" 1}", "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b'{"refund": 1}'})
        if not offered or self.shape == "forgotten":
            return
        if self.shape == "split":
            await send({"type": "http.response.trailers", "headers": TRAILERS[:1],
                        "more_trailers": True})  # fmt: skip
            await send({"type": "http.response.trailers", "headers": TRAILERS[1:]})
            return
        await send({"type": "http.response.trailers", "headers": TRAILERS, "more_trailers": False})


async def call(app: App, s: dict[str, Any]) -> list[Message]:
    sent: list[Message] = []
    fed = False

    async def receive() -> Message:
        nonlocal fed
        if not fed:
            fed = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(s, receive, send)
    return sent


def body_of(sent: list[Message]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def trailers_of(sent: list[Message]) -> list[tuple[bytes, bytes]]:
    found = [m for m in sent if m["type"] == "http.response.trailers"]
    assert all(not m.get("more_trailers", False) for m in found[-1:]), "the stream never ends"
    return [(bytes(n), bytes(v)) for m in found for n, v in m["headers"]]


def ends(sent: list[Message]) -> bool:
    """Whether the messages end the response as ASGI says: after the final body, or after
    the last trailers when the start announced them."""
    start = sent[0]
    assert start["type"] == "http.response.start"
    last = sent[-1]
    if start.get("trailers", False):
        return last["type"] == "http.response.trailers" and not last.get("more_trailers", False)
    return last["type"] == "http.response.body" and not last.get("more_body", False)


@pytest.mark.parametrize("shape", ["whole", "stream", "split"])
async def test_trailers_pass_through_are_stored_and_replayed(store: Store, shape: str) -> None:
    handler = Handler(shape)
    guard = IdempotencyMiddleware(handler, store=store, principal=ANONYMOUS)
    first = await call(guard, scope())
    assert ends(first)
    assert trailers_of(first) == TRAILERS
    assert body_of(first) == b'{"refund": 1}'
    replay = await call(guard, scope())
    assert handler.runs == 1
    assert ends(replay)
    assert replay[0]["trailers"] is True
    assert (b"idempotent-replayed", b"true") in replay[0]["headers"]
    assert trailers_of(replay) == TRAILERS
    assert body_of(replay) == b'{"refund": 1}'
    record = await store.get(scoped_key("", KEY.decode(), "shop.example"))
    assert record is not None
    assert record.response is not None
    assert record.response.headers[-2:] == tuple((TRAILER_PREFIX + n, v) for n, v in TRAILERS)


async def test_a_replay_to_a_server_without_trailers_ends_with_its_body() -> None:
    handler = Handler()
    guard = IdempotencyMiddleware(handler, store=MemoryStore(), principal=ANONYMOUS)
    await call(guard, scope())
    replay = await call(guard, scope(trailers=False))
    assert handler.runs == 1
    assert not replay[0].get("trailers", False)
    assert ends(replay)
    assert trailers_of(replay) == []
    assert all(not n.startswith(b":") for n, _ in replay[0]["headers"])
    assert body_of(replay) == b'{"refund": 1}'


async def test_a_response_without_trailers_replays_without_them_on_a_server_with_them() -> None:
    handler = Handler()
    guard = IdempotencyMiddleware(handler, store=MemoryStore(), principal=ANONYMOUS)
    first = await call(guard, scope(trailers=False))  # the app offers none where none go
    replay = await call(guard, scope())
    assert handler.runs == 1
    assert first[0].get("trailers", False) is False
    assert not replay[0].get("trailers", False)
    assert ends(replay)


@pytest.mark.parametrize("shape", ["forgotten", "stream-forgotten"])
async def test_an_app_that_announces_trailers_and_sends_none_still_ends_its_response(
    shape: str,
) -> None:
    class Forgetful(Handler):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            self.runs += 1
            await send({"type": "http.response.start", "status": 201, "headers": [],
                        "trailers": True})  # fmt: skip
            if shape == "stream-forgotten":
                await send({"type": "http.response.body", "body": b"a", "more_body": True})
            else:
                await send({"type": "http.response.body", "body": b"a"})

    guard = IdempotencyMiddleware(Forgetful(), store=MemoryStore(), principal=ANONYMOUS)
    first = await call(guard, scope())
    assert ends(first)
    assert trailers_of(first) == []
    replay = await call(guard, scope())
    assert ends(replay)
    assert body_of(replay) == b"a"


async def test_a_failed_answer_with_trailers_releases_the_key_and_ends() -> None:
    handler = Handler(status=503)
    guard = IdempotencyMiddleware(handler, store=MemoryStore(), principal=ANONYMOUS)
    first = await call(guard, scope())
    assert ends(first)
    assert trailers_of(first) == TRAILERS
    assert ends(await call(guard, scope()))
    assert handler.runs == 2  # released: the retry ran


def test_stored_trailers_follow_the_headers_and_filter_alike() -> None:
    stored = stored_headers(
        [(b"content-type", b"text/plain"), (b"set-cookie", b"s=1")],
        [(b"grpc-status", b"0"), (b"set-cookie", b"t=2")],
    )
    assert stored == ((b"content-type", b"text/plain"), (TRAILER_PREFIX + b"grpc-status", b"0"))
    assert stored_headers([(b"a", b"1")], None) == ((b"a", b"1"),)


async def test_send_replay_splits_the_stored_trailers_off() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    response = StoredResponse(
        200, ((b"content-type", b"text/plain"), (TRAILER_PREFIX + b"grpc-status", b"0")), b"ok"
    )
    await send_replay(send, response, [], trailers=True)
    assert sent[0]["trailers"] is True
    assert sent[-1] == {
        "type": "http.response.trailers", "headers": [(b"grpc-status", b"0")],
        "more_trailers": False,
    }  # fmt: skip
    assert [n for n, _ in sent[0]["headers"]] == [
        b"content-type", b"idempotent-replayed", b"content-length",
    ]  # fmt: skip


async def test_send_replay_counts_the_body_of_a_record_stored_with_its_length() -> None:
    # Records stored before headers were kept ready to send carry the app's Content-Length
    # (in the app's case): the replay sends one, its own.
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    headers = ((b"Content-Type", b"text/plain"), (b"Content-Length", b"99"))
    await send_replay(send, StoredResponse(200, headers, b"ok"), [])
    assert sent[0]["headers"] == [
        (b"Content-Type", b"text/plain"), (b"idempotent-replayed", b"true"),
        (b"content-length", b"2"),
    ]  # fmt: skip

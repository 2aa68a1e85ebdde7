"""The response side: run the app with its response held back, store what may be replayed,
and send a captured or a stored response.

The response start is held back until the whole response is known, so the guard can
decide to complete or release the key before the client sees anything, and never
sends a second ``http.response.start``.
"""

from __future__ import annotations

from collections.abc import Iterable

from .asgi import ASGIApp, Message, Receive, Scope, Send, send_response
from .request import replay_body
from .stores.base import StoredResponse

__all__ = ["run_captured", "send_captured", "send_replay", "storable_headers"]

# Never stored or replayed: hop-by-hop (RFC 9110 §7.6.1), Date (the replay is sent now),
# Set-Cookie (a replayed session cookie is a session handed to whoever holds the key).
_UNSTORED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"date",
        b"set-cookie",
    }
)
_REPLAYED = (b"idempotent-replayed", b"true")


def storable_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    """The response headers that may be replayed to a later request with the same key."""
    kept: list[tuple[bytes, bytes]] = []
    named: set[bytes] = set()
    for name, value in headers:
        lowered = name.lower()
        if lowered in _UNSTORED:
            if lowered == b"connection":  # the headers it names are hop-by-hop too
                named.update(v.strip().lower() for v in value.split(b","))
            continue
        kept.append((name, value))
    if named:
        return tuple((n, v) for n, v in kept if n.lower() not in named)
    return tuple(kept)


async def run_captured(
    app: ASGIApp, scope: Scope, receive: Receive, body: bytes
) -> tuple[Message, bytes]:
    """Run ``app`` on the buffered ``body``; return its response start and whole body.

    Raises:
        RuntimeError: the app returned without starting a response.
    """
    start: Message | None = None
    chunks: list[bytes] = []

    async def capture(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, replay_body(body, receive), capture)
    if start is None:
        raise RuntimeError("the application returned without sending a response")
    return start, b"".join(chunks)


async def send_captured(send: Send, start: Message, content: bytes) -> None:
    await send(start)
    await send({"type": "http.response.body", "body": content, "more_body": False})


async def send_replay(send: Send, response: StoredResponse) -> None:
    """The stored response, byte for byte, marked ``Idempotent-Replayed: true``."""
    await send_response(send, response.status, [*response.headers, _REPLAYED], response.body)

"""ASGI type aliases and the one helper that sends a complete response."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


async def send_response(
    send: Send, status: int, headers: Headers, body: bytes, trailers: Headers | None = None
) -> None:
    """Send one complete response, with a Content-Length that matches ``body``, and
    ``trailers`` after it when given (the server must offer ``http.response.trailers``)."""
    out = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    out.append((b"content-length", b"%d" % len(body)))
    await send_ready(send, status, out, body, trailers)


async def send_ready(
    send: Send, status: int, headers: Headers, body: bytes, trailers: Headers | None = None
) -> None:
    """:func:`send_response` for ``headers`` that are ready to send as they are: their
    Content-Length already ``body``'s (a replay's, stored without one)."""
    if trailers is None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    await send(
        {"type": "http.response.start", "status": status, "headers": headers, "trailers": True}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
    await send({"type": "http.response.trailers", "headers": trailers, "more_trailers": False})

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
    out.append((b"content-length", str(len(body)).encode()))
    if trailers is None:
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    await send({"type": "http.response.start", "status": status, "headers": out, "trailers": True})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    await send({"type": "http.response.trailers", "headers": trailers, "more_trailers": False})

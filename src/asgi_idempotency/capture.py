"""The response side: hold the app's response back while it runs (:class:`Captured`),
keep what may be replayed, and send a stored response.

The response start is held back until the whole response is known, so the guard can
decide to complete or release the key before the client sees anything, and never
sends a second ``http.response.start``.
"""

from __future__ import annotations

from collections.abc import Iterable

from .asgi import Message, Receive, Send, send_response
from .stores.base import StoredResponse

__all__ = ["Captured", "send_replay", "storable_headers"]

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
    named: set[bytes] | None = None
    for header in headers:
        name = header[0]
        lowered = name.lower()
        if lowered in _UNSTORED:
            if lowered == b"connection":  # the headers it names are hop-by-hop too
                named = named or set()
                named.update(v.strip().lower() for v in header[1].split(b","))
            continue
        kept.append(header if type(header) is tuple else (name, header[1]))
    if named:
        return tuple((n, v) for n, v in kept if n.lower() not in named)
    return tuple(kept)


class Captured:
    """One run of the app: replays the buffered body to it and holds back its response.

    Its bound methods are the app's ``receive`` and ``send``: one object per request
    where two closures and their cells would be three and more.
    """

    __slots__ = ("_receive", "body", "chunks", "pending", "start")

    def __init__(self, body: bytes, receive: Receive) -> None:
        self.body, self._receive = body, receive
        self.pending = True
        self.start: Message | None = None
        self.chunks: list[bytes] = []

    async def receive(self) -> Message:
        # As replay_body: the body once, then the server's own messages (http.disconnect).
        if self.pending:
            self.pending = False
            return {"type": "http.request", "body": self.body, "more_body": False}
        return await self._receive()

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.start = message
        elif kind == "http.response.body":
            self.chunks.append(message.get("body", b""))


async def send_replay(send: Send, response: StoredResponse) -> None:
    """The stored response, byte for byte, marked ``Idempotent-Replayed: true``."""
    await send_response(send, response.status, [*response.headers, _REPLAYED], response.body)

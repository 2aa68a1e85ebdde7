"""The response side: which of a response's headers may be replayed, and sending a
stored response. Holding the app's response back until it is complete (or streaming
it) is the :class:`~.responder.Responder`'s.
"""

from __future__ import annotations

from collections.abc import Iterable

from .asgi import Send, send_response
from .stores.base import StoredResponse

__all__ = ["send_replay", "storable_headers"]

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
        if lowered in _UNSTORED or lowered.startswith(b"access-control-"):
            # Access-Control-*: per origin, from CORS middleware that belongs outside the
            # guard; replayed, one origin's grant would reach another.
            if lowered == b"connection":  # the headers it names are hop-by-hop too
                named = named or set()
                named.update(v.strip().lower() for v in header[1].split(b","))
            continue
        kept.append(header if type(header) is tuple else (name, header[1]))
    if named:
        return tuple((n, v) for n, v in kept if n.lower() not in named)
    return tuple(kept)


async def send_replay(send: Send, response: StoredResponse) -> None:
    """The stored response, byte for byte, marked ``Idempotent-Replayed: true``."""
    await send_response(send, response.status, [*response.headers, _REPLAYED], response.body)

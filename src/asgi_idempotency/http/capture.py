"""The response side: which of a response's headers (and trailers) may be replayed, and
sending a stored response. Holding the app's response back until it is complete (or
streaming it) is the :class:`~.responder.Responder`'s.

Headers are stored ready to send: names in lower case (as HTTP/2 and the ASGI servers
send them) and no Content-Length, so a replay appends its own two headers and re-encodes
nothing (:func:`send_replay`).

Trailers (ASGI's ``http.response.trailers``: gRPC's ``grpc-status``, a checksum computed
while streaming) are stored after the headers, each name behind :data:`TRAILER_PREFIX`,
so every store keeps them in the column or field it keeps headers in.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable

from asgi_idempotency.http.asgi import Headers, Send, send_ready
from asgi_idempotency.stores.base import StoredResponse

__all__ = ["TRAILER_PREFIX", "send_replay", "storable_headers", "stored_headers"]

# Never stored or replayed: hop-by-hop (RFC 9110 §7.6.1), Date (the replay is sent now),
# Set-Cookie (a replayed session cookie is a session handed to whoever holds the key),
# Content-Length (a replay counts the body it sends).
_UNSTORED = frozenset(
    {
        b"content-length",
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
# Before each stored trailer's name. A colon is no token character (RFC 9110 §5.1), so no
# header field a server would send can be stored under this prefix.
TRAILER_PREFIX = b":trailer:"
_TRAILER_MARK = TRAILER_PREFIX[:1]


def storable_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    """The response headers that may be replayed to a later request with the same key,
    ready to send: names in lower case, no Content-Length."""
    kept: list[tuple[bytes, bytes]] = []
    named: set[bytes] | None = None
    for name, value in headers:
        lowered = name.lower()
        if lowered in _UNSTORED or lowered.startswith(b"access-control-"):
            # Access-Control-*: per origin, from CORS middleware that belongs outside the
            # guard; replayed, one origin's grant would reach another.
            if lowered == b"connection":  # the headers it names are hop-by-hop too
                named = named or set()
                named.update(v.strip().lower() for v in value.split(b","))
            continue
        kept.append((lowered, value))
    if named:
        return tuple(h for h in kept if h[0] not in named)
    return tuple(kept)


def stored_headers(
    headers: Iterable[tuple[bytes, bytes]], trailers: Iterable[tuple[bytes, bytes]] | None
) -> tuple[tuple[bytes, bytes], ...]:
    """What a response stores in its headers' place: :func:`storable_headers`, then the
    trailers, when it sent any, each name behind :data:`TRAILER_PREFIX`."""
    kept = storable_headers(headers)
    if not trailers:
        return kept
    return kept + tuple((TRAILER_PREFIX + n, v) for n, v in storable_headers(trailers))


async def send_replay(
    send: Send, response: StoredResponse, request_headers: Headers, *, trailers: bool = False
) -> None:
    """The stored response, byte for byte, marked ``Idempotent-Replayed: true``.

    One exception: a body the app compressed for the first request (``Content-Encoding``)
    is decoded when this request did not accept that coding and it is one the standard
    library reads (gzip, deflate); the app's own compression is not the retry's choice.
    The stored trailers follow the body when ``trailers`` says this request's server
    takes them (``scope["extensions"]["http.response.trailers"]``); else they are left
    out and the response ends with its body.
    """
    headers, body = response.headers, response.body
    stored_trailers: Headers | None = None
    if headers and headers[-1][0][:1] == _TRAILER_MARK:  # trailers are stored last
        cut = len(headers)
        while cut and headers[cut - 1][0].startswith(TRAILER_PREFIX):
            cut -= 1
        if trailers:
            skip = len(TRAILER_PREFIX)
            stored_trailers = [(n[skip:], v) for n, v in headers[cut:]]
        headers = headers[:cut]
    # A record stored with its Content-Length (stored before headers were kept ready to
    # send): sent without it, counted afresh.
    counted = False
    for name, value in headers:
        # The first byte first: most names are neither "content-encoding" nor "-length".
        if name[:1] not in b"cC":
            continue
        lowered = name.lower()
        if lowered == b"content-length":
            counted = True
        elif lowered == b"content-encoding":
            coding = value.strip().lower()
            if coding not in (b"", b"identity") and not _accepts(request_headers, coding):
                decoded = _decode(coding, body)
                if decoded is not None:
                    body = decoded
                    headers = tuple(h for h in headers if h[0].lower() != b"content-encoding")
    if counted:
        headers = tuple(h for h in headers if h[0].lower() != b"content-length")
    out = [*headers, _REPLAYED, (b"content-length", b"%d" % len(body))]
    await send_ready(send, response.status, out, body, stored_trailers)


def _accepts(headers: Headers, coding: bytes) -> bool:
    """Whether ``Accept-Encoding`` admits ``coding`` (RFC 9110 §12.5.3; ``q=0`` refuses)."""
    for name, value in headers:
        if name.lower() != b"accept-encoding":
            continue
        for item in value.lower().split(b","):
            token, _, params = item.strip().partition(b";")
            if token.strip() in (coding, b"*") and params.replace(b" ", b"") not in (
                b"q=0",
                b"q=0.0",
                b"q=0.00",
                b"q=0.000",
            ):
                return True
    return False


def _decode(coding: bytes, body: bytes) -> bytes | None:
    try:
        if coding in (b"gzip", b"x-gzip"):
            return gzip.decompress(body)
        if coding == b"deflate":
            return zlib.decompress(body)
    except (OSError, EOFError, zlib.error):
        return None  # not what it says it is: sent as stored
    return None

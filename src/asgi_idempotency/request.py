"""Reading a guarded request: its key headers in one pass, its body in full, and a replay of it.

The body is buffered before the claim so that the fingerprint covers it; the
handler then reads the same bytes through :func:`replay_body`.
"""

from __future__ import annotations

from .asgi import Headers, Message, Receive
from .errors import BodyTooLarge, InvalidKey
from .keys import HEADER
from .principals import CREDENTIAL_HEADERS

__all__ = ["guard_headers", "host_name", "read_body", "replay_body"]


def guard_headers(
    headers: Headers,
) -> tuple[bytes | None, bytes | None, bytes | None, bytes, bytes | None]:
    """The raw ``Idempotency-Key``, ``Content-Type``, ``Content-Length`` and ``Host``
    (``b""`` if absent), and the name of a header that carries credentials (or
    ``None``: see :data:`~.principals.CREDENTIAL_HEADERS`), in one pass.

    Raises:
        InvalidKey: the key header was sent more than once (which key was meant is unknowable).
    """
    key = content_type = content_length = credential = None
    host = b""
    for name, value in headers:
        name = name.lower()
        if name == HEADER:
            if key is not None:
                raise InvalidKey(
                    "Send the Idempotency-Key header once; it was sent more than once."
                )
            key = value
        elif name == b"content-type":
            if content_type is None:
                content_type = value
        elif name == b"content-length":
            content_length = value
        elif name == b"host":
            host = value
        elif name in CREDENTIAL_HEADERS:
            credential = name
    return key, content_type, content_length, host, credential


# Host headers seen, and their names: a service answers under few names, and each
# request would otherwise decode, strip and split its own.
_HOSTS: dict[bytes, str] = {}
_HOSTS_MAX = 1024  # then it starts over: the header is the client's to vary


def host_name(host: bytes) -> str:
    """The name a ``Host`` header gives, lower case, without its port.

    Tenants are told apart by name (``acme.shop.example``); the port only says which
    listener took the request, and two workers or replicas behind one name may differ
    in it.
    """
    known = _HOSTS.get(host)
    if known is not None:
        return known
    if len(_HOSTS) >= _HOSTS_MAX:
        _HOSTS.clear()
    _HOSTS[host] = name = _host_name(host)
    return name


def _host_name(host: bytes) -> str:
    name = host.decode("latin-1").strip().lower()
    if name.startswith("["):  # an IPv6 literal: [::1]:8000
        end = name.find("]")
        return name[: end + 1] if end > 0 else name
    return name.rpartition(":")[0] if ":" in name else name


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"The request body exceeds {limit} bytes for this endpoint.")


async def read_body(receive: Receive, limit: int, declared_length: bytes | None) -> bytes | None:
    """The whole body, or ``None`` if the client left while sending it.

    Raises:
        BodyTooLarge: the declared or the received length is over ``limit``; nothing
            past the limit is buffered.
    """
    if declared_length is not None:
        try:
            declared = int(declared_length)
        except ValueError:
            declared = -1  # the server has framed the body anyway; the count below decides
        if declared > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        if not message.get("more_body", False):
            if not chunks:
                return chunk  # the whole body in one message, as small bodies come
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then defers to the real one.

    Later calls reach the server, so the app still sees ``http.disconnect``.
    """
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

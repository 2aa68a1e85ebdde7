"""Reading a guarded request: its key headers in one pass, its body in full, and a replay of it.

The body is buffered before the claim so that the fingerprint covers it; the
handler then reads the same bytes through :func:`replay_body`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

from asgi_idempotency.core.errors import BodyTooLarge, InvalidHost, InvalidKey
from asgi_idempotency.core.keys import HEADER
from asgi_idempotency.http.asgi import Headers, Message, Receive

if TYPE_CHECKING:
    from asgi_idempotency.http.policy import Policy

__all__ = [
    "GuardedRequest",
    "HostHeaders",
    "forwarded_hosts",
    "guard_headers",
    "host_name",
    "host_scope",
    "read_body",
    "replay_body",
]


# What names the host a request was sent to, as ``guard_headers`` returns it: the
# ``Host`` value (``b""`` if absent), then ``X-Forwarded-Host`` and ``Forwarded`` (``None``
# if absent; ``Forwarded`` lines joined as one list, RFC 7239 §4).
HostHeaders = tuple[bytes, bytes | None, bytes | None]


def _twice(name: str) -> InvalidHost:
    return InvalidHost(
        f"Send the {name} header once; it was sent more than once, and which host "
        "the request is for is unknowable (RFC 9112 §3.2)."
    )


def guard_headers(
    headers: Headers,
) -> tuple[bytes | None, bytes | None, bytes | None, HostHeaders]:
    """The raw ``Idempotency-Key``, ``Content-Type``, ``Content-Length`` and the headers
    that name the request's host (:data:`HostHeaders`, for :func:`host_scope`), in one pass.

    Raises:
        InvalidKey: the key header was sent more than once (which key was meant is unknowable).
        InvalidHost: ``Host`` or ``X-Forwarded-Host`` was sent more than once: servers
            pass both on, the app reads one of them and the guard cannot know which.
    """
    key = content_type = content_length = None
    host = forwarded_host = forwarded = None
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
            if host is not None:
                raise _twice("Host")
            host = value
        elif name == b"x-forwarded-host":
            if forwarded_host is not None:
                raise _twice("X-Forwarded-Host")
            forwarded_host = value
        elif name == b"forwarded":
            forwarded = value if forwarded is None else forwarded + b", " + value
    return key, content_type, content_length, (host or b"", forwarded_host, forwarded)


def host_scope(
    host: bytes, forwarded_host: bytes | None = None, forwarded: bytes | None = None
) -> str:
    """The host part of a record's scope: every name the request gives for its host.

    The ``Host`` header's name (:func:`host_name`: lower case, port dropped) alone when
    the request carries nothing else; beside it, when present, each name in
    ``X-Forwarded-Host`` (a comma-separated list) and each ``host=`` parameter of
    ``Forwarded``, named the same way and in the order sent. Behind a proxy that
    rewrites ``Host`` an app names its tenant from one of these, and the guard cannot
    know which, so all of them scope the record: that can only split records, never
    join two callers'. The middleware and ``asgi-idempotency inspect --host`` both
    build the scope here.

    Raises:
        InvalidHost: a name holds a NUL character (no server should pass one on).
    """
    name = host_name(host)
    if forwarded_host is None and forwarded is None:
        return name
    # No name holds a NUL, so a scope with forwarded names never equals a bare name,
    # and the length prefixes keep the lists apart.
    parts = [name]
    if forwarded_host is not None:
        names = (host_name(h) for h in forwarded_host.split(b","))
        parts.append("x" + "".join(f"{len(n)}:{n}" for n in names))
    if forwarded is not None:
        names = (host_name(h) for h in forwarded_hosts(forwarded))
        parts.append("f" + "".join(f"{len(n)}:{n}" for n in names))
    return "\x00".join(parts)


# A ``host=`` parameter of ``Forwarded`` (RFC 7239 §4): a token or a quoted string,
# after the start, a ``;`` or a ``,``. Matched wherever it appears, even inside another
# parameter's quoted value: an extra name only splits records, a missed one could join them.
_FORWARDED_HOST = re.compile(rb'(?:^|[;,])[ \t]*host[ \t]*=[ \t]*("(?:[^"\\]|\\.)*"?|[^;,]*)', re.I)
_ESCAPED = re.compile(rb"\\(.)")


def forwarded_hosts(forwarded: bytes) -> list[bytes]:
    """The value of every ``host=`` parameter in a ``Forwarded`` header, unquoted."""
    hosts = []
    for match in _FORWARDED_HOST.finditer(forwarded):
        value = match.group(1).strip(b" \t")
        if value.startswith(b'"'):
            value = _ESCAPED.sub(rb"\1", value[1:-1] if value.endswith(b'"') else value[1:])
        hosts.append(value)
    return hosts


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
    if "\x00" in name:
        raise InvalidHost("The request's host holds a NUL character.")
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


class GuardedRequest(NamedTuple):
    """What the guard knows of one request once it has been read (frozen)."""

    key: str  # the scoped key: sha256 hex of (host, principal, client key); "" until known
    principal: str | None  # None until FastAPI resolves it (from_dependency)
    fingerprint: str
    policy: Policy
    route: str
    body: bytes
    client_key: str  # as the client sent it, parsed; never logged
    host: str  # "" when records are not scoped by host

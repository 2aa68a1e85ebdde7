"""The request fingerprint: what makes two requests "the same" for one key."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from urllib.parse import parse_qsl

from .canonical import canonicalize_json_bytes

__all__ = ["fingerprint", "fingerprint_after", "is_json", "request_prefix"]


# Content types seen, and whether each is JSON: a service sees few, and the request
# path would otherwise split, strip and lower-case the header on every request.
_JSON_TYPES: dict[bytes, bool] = {}
_JSON_TYPES_MAX = 256  # then it starts over: the header is the client's to vary


def is_json(content_type: bytes | None) -> bool:
    if not content_type:
        return False
    known = _JSON_TYPES.get(content_type)
    if known is not None:
        return known
    media = content_type.split(b";", 1)[0].strip().lower()
    answer = media == b"application/json" or media.endswith(b"+json")
    if len(_JSON_TYPES) >= _JSON_TYPES_MAX:
        _JSON_TYPES.clear()
    _JSON_TYPES[content_type] = answer
    return answer


def fingerprint(
    method: str,
    path: str,
    query_string: bytes,
    body: bytes,
    *,
    content_type: bytes | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> str:
    """SHA-256 hex of method, path, sorted query, chosen headers and the body.

    A JSON body is canonicalised first (sorted keys, compact, 4500.0 == 4500), so a
    client that re-serialises the same request is not told it changed; anything
    else, including invalid JSON, is hashed as sent.
    """
    prefix = request_prefix(method, path)
    return fingerprint_after(prefix, query_string, body, content_type, headers)


def request_prefix(method: str, path: str) -> bytes:
    """The bytes a fingerprint starts with for ``method`` and ``path``.

    Apart from the rest so that the middleware can compute it once per path.
    """
    return b"%s\x00%s\x00" % (
        method.encode("ascii", "replace"),
        path.encode("utf-8", "surrogateescape"),
    )


def fingerprint_after(
    prefix: bytes,
    query_string: bytes,
    body: bytes,
    content_type: bytes | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> str:
    """:func:`fingerprint` from the :func:`request_prefix` of its method and path."""
    # Records store this digest: the bytes hashed must never change, or every key in
    # flight across an upgrade would get 422 (tests/test_fingerprint.py pins golden values).
    canonical = canonicalize_json_bytes(body) if body and is_json(content_type) else None
    if not query_string and headers == ():
        # The common request (no query, no chosen headers): the same bytes as below,
        # joined in one call.
        if canonical is not None:
            return hashlib.sha256(b"".join((prefix, b"\x00\x00j", canonical))).hexdigest()
        return hashlib.sha256(b"".join((prefix, b"\x00\x00r", body))).hexdigest()
    parts = [prefix]
    if query_string:
        pairs = sorted(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
        for name, value in pairs:
            parts.append(
                f"{len(name)}:{name}={len(value)}:{value}&".encode("utf-8", "surrogateescape")
            )
    parts.append(b"\x00")
    for hname, hvalue in sorted(headers):
        parts.append(b"%d:%s=%d:%s\n" % (len(hname), hname, len(hvalue), hvalue))
    parts.append(b"\x00")
    if canonical is not None:
        parts += (b"j", canonical)
    else:
        parts += (b"r", body)
    return hashlib.sha256(b"".join(parts)).hexdigest()

"""The request fingerprint: what makes two requests "the same" for one key."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from urllib.parse import parse_qsl

from .canonical import canonicalize_json_bytes

__all__ = ["fingerprint", "is_json"]


def is_json(content_type: bytes | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


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
    # Records store this digest: the bytes hashed must never change, or every key in
    # flight across an upgrade would get 422 (tests/test_fingerprint.py pins golden values).
    parts = [method.encode("ascii", "replace"), b"\x00", path.encode("utf-8", "surrogateescape")]
    parts.append(b"\x00")
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
    canonical = canonicalize_json_bytes(body) if body and is_json(content_type) else None
    if canonical is not None:
        parts += (b"j", canonical)
    else:
        parts += (b"r", body)
    return hashlib.sha256(b"".join(parts)).hexdigest()

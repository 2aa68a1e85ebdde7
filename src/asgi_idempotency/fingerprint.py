"""The request fingerprint: what makes two requests "the same" for one key.

The body enters it in one of four forms, each behind a marker byte of its own so that
no two forms can collide: canonical JSON (``j``), a URL-encoded form's sorted pairs
(``f``), a multipart form's sorted parts (``m``), or the bytes as sent (``r``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote_to_bytes

from .canonical import canonicalize_json_bytes

__all__ = ["fingerprint", "fingerprint_after", "is_json", "request_prefix"]

# Marker bytes: which form of the body was hashed. Records store digests made with
# "j" and "r" since the first release; "f" and "m" are new, never reused.
_JSON = b"j"
_FORM = b"f"
_MULTIPART = b"m"
_RAW = b"r"

# Content types seen, and the body form each gets: a service sees few, and the request
# path would otherwise split, strip and lower-case the header on every request.
_KINDS: dict[bytes, bytes] = {}
_KINDS_MAX = 256  # then it starts over: the header is the client's to vary


def _kind(content_type: bytes) -> bytes:
    known = _KINDS.get(content_type)
    if known is not None:
        return known
    media = content_type.split(b";", 1)[0].strip().lower()
    if media == b"multipart/form-data":
        # Not remembered: every request carries a boundary of its own, so each of these
        # headers is new and would only push the JSON types out of the cache.
        return _MULTIPART
    if media == b"application/json" or media.endswith(b"+json"):
        kind = _JSON
    elif media == b"application/x-www-form-urlencoded":
        kind = _FORM
    else:
        kind = _RAW
    if len(_KINDS) >= _KINDS_MAX:
        _KINDS.clear()
    _KINDS[content_type] = kind
    return kind


def is_json(content_type: bytes | None) -> bool:
    """Whether ``content_type`` is ``application/json`` or ``*+json`` (parameters ignored)."""
    if not content_type:
        return False
    return _kind(content_type) is _JSON


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

    The body is read by its ``content_type``, so that a client that re-encodes the
    same request is not told it changed:

    - JSON (``application/json``, ``*+json``) is canonicalised (sorted keys, compact,
      ``4500.0 == 4500``);
    - ``application/x-www-form-urlencoded`` counts as its sorted, decoded
      ``(name, value)`` pairs, so reordered fields are the same request;
    - ``multipart/form-data`` counts as its sorted parts, each its name, filename,
      content type and SHA-256 of its content, whatever the boundary;
    - anything else, and a JSON or multipart body that does not parse, is hashed as sent.
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
    marker, material = _RAW, body
    if body and content_type:
        kind = _kind(content_type)
        if kind is _JSON:
            canonical = canonicalize_json_bytes(body)
            if canonical is not None:
                marker, material = _JSON, canonical
        elif kind is _FORM:
            marker, material = _FORM, _form_pairs(body)
        elif kind is _MULTIPART:
            parts = _multipart_parts(body, content_type)
            if parts is not None:
                marker, material = _MULTIPART, parts
    if not query_string and headers == ():
        # The common request (no query, no chosen headers): the same bytes as below,
        # joined in one call.
        return hashlib.sha256(b"".join((prefix, b"\x00\x00", marker, material))).hexdigest()
    pieces = [prefix]
    if query_string:
        pairs = sorted(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
        for name, value in pairs:
            pieces.append(
                f"{len(name)}:{name}={len(value)}:{value}&".encode("utf-8", "surrogateescape")
            )
    pieces.append(b"\x00")
    for hname, hvalue in sorted(headers):
        pieces.append(b"%d:%s=%d:%s\n" % (len(hname), hname, len(hvalue), hvalue))
    pieces += (b"\x00", marker, material)
    return hashlib.sha256(b"".join(pieces)).hexdigest()


# --- application/x-www-form-urlencoded ---------------------------------------------------


def _form_pairs(body: bytes) -> bytes:
    """The body's (name, value) pairs, decoded and sorted, each length-prefixed.

    Parsed as the WHATWG URL standard's form parser does (split on ``&``, skip empty
    pieces, ``+`` is a space, then percent-decoding), but kept as bytes: no charset
    guess can make two different forms one, and no body fails to parse.
    """
    pairs = []
    for piece in body.split(b"&"):
        if not piece:
            continue
        name, _, value = piece.replace(b"+", b" ").partition(b"=")
        pairs.append((unquote_to_bytes(name), unquote_to_bytes(value)))
    pairs.sort()
    return b"".join(b"%d:%s=%d:%s&" % (len(n), n, len(v), v) for n, v in pairs)


# --- multipart/form-data -----------------------------------------------------------------


def _field(value: bytes | None) -> bytes:
    # Length-prefixed, "-" when absent: a part without a filename differs from one whose
    # filename is empty, and no field can run into the next.
    return b"-" if value is None else b"%d:%s" % (len(value), value)


class _Parts:
    """python-multipart callbacks that keep, per part, what identifies it, not its bytes.

    ``found`` holds each part's raw Content-Disposition, Content-Type and content digest.
    """

    __slots__ = ("_content", "_field", "_headers", "_value", "ended", "found")

    def __init__(self) -> None:
        self.found: list[tuple[bytes | None, bytes | None, bytes]] = []
        self.ended = False
        self._headers: dict[bytes, bytes] = {}
        self._field = self._value = b""
        self._content = hashlib.sha256()

    def on_part_begin(self) -> None:
        self._headers = {}
        self._content = hashlib.sha256()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def on_header_end(self) -> None:
        # Header names are case-insensitive; of a header sent twice the first counts,
        # as in Starlette's own parser.
        self._headers.setdefault(self._field.lower(), self._value.strip(b" \t"))
        self._field = self._value = b""

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self._content.update(data[start:end])

    def on_part_end(self) -> None:
        headers = self._headers
        self.found.append(
            (
                headers.get(b"content-disposition"),
                headers.get(b"content-type"),
                self._content.digest(),
            )
        )

    def on_end(self) -> None:
        self.ended = True


def _multipart_parts(body: bytes, content_type: bytes) -> bytes | None:
    """The body's parts, sorted, without the boundary; ``None`` if it does not parse.

    Each part counts as its name, filename, content type and the SHA-256 of its
    content: the boundary (which clients pick at random per request), the part order
    and any epilogue are left out.
    """
    # Imported here: python-multipart is needed only once a multipart body arrives.
    from python_multipart.multipart import MultipartParser, parse_options_header

    boundary = parse_options_header(content_type)[1].get(b"boundary")
    if not boundary:
        return None
    parts = _Parts()
    try:
        parser = MultipartParser(
            boundary,
            {
                "on_part_begin": parts.on_part_begin,
                "on_header_field": parts.on_header_field,
                "on_header_value": parts.on_header_value,
                "on_header_end": parts.on_header_end,
                "on_part_data": parts.on_part_data,
                "on_part_end": parts.on_part_end,
                "on_end": parts.on_end,
            },
        )
        parser.write(body)
    except ValueError:  # python-multipart's FormParserError and its parse errors
        return None
    if not parts.ended:  # cut short before the closing boundary
        return None
    records = []
    for disposition, part_type, digest in parts.found:
        _, params = parse_options_header(disposition)
        records.append(
            _field(params.get(b"name"))
            + _field(params.get(b"filename"))
            + _field(part_type)
            + digest
        )
    records.sort()
    return b"".join(records)

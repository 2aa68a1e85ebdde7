"""The request fingerprint: what makes two requests "the same" for one key.

The body enters it in one of four forms, each behind a marker byte of its own so that
no two forms can collide: canonical JSON (``j``), a URL-encoded form's sorted pairs
(``f``), a multipart form's sorted parts (``m``), or the bytes as sent (``r``).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes

import orjson

from asgi_idempotency.core.canonical import (
    CanonicalJSONError,
    canonical_json,
    canonicalize_json_bytes,
)

__all__ = [
    "fingerprint",
    "fingerprint_after",
    "is_json",
    "json_pointer_tokens",
    "request_prefix",
]

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
    exclude: tuple[str, ...] = (),
) -> str:
    """SHA-256 hex of method, path, sorted query, chosen headers and the body.

    The body is read by its ``content_type``, so that a client that re-encodes the
    same request is not told it changed:

    - JSON (``application/json``, ``*+json``) is canonicalised (sorted keys, compact,
      ``4500.0 == 4500``), after removing the members that the JSON Pointers in
      ``exclude`` (RFC 6901, e.g. ``"/timestamp"``) name;
    - ``application/x-www-form-urlencoded`` counts as its sorted, decoded
      ``(name, value)`` pairs, so reordered fields are the same request;
    - ``multipart/form-data`` counts as its sorted parts, each its name, filename,
      content type and SHA-256 of its content, whatever the boundary;
    - anything else, and a JSON or multipart body that does not parse, is hashed as sent.

    Raises:
        ValueError: a pointer in ``exclude`` does not start with ``/`` or has a ``~``
            not followed by ``0`` or ``1``.
    """
    prefix = request_prefix(method, path)
    return fingerprint_after(prefix, query_string, body, content_type, headers, exclude=exclude)


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
    *,
    exclude: tuple[str, ...] = (),
) -> str:
    """:func:`fingerprint` from the :func:`request_prefix` of its method and path."""
    # Records store this digest: the bytes hashed must never change, or every key in
    # flight across an upgrade would get 422 (tests/http/test_fingerprint.py pins golden values).
    marker, material = _RAW, body
    if body and content_type:
        kind = _kind(content_type)
        if kind is _JSON:
            # An empty exclude (every default policy) takes the path it always took.
            if exclude:
                canonical = _canonical_json_without(body, exclude)
            else:
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


# --- JSON Pointers excluded from a JSON body ---------------------------------------------

_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")  # RFC 6901 section 4: no leading zeros
_BAD_ESCAPE = re.compile(r"~(?![01])")


def json_pointer_tokens(pointer: str) -> tuple[str, ...]:
    """The reference tokens of an RFC 6901 JSON Pointer, ``~1`` and ``~0`` unescaped.

    ``"/meta/request_id"`` gives ``("meta", "request_id")``; ``"/a~1b"`` gives
    ``("a/b",)``. The whole document (``""``) cannot be named: excluding it would make
    every body the same request.

    Raises:
        ValueError: ``pointer`` does not start with ``/``, or has a ``~`` not
            followed by ``0`` or ``1``.
    """
    if not isinstance(pointer, str) or not pointer.startswith("/"):
        raise ValueError(
            f"{pointer!r} is not a JSON Pointer to a member: it must start with '/', "
            'e.g. "/timestamp" or "/meta/request_id" (RFC 6901)'
        )
    if _BAD_ESCAPE.search(pointer):
        raise ValueError(
            f"{pointer!r} is not a JSON Pointer: '~' must be followed by 0 ('~') or 1 ('/')"
        )
    # ~1 before ~0, so that "~01" is "~1" and not "/" (RFC 6901 section 4).
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/"))


@functools.lru_cache(maxsize=256)
def _tokens(exclude: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    # One parse per policy's tuple, not per request.
    return tuple(json_pointer_tokens(p) for p in exclude)


_MISSING: Any = object()


def _child(container: Any, token: str) -> Any:
    if type(container) is dict:
        return container.get(token, _MISSING)
    if type(container) is list and _ARRAY_INDEX.fullmatch(token):
        index = int(token)
        return container[index] if index < len(container) else _MISSING
    return _MISSING


def _remove(document: Any, pointers: tuple[tuple[str, ...], ...]) -> None:
    """Remove what each pointer names in ``document``; a pointer that names nothing is skipped.

    Every pointer is resolved against the document as sent before anything is
    removed: removing ``/items/0`` first would otherwise shift what ``/items/1`` names.
    """
    members: list[tuple[dict[str, Any], str]] = []
    elements: dict[int, tuple[list[Any], set[int]]] = {}
    for tokens in pointers:
        parent = document
        for token in tokens[:-1]:
            parent = _child(parent, token)
        last = tokens[-1]
        if _child(parent, last) is _MISSING:
            continue
        if type(parent) is dict:
            members.append((parent, last))
        else:
            elements.setdefault(id(parent), (parent, set()))[1].add(int(last))
    for obj, name in members:
        obj.pop(name, None)
    for array, indexes in elements.values():
        for index in sorted(indexes, reverse=True):
            del array[index]


def _canonical_json_without(body: bytes, exclude: tuple[str, ...]) -> bytes | None:
    """:func:`canonicalize_json_bytes` of ``body`` with the members ``exclude`` names removed."""
    pointers = _tokens(exclude)
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    _remove(document, pointers)
    try:
        # canonical_json of a parsed document gives the bytes canonicalize_json_bytes
        # gives for its text (tests/http/test_fingerprint.py): excluding a pointer that names
        # nothing leaves the digest a policy without exclusions computes.
        return canonical_json(document)
    except CanonicalJSONError:
        return None

"""The ``Idempotency-Key`` header: parsing, validation and principal scoping."""

from __future__ import annotations

import hashlib
import re

from asgi_idempotency.core.errors import InvalidKey

__all__ = [
    "HEADER",
    "MAX_KEY_LENGTH",
    "MAX_NAMESPACE_LENGTH",
    "check_namespace",
    "parse_key",
    "scope_digest",
    "scoped_key",
]

HEADER = b"idempotency-key"
MAX_KEY_LENGTH = 255
# The common form, matched whole before the full parse below: a bare token of visible
# ASCII without a comma, optional spaces or tabs around. A bare comma makes the value a
# list (``a,b``, or the header sent twice and folded by a proxy, RFC 9110 §5.3); the
# full parse below refuses it with its own reason.
_BARE_TOKEN = re.compile(rb"[ \t]*([\x21-\x2b\x2d-\x7e]{1,%d})[ \t]*" % MAX_KEY_LENGTH)
# Visible ASCII but the comma, for the commonest form of all: the bare token with nothing
# around it, recognised by deleting these and finding nothing left (bytes.translate, one
# C call); a comma is left behind, so a list never takes this path.
_VISIBLE = bytes(c for c in range(0x21, 0x7F) if c != 0x2C)
_LIST_DETAIL = (
    "The Idempotency-Key holds a comma-separated list (or the header was sent more than "
    "once and folded into one); send exactly one key per request. A key that contains a "
    'comma must be sent as a quoted string, e.g. "a,b".'
)


def parse_key(raw: bytes) -> str:
    """Validate one header value and return the key it carries.

    Accepts a bare token (1..255 visible ASCII characters, no comma) or the
    Structured Field string form of draft-ietf-httpapi-idempotency-key-header
    (``"abc"``, with ``\\"`` and ``\\\\`` escapes); both spell the same key. A comma
    inside the quotes is part of the string (``"a,b"`` is the key ``a,b``); outside
    them it separates list members, and a request carries one key.

    Raises:
        InvalidKey: empty, too long, outside printable ASCII, or a list of values.
    """
    if 0 < len(raw) <= MAX_KEY_LENGTH and raw[0] != 0x22 and not raw.translate(None, _VISIBLE):
        return raw.decode("ascii")  # what the match below gives for such a value
    bare = _BARE_TOKEN.fullmatch(raw)
    if bare is not None and raw[bare.start(1)] != 0x22:  # a leading quote is the quoted form
        return bare.group(1).decode("ascii")
    value = raw.strip(b" \t")
    if not value:
        raise InvalidKey(
            "The Idempotency-Key header is empty; send 1 to 255 printable ASCII characters."
        )
    if value.startswith(b'"'):
        key = _parse_sf_string(value)
    else:
        if b"," in value:
            raise InvalidKey(_LIST_DETAIL)
        if any(c < 0x21 or c > 0x7E for c in value):
            raise InvalidKey(
                "The Idempotency-Key must be printable ASCII without spaces, "
                'or a quoted string such as "order-42".'
            )
        key = value.decode("ascii")
    if not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"The Idempotency-Key must be 1 to {MAX_KEY_LENGTH} characters long.")
    return key


def _parse_sf_string(value: bytes) -> str:
    # RFC 8941 §4.2.5: DQUOTE *(unescaped / "\" ( DQUOTE / "\" )) DQUOTE,
    # unescaped = %x20-21 / %x23-5B / %x5D-7E
    out = bytearray()
    i, end = 1, len(value)
    while i < end:
        c = value[i]
        if c == 0x5C:  # backslash
            if i + 1 >= end or value[i + 1] not in (0x22, 0x5C):
                break
            out.append(value[i + 1])
            i += 2
        elif c == 0x22:
            if i != end - 1:
                # A string that ends before the value does: `"a", "b"` is a list of two
                # (RFC 8941 §3.1), not a malformed string, and gets the list's reason.
                if value[i + 1 :].lstrip(b" \t").startswith(b","):
                    raise InvalidKey(_LIST_DETAIL)
                break
            return out.decode("ascii")
        elif 0x20 <= c <= 0x7E:
            out.append(c)
            i += 1
        else:
            break
    raise InvalidKey('The quoted Idempotency-Key is not a valid string, e.g. "order-42".')


MAX_NAMESPACE_LENGTH = 64
_NAMESPACE = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_NAMESPACE_LENGTH}}}")


def check_namespace(namespace: object) -> str:
    """``namespace`` if it names a service as a record's scope may: 1 to 64 ASCII
    letters, digits, ``.``, ``_`` or ``-`` (``"billing"``, ``"payments.eu-1"``).

    Raises:
        ValueError: anything else, the empty string and non-strings included, named.
    """
    if isinstance(namespace, str) and _NAMESPACE.fullmatch(namespace):
        return namespace
    raise ValueError(
        f"namespace {namespace!r} is not a service name: use 1 to {MAX_NAMESPACE_LENGTH} "
        "ASCII letters, digits, '.', '_' or '-', e.g. 'billing'"
    )


def scoped_key(principal: str, key: str, host: str = "", namespace: str = "") -> str:
    """The record's primary key: a digest of (namespace, host, principal, key), never the
    raw key.

    ``host`` is the request's ``Host`` when records are scoped by host (the default):
    tenant-per-subdomain apps often have tenant-local user ids, "1" in every tenant.
    ``namespace`` names the service when several share one table; records of different
    namespaces never answer each other.
    """
    # Length-prefix each part so ("a:b", "c") and ("a", "b:c") cannot collide. Without a
    # host (or a namespace) the material is what it was before hosts (namespaces) entered
    # it, so records kept then still match.
    material = f"{len(principal)}:{principal}\x00{key}"
    if host:
        material = f"h{len(host)}:{host}\x00{material}"
    if namespace:
        material = f"n{len(namespace)}:{namespace}\x00{material}"
    return hashlib.sha256(material.encode()).hexdigest()


# The longest route template a record keeps (the column's length); a longer one is cut,
# never refused: the audit's label must not fail a claim.
MAX_ROUTE_LENGTH = 255


def scope_digest(principal: str, host: str = "", namespace: str = "") -> str:
    """A digest of the caller's scope (namespace, host and principal) for the audit, never
    in clear.

    Its material starts with ``s`` where :func:`scoped_key`'s starts with a digit, ``h``
    or ``n``, so a scope digest never equals a record's key.
    """
    material = f"s{len(host)}:{host}\x00{len(principal)}:{principal}"
    if namespace:
        material = f"{material}\x00n{len(namespace)}:{namespace}"
    return hashlib.sha256(material.encode()).hexdigest()

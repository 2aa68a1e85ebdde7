"""The request fingerprint and the canonical JSON it hashes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asgi_idempotency.core.canonical import canonical_json, canonicalize_json_bytes
from asgi_idempotency.http.fingerprint import (
    _form_pairs,
    _multipart_parts,
    fingerprint,
    fingerprint_after,
    is_json,
    request_prefix,
)

JSON = b"application/json"
MULTIPART_BODY = (
    b'--X\r\nContent-Disposition: form-data; name="amount"\r\n\r\n4500\r\n'
    b'--X\r\nContent-Disposition: form-data; name="invoice"; filename="i.pdf"\r\n'
    b"Content-Type: application/pdf\r\n\r\n%PDF\x00\r\n--X--\r\n"
)

# JSON values as a client might build them; numbers span ints past 64 bits and floats
# that are integral, fractional, huge and tiny.
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(min_value=-(2**60), max_value=2**60).map(float),
)
values = st.recursive(
    st.none() | st.booleans() | numbers | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


def _spellings(value: Any) -> list[bytes]:
    """The same document written four ways: compact, indented, with exponents (e, E)."""
    compact = json.dumps(value, separators=(",", ":")).encode()  # ints past 64 bits too
    spaced = json.dumps(value, indent=2).encode()
    exponent = compact.replace(b".0,", b"e0,").replace(b".0}", b"e0}").replace(b".0]", b"e0]")
    return [compact, spaced, exponent, exponent.replace(b"e0", b"E0")]


@settings(max_examples=300, deadline=None)
@given(value=values)
@example(value={"amount": 4500.0, "currency": "EUR"})
@example(value={"amount": 4500, "currency": "EUR"})
@example(value=[2.0**53, 2.0**53 - 1, -(2.0**53) + 1, 1e300, 123456789012345678901234567890])
@example(value={"v": "2.0", "n": 1e2})
def test_bytes_canonicalise_as_the_parsed_value_does(value: Any) -> None:
    for raw in _spellings(value):
        parsed = orjson.loads(raw)
        assert canonicalize_json_bytes(raw) == canonical_json(parsed), raw


def test_integral_floats_and_ints_give_one_fingerprint() -> None:
    spellings = [
        b'{"amount": 4500, "currency": "EUR"}',
        b'{"currency":"EUR","amount":4500.0}',
        b'{"currency":"EUR","amount":4.5e3}',
        b'{"currency":"EUR","amount":45E2}',
    ]
    prints = {fingerprint("POST", "/pay", b"", raw, content_type=JSON) for raw in spellings}
    assert len(prints) == 1


def test_a_changed_amount_changes_the_fingerprint() -> None:
    a = fingerprint("POST", "/pay", b"", b'{"amount": 4500}', content_type=JSON)
    b = fingerprint("POST", "/pay", b"", b'{"amount": 4500.5}', content_type=JSON)
    c = fingerprint("POST", "/pay", b"", b'{"amount": "4500"}', content_type=JSON)
    assert len({a, b, c}) == 3


def test_invalid_json_is_hashed_as_sent() -> None:
    assert canonicalize_json_bytes(b'{"amount": 4500') is None
    assert canonicalize_json_bytes(b"[" * 2000 + b"]" * 2000) is None  # deeper than orjson allows
    a = fingerprint("POST", "/pay", b"", b'{"amount": 4500', content_type=JSON)
    b = fingerprint("POST", "/pay", b"", b'{"amount":4500', content_type=JSON)
    assert a != b


def test_query_order_does_not_matter_but_values_do() -> None:
    base = fingerprint("POST", "/pay", b"a=1&b=2", b"")
    assert fingerprint("POST", "/pay", b"b=2&a=1", b"") == base
    assert fingerprint("POST", "/pay", b"a=1&b=3", b"") != base


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ("POST", "/orders/o-42/refunds", b"", b'{"amount": 4500, "currency": "EUR"}', JSON, ()),
            "fbb78cee9aa111c228959e3472de7bf54c109ddf8e5d9bb92d7a95e1736c36af",
        ),
        (
            ("POST", "/pay", b"b=2&a=1&a=0", b"raw \x00 bytes", b"text/plain",
             ((b"x-tenant", b"t1"), (b"accept", b"*/*"))),
            "f293b8aabf69ab72d56e52b84a4e72d8565936071ea2845e68c8dc87105bbc67",
        ),
        (
            ("PATCH", "/caf\u00e9", b"", b"", None, ()),
            "02544a99fdd80f80f876f657f8b18070d722f8e036506e7eb1fb5f638589a9c4",
        ),
        (
            ("POST", "/pay", b"", b'{"amount": 4500.0', JSON, ()),
            "66e8542e07ad29e81d97901ead3e4ff3dd5cae37d90e228e89a8dcdfe8a1cba0",
        ),
        # Form bodies (marker "f" and "m"), pinned from the release that added them.
        (
            ("POST", "/upload", b"", b"b=2&a=1", b"application/x-www-form-urlencoded", ()),
            "1406fd1de7ad4f402a7682b41600022032c05f0c81f4a8d6602ec9791f73a61e",
        ),
        (
            ("POST", "/upload", b"", MULTIPART_BODY, b"multipart/form-data; boundary=X", ()),
            "05b423e95446ddbb8f9af68f5ffbffeb6442d11a9422a30d61f53b461c8f7443",
        ),
    ],
)  # fmt: skip
def test_fingerprints_are_stable_across_releases(args: tuple[Any, ...], expected: str) -> None:
    # Stored rows carry these digests: a change here turns every key in flight at an
    # upgrade into a 422.
    method, path, query, body, content_type, headers = args
    got = fingerprint(method, path, query, body, content_type=content_type, headers=headers)
    assert got == expected


# What the middleware sends: a query or not, chosen headers or not, JSON or other bodies.
requests = st.tuples(
    st.sampled_from(["POST", "PATCH", "PUT"]),
    st.text(min_size=1, max_size=12).map(lambda s: "/" + s),
    st.sampled_from([b"", b"a=1", b"b=2&a=1&a=0", b"x"]),
    st.one_of(values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=20)),
    st.sampled_from([JSON, b"text/plain", None, b"application/problem+json; charset=utf-8"]),
)


@given(request=requests)
def test_the_per_path_prefix_and_the_fast_path_hash_what_fingerprint_hashes(
    request: tuple[str, str, bytes, bytes, bytes | None],
) -> None:
    # The middleware computes the method-and-path prefix once per path, and requests
    # without a query or chosen headers take a shorter join: neither may change a digest.
    method, path, query, body, content_type = request
    expected = fingerprint(method, path, query, body, content_type=content_type, headers=[])
    prefix = request_prefix(method, path)
    assert fingerprint_after(prefix, query, body, content_type, ()) == expected
    assert fingerprint(method, path, query, body, content_type=content_type) == expected


def test_a_content_type_gives_the_same_answer_from_the_cache_and_past_its_bound() -> None:
    json_types = [b"application/vnd.t%d+json" % i for i in range(300)]  # past the bound
    for content_type, expected in [*((t, True) for t in json_types), (b"text/t", False)]:
        # The first call computes and remembers; the second answers from the cache.
        assert (is_json(content_type), is_json(content_type)) == (expected, expected)
    assert (is_json(b"Application/JSON; charset=utf-8"), is_json(b"application/xml")) == (
        True,
        False,
    )


# --- forms ---------------------------------------------------------------------------------

FORM = b"application/x-www-form-urlencoded"


def _form(body: bytes, content_type: bytes = FORM) -> str:
    return fingerprint("POST", "/upload", b"", body, content_type=content_type)


def test_a_reordered_or_re_encoded_urlencoded_form_is_the_same_request() -> None:
    base = _form(b"name=Ada+Lovelace&amount=4500")
    assert _form(b"amount=4500&name=Ada+Lovelace") == base
    assert _form(b"amount=%34500&name=Ada%20Lovelace&") == base  # %34 is "4", %20 a space
    assert _form(b"amount=4500&name=Ada+Lovelace", FORM + b"; charset=utf-8") == base


@pytest.mark.parametrize(
    "changed",
    [
        b"name=Ada+Lovelace&amount=4501",  # a value
        b"name=Ada+Lovelace&amount=4500&amount=4500",  # a field sent twice
        b"name=Ada+Lovelace&amount=4500&x=",  # an empty field more
        b"name=Ada%2BLovelace&amount=4500",  # a literal "+", not a space
        b"name=Ada+Lovelace&amount%3D4500",  # "amount=4500" as a name with no value
    ],
)
def test_a_changed_urlencoded_field_is_a_different_request(changed: bytes) -> None:
    assert _form(changed) != _form(b"name=Ada+Lovelace&amount=4500")


def _multipart(
    data: dict[str, str], files: dict[str, tuple[str, bytes, str]]
) -> tuple[bytes, bytes]:
    """A multipart body and its content type, as httpx builds them: a fresh boundary each call."""
    request = httpx.Request("POST", "http://test/upload", data=data, files=files)
    return request.read(), request.headers["content-type"].encode()


FILES = {"invoice": ("invoice.pdf", b"%PDF-1.7 \x00\x01 bytes", "application/pdf")}
PDF = FILES["invoice"][1]


def test_a_multipart_form_is_the_same_request_whatever_its_boundary_and_part_order() -> None:
    (a, a_type), (b, b_type) = (_multipart({"amount": "4500"}, FILES) for _ in range(2))
    assert a_type != b_type  # two boundaries,
    assert a != b  # so the raw bytes differ
    assert _form(a, a_type) == _form(b, b_type)
    files = {**FILES, "note": ("note.txt", b"thanks", "text/plain")}
    reordered = {"note": files["note"], "invoice": files["invoice"]}
    c, c_type = _multipart({"amount": "4500", "currency": "EUR"}, files)
    d, d_type = _multipart({"currency": "EUR", "amount": "4500"}, reordered)
    assert _form(c, c_type) == _form(d, d_type)


def _invoice(filename: str, content: bytes, content_type: str) -> dict[str, Any]:
    return {"invoice": (filename, content, content_type)}


@pytest.mark.parametrize(
    ("data", "files"),
    [
        ({"amount": "4501"}, FILES),  # a field's value
        ({"amount": "4500", "x": ""}, FILES),  # one part more
        ({"amount": "4500"}, _invoice("invoice.pdf", PDF[:-1] + b"t", "application/pdf")),  # a byte
        ({"amount": "4500"}, _invoice("other.pdf", PDF, "application/pdf")),
        ({"amount": "4500"}, _invoice("invoice.pdf", PDF, "text/plain")),
        ({"amount": "4500"}, {"receipt": ("invoice.pdf", PDF, "application/pdf")}),
    ],
)  # fmt: skip
def test_a_changed_multipart_part_is_a_different_request(
    data: dict[str, str], files: dict[str, tuple[str, bytes, str]]
) -> None:
    base = _form(*_multipart({"amount": "4500"}, FILES))
    assert _form(*_multipart(data, files)) != base


def test_a_multipart_body_that_does_not_parse_is_hashed_as_sent() -> None:
    body, content_type = _multipart({"amount": "4500"}, FILES)
    cut = body[:-12]  # before the closing boundary
    preamble_missing = body.replace(b"--", b"~~", 1)
    for broken in (cut, preamble_missing):
        assert _form(broken, content_type) == _form(broken, b"application/octet-stream")
    no_boundary = b"multipart/form-data"
    assert _form(body, no_boundary) == _form(body, b"application/octet-stream")
    assert _form(body, content_type) != _form(body, b"application/octet-stream")


def test_each_body_form_has_a_marker_of_its_own() -> None:
    # What a form hashes, sent as a raw body (or as JSON), must not give the form's digest:
    # the marker byte before the material keeps the forms apart.
    pairs = _form_pairs(b"a=1")
    assert pairs == b"1:a=1:1&"
    body, content_type = _multipart({"a": "1"}, FILES)
    parts = _multipart_parts(body, content_type)
    assert parts is not None
    for form, material in ((_form(b"a=1"), pairs), (_form(body, content_type), parts)):
        assert form != _form(material, b"text/plain")
    assert _form(b'"a=1"', JSON) != _form(b'"a=1"', FORM) != _form(b'"a=1"', b"text/plain")


# --- JSON members excluded by a policy ------------------------------------------------------


def _json(body: bytes, exclude: tuple[str, ...] = ()) -> str:
    return fingerprint("POST", "/events", b"", body, content_type=JSON, exclude=exclude)


def test_excluded_members_are_removed_before_canonicalisation() -> None:
    exclude = ("/timestamp", "/meta/request_id")
    a = b'{"amount": 4500, "timestamp": "12:00:01", "meta": {"request_id": "r1", "v": 2}}'
    b = b'{"meta": {"v": 2.0, "request_id": "r2"}, "timestamp": "12:00:09", "amount": 4500}'
    assert _json(a, exclude) == _json(b, exclude) == _json(b'{"amount":4500,"meta":{"v":2}}')
    assert _json(a) != _json(b)


@pytest.mark.parametrize(
    ("body", "exclude", "same_as"),
    [
        (b'{"a/b": 1, "m~n": 2, "k": 3}', ("/a~1b", "/m~0n"), b'{"k": 3}'),
        (b'{"items": [{"n": 1, "nonce": "x"}, {"n": 2}]}', ("/items/0/nonce",),
         b'{"items": [{"n": 1}, {"n": 2}]}'),
        # Each pointer names an element of the document as sent: removing /0 first must
        # not shift what /2 names.
        (b'{"l": [0, 1, 2, 3]}', ("/l/0", "/l/2"), b'{"l": [1, 3]}'),
        (b'{"l": [0, 1]}', ("/l/01", "/l/-", "/l/9", "/l/x"), b'{"l": [0, 1]}'),  # none
        (b'{"": 1, "k": 2}', ("/",), b'{"k": 2}'),  # "/" names the member whose name is ""
        (b'{"a": 1}', ("/a/b", "/missing/deeper"), b'{"a": 1}'),  # names nothing: skipped
        (b'[{"t": 1}, 2]', ("/0/t", "/1/x"), b"[{}, 2]"),
        (b'"just a string"', ("/t",), b'"just a string"'),
    ],
)  # fmt: skip
def test_json_pointers_name_members_and_array_elements_as_rfc_6901_says(
    body: bytes, exclude: tuple[str, ...], same_as: bytes
) -> None:
    assert _json(body, exclude) == _json(same_as)


def test_an_exclusion_leaves_invalid_json_hashed_as_sent() -> None:
    assert _json(b'{"t": 1', ("/t",)) == _json(b'{"t": 1')


def test_an_invalid_pointer_is_refused_by_fingerprint_too() -> None:
    with pytest.raises(ValueError, match="must start with '/'"):
        _json(b"{}", ("t",))


@settings(max_examples=200, deadline=None)
@given(value=values)
def test_excluding_a_pointer_that_names_nothing_keeps_the_default_digest(value: Any) -> None:
    # The exclusion path parses and serialises on its own; where it removes nothing it
    # must give the digest of a policy without exclusions, or turning it on would 422
    # every key in flight.
    body = json.dumps(value).encode()
    absent = "/" + "\x00never"
    assert _json(body, (absent,)) == _json(body)

"""The request fingerprint and the canonical JSON it hashes."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asgi_idempotency.canonical import canonical_json, canonicalize_json_bytes
from asgi_idempotency.fingerprint import fingerprint, fingerprint_after, is_json, request_prefix

JSON = b"application/json"

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

"""The ``Idempotency-Key`` header: one key per request, bare or as a quoted string."""

from __future__ import annotations

import pytest

from asgi_idempotency import MemoryStore
from asgi_idempotency.core.errors import InvalidKey
from asgi_idempotency.core.keys import parse_key
from tests.conftest import TinyFactory

PROBLEM = "application/problem+json"


@pytest.mark.parametrize(
    "raw",
    [
        b"a,b",
        b"a, b",  # the same header sent twice, folded by a proxy (RFC 9110 section 5.3)
        b"order-42,order-42",  # twice the same key is still a list
        b"a,",
        b",a",
        b" a,b\t",
        b'"a", "b"',  # an sf-list of two strings
        b'"a","b"',
        b'"a" ,b',
        b'a, "b"',
    ],
)
def test_a_comma_separated_list_is_not_a_key(raw: bytes) -> None:
    with pytest.raises(InvalidKey, match="comma-separated list") as caught:
        parse_key(raw)
    assert "one key per request" in caught.value.detail


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b'"a,b"', "a,b"),  # RFC 8941 sf-string: a comma inside the quotes is a character
        (b' "a, b" ', "a, b"),
        (b'"\\",\\""', '","'),
    ],
)
def test_a_comma_inside_a_quoted_key_is_part_of_it(raw: bytes, key: str) -> None:
    assert parse_key(raw) == key


def test_a_malformed_quoted_key_keeps_its_own_reason() -> None:
    # Only a comma after the closing quote makes a list; other trailing bytes are a bad string.
    with pytest.raises(InvalidKey, match="not a valid string"):
        parse_key(b'"a"b')


@pytest.mark.anyio
@pytest.mark.parametrize("value", ["a,b", "order-42, order-43", '"a", "b"'])
async def test_the_middleware_answers_a_key_list_with_400_naming_the_reason(
    tiny: TinyFactory, value: str
) -> None:
    store = MemoryStore()
    t = tiny(store)
    async with t.client() as c:
        r = await c.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": value})
    assert r.status_code == 400
    assert r.headers["content-type"] == PROBLEM
    problem = r.json()
    assert problem["type"].endswith("invalid-key")
    assert "comma-separated list" in problem["detail"]
    assert "one key per request" in problem["detail"]
    assert t.calls == {}  # the handler never ran
    assert store._rows == {}  # and nothing was stored


@pytest.mark.anyio
async def test_the_middleware_guards_a_quoted_key_with_a_comma_as_one_key(
    tiny: TinyFactory,
) -> None:
    t = tiny(MemoryStore())
    async with t.client() as c:
        first = await c.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": '"a,b"'})
        again = await c.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": '"a,b"'})
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert t.calls == {"pay": 1}

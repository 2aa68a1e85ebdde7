"""Hostile and malformed input, property-based: headers, bodies, principals, logs.

Every request gets the handler's normal answer or a clear 4xx
``application/problem+json`` from the guard: never a 500, never a stored record for
a request the guard rejected, never the handler twice for one key, never another
principal's stored response, and never a raw key or body in any log record.

Requests are driven in-process with exact header bytes and body chunks (``asgi_call``),
so no client library normalises the hostile parts away. Each example runs under a
principal of its own, so examples sharing one store cannot see each other's keys.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime

import orjson
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from starlette.applications import Starlette
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    BaseUser,
    SimpleUser,
)
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy, SQLStore
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.http.asgi import Scope
from asgi_idempotency.stores.base import Store
from asgi_idempotency.stores.sql.schema import records
from tests.conftest import APP_KINDS, app_store

from .apps import RawResponse, asgi_call

pytestmark = pytest.mark.anyio

# Hostile requests meet the middleware, not the store: one store of each family
# (the store contract holds every kind to the same rules).
store = pytest.fixture(params=APP_KINDS, name="store")(app_store)

LIMIT = 128 * 1024  # the route's body limit: room for 100 000 '['
PROBLEM = b"application/problem+json"
HYPO = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class BearerBackend(AuthenticationBackend):
    """``Authorization: Bearer <name>`` authenticates ``name``; no header is anonymous."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        auth = conn.headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            return None
        return AuthCredentials(["authenticated"]), SimpleUser(auth.removeprefix("Bearer "))


def _user_or_anonymous(scope: Scope) -> str:
    """The authenticated user's identity; a request without credentials is anonymous."""
    user = scope["user"]
    return str(user.identity) if user.is_authenticated else ""


class Hostile:
    """A guarded echo app behind Starlette's authentication, counting handler runs."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.runs: dict[str, int] = {}  # principal -> handler runs

        async def echo(request: Request) -> Response:
            who = request.user.display_name if request.user.is_authenticated else ""
            self.runs[who] = self.runs.get(who, 0) + 1
            body = await request.body()
            try:
                data = orjson.loads(body)
            except (orjson.JSONDecodeError, RecursionError):
                # The handler's own normal answer to bad input (a final 4xx: stored).
                return JSONResponse({"error": "invalid json", "user": who}, status_code=400)
            return JSONResponse(
                {"id": uuid.uuid4().hex, "user": who, "data": data}, status_code=201
            )

        self.app = Starlette(
            routes=[Route("/echo", echo, methods=["POST"])],
            middleware=[
                Middleware(AuthenticationMiddleware, backend=BearerBackend()),
                Middleware(
                    IdempotencyMiddleware,
                    store=store,
                    principal=_user_or_anonymous,
                    policies={"POST /echo": Policy(required=True, max_body_bytes=LIMIT)},
                ),
            ],
        )

    async def post(
        self,
        user: str | None,
        key_headers: Iterable[bytes],
        chunks: list[bytes],
        *,
        content_length: str | None = "exact",
    ) -> RawResponse:
        headers = [(b"content-type", b"application/json")]
        headers += [(b"idempotency-key", k) for k in key_headers]
        if user is not None:
            headers.append((b"authorization", b"Bearer " + user.encode()))
        if content_length == "exact":
            headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
        elif content_length is not None:
            headers.append((b"content-length", content_length.encode()))
        return await asgi_call(self.app, "POST", "/echo", headers, chunks)

    async def record_count(self) -> int:
        if isinstance(self.store, MemoryStore):
            return len(self.store._rows)
        if not isinstance(self.store, SQLStore):  # Redis: its admin scan counts the keys
            return sum(b.count for b in await self.store.buckets(now=datetime.now(UTC)))
        async with self.store.engine.connect() as conn:
            return int(await conn.scalar(select(func.count()).select_from(records)) or 0)


def _expected_key(raw: bytes) -> str | None:
    """An oracle written from the spec, independent of ``keys.parse_key``."""
    v = raw.strip(b" \t")
    if v.startswith(b'"'):
        m = re.fullmatch(rb'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"', v)
        if m is None:
            return None
        key = re.sub(rb'\\(["\\])', rb"\1", m.group(1)).decode()
    elif re.fullmatch(rb"[\x21-\x2b\x2d-\x7e]+", v):  # a bare comma separates a list
        key = v.decode()
    else:
        return None
    return key if 1 <= len(key) <= 255 else None


def _assert_problem(r: RawResponse, status: int, slug: str) -> None:
    assert r.status == status, (r.status, r.body[:200])
    assert r.header(b"content-type") == PROBLEM
    problem = orjson.loads(r.body)
    assert problem["status"] == status
    assert problem["type"] == f"urn:asgi-idempotency:problem:{slug}"
    assert problem["detail"]


# A record's own metadata: a generated key can match the logger's name or a path by
# chance. Its message, arguments, exception text and extra fields are all checked.
_RECORD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) - {
    "msg",
    "args",
    "exc_info",
    "exc_text",
    "stack_info",
}


def _assert_nothing_logged(caplog: pytest.LogCaptureFixture, *secrets: bytes | str) -> None:
    """No record's message, arguments or extra fields contain any of ``secrets``.

    Checked: every record of this library's loggers at any level, and every record of
    any logger at INFO and above. Not checked: other libraries' DEBUG output, which is
    theirs to keep quiet (aiosqlite's DEBUG logger prints every statement's parameters,
    stored response bodies included; do not run it at DEBUG in production).
    """
    needles: list[str] = []
    for s in secrets:
        text = s.decode("latin-1") if isinstance(s, bytes) else s
        if len(text) >= 12:  # shorter strings occur by chance in paths and names
            needles.append(text)
    for record in caplog.records:
        if not record.name.startswith("asgi_idempotency") and record.levelno < logging.INFO:
            continue
        extra = (v for k, v in record.__dict__.items() if k not in _RECORD_ATTRIBUTES)
        fields = [record.getMessage(), *map(str, record.args or ()), *map(str, extra)]
        # The event's own name ("idempotency.replay") is fixed text, not data: a
        # generated key such as "idempotency." matches it by chance.
        event = record.__dict__.get("event")
        if isinstance(event, str) and event.startswith("idempotency."):
            fields = [f.replace(event, "") for f in fields]
        for needle in needles:
            assert not any(needle in f for f in fields), (record.name, record.msg, needle[:40])


def _user() -> str:
    return f"user-{uuid.uuid4().hex}"


# --- header values ---------------------------------------------------------------------

printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)
header_values = st.one_of(
    st.sampled_from([b"", b" ", b"\t", b" \t ", b'""', b'"', b'"a', b'"\\x"', b"a b"]),
    printable.map(str.encode),
    printable.map(lambda s: b'"' + s.replace("\\", "\\\\").replace('"', '\\"').encode() + b'"'),
    st.integers(250, 300).map(lambda n: b"k" * n),
    st.integers(250, 300).map(lambda n: b'"' + b"q" * n + b'"'),
    st.text(min_size=1, max_size=40).map(lambda s: s.encode("utf-8")),  # non-ASCII
    st.tuples(printable, st.sampled_from([*range(0x20), 0x7F, 0x80, 0xFF]), printable).map(
        lambda t: t[0].encode()[:100] + bytes([t[1]]) + t[2].encode()[:100]
    ),
    st.binary(max_size=300),
)


@HYPO
@given(raw=header_values)
@example(raw=b"")
@example(raw=b"   ")
@example(raw=b"k" * 255)
@example(raw=b"k" * 256)
@example(raw=b'"' + b"q" * 256 + b'"')
@example(raw=b"ord\x00er")
@example(raw=b"order\r\nx-injected: 1")
@example(raw="cl\u00e9".encode())
@example(raw=b'"order 42"')
@example(raw=b'"unterminated')
@example(raw=b"a,b")  # a list: 400
@example(raw=b'"a,b"')  # one quoted key with a comma in it
async def test_any_header_value_gets_the_handler_or_a_clear_400(
    store: Store, caplog: pytest.LogCaptureFixture, raw: bytes
) -> None:
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    h, user, body = Hostile(store), _user(), b'{"amount": 1}'
    before = await h.record_count()
    first = await h.post(user, [raw], [body])
    key = _expected_key(raw)
    event("accepted" if key is not None else "rejected")
    if key is None:
        _assert_problem(first, 400, "invalid-key")
        assert h.runs == {}
        assert await h.record_count() == before  # nothing stored for a rejected request
    else:
        assert first.status == 201, (raw, first.body[:200])
        again = await h.post(user, [raw], [body])
        assert again.status == 201
        assert again.header(b"idempotent-replayed") == b"true"
        assert again.body == first.body
        assert h.runs == {user: 1}
        assert await h.record_count() == before + 1
        assert await store.get(scoped_key(user, key)) is not None
    _assert_nothing_logged(caplog, raw, body)


@HYPO
@given(
    key=st.text(
        # A comma is legal only inside the quoted form; outside it makes a list (a 400).
        st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=","),
        min_size=1,
        max_size=255,
    )
)
async def test_quoted_and_bare_forms_are_one_key(store: Store, key: str) -> None:
    if key.startswith('"'):
        key = "k" + key[1:]  # a bare token cannot start with a quote
    quoted = b'"' + key.replace("\\", "\\\\").replace('"', '\\"').encode() + b'"'
    h, user = Hostile(store), _user()
    bare = await h.post(user, [key.encode()], [b"{}"])
    sf = await h.post(user, [b" " + quoted + b"\t"], [b"{}"])
    assert (bare.status, sf.status) == (201, 201)
    assert sf.header(b"idempotent-replayed") == b"true"
    assert h.runs == {user: 1}


@pytest.mark.parametrize(
    "values",
    [[b"a-key", b"a-key"], [b"a-key", b"other"], [b"a-key", b""], [b"a-key", b'"a-key"']],
)
async def test_duplicate_key_headers_are_400_and_store_nothing(
    store: Store, values: list[bytes]
) -> None:
    h = Hostile(store)
    r = await h.post(_user(), values, [b"{}"])
    _assert_problem(r, 400, "invalid-key")
    assert h.runs == {}
    assert await h.record_count() == 0


# --- bodies ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
bodies = st.one_of(
    json_values.map(orjson.dumps),
    st.binary(max_size=2000),  # mostly invalid JSON
    st.binary(min_size=1, max_size=200).map(lambda b: b'{"s": "\xff\xfe' + b + b'"}'),  # not UTF-8
    st.integers(1000, 100_000).map(lambda n: b"[" * n),  # deeply nested, unterminated
    st.integers(1000, 50_000).map(lambda n: b"[" * n + b"]" * n),  # deeply nested, valid
    st.integers(LIMIT - 2, LIMIT + 2).map(lambda n: b'"' + b"x" * (n - 2) + b'"'),  # at the limit
    st.integers(LIMIT + 1, LIMIT * 2).map(lambda n: b" " * n),  # over it
)


def _chunks(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(body) + 1) for c in cuts})
    out, last = [], 0
    for p in [*points, len(body)]:
        out.append(body[last:p])
        last = p
    return out


@HYPO
@example(body=b"[" * 100_000, cuts=[], content_length="exact")
@example(body=b"[" * 100_000, cuts=[7, 50_000], content_length=None)
@example(body=b'"' + b"x" * (LIMIT - 2) + b'"', cuts=[], content_length="exact")
@example(body=b" " * (LIMIT + 1), cuts=[10, 20], content_length=None)
@example(body=b" " * (LIMIT + 1), cuts=[], content_length="exact")
@example(body=b'{"a": "\xff\xfe"}', cuts=[3], content_length="exact")
@example(body=b"{not json", cuts=[], content_length="bogus")
@example(body=b"", cuts=[], content_length=None)
@given(
    body=bodies,
    cuts=st.lists(st.integers(0, 2**20), max_size=4),
    content_length=st.sampled_from(["exact", None, "bogus"]),
)
async def test_any_body_gets_the_handler_or_a_clear_413(
    store: Store,
    caplog: pytest.LogCaptureFixture,
    body: bytes,
    cuts: list[int],
    content_length: str | None,
) -> None:
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    h, user, key = Hostile(store), _user(), f"body-key-{uuid.uuid4().hex}"
    chunks = _chunks(body, cuts)  # several chunks without Content-Length: a chunked body
    before = await h.record_count()
    first = await h.post(user, [key.encode()], chunks, content_length=content_length)
    event(f"status {first.status}, {len(chunks)} chunk(s), content-length {content_length}")
    if len(body) > LIMIT:
        _assert_problem(first, 413, "body-too-large")
        assert h.runs == {}
        assert await h.record_count() == before
        assert await store.get(scoped_key(user, key)) is None
    else:
        try:
            orjson.loads(body)
            expected = 201
        except orjson.JSONDecodeError:
            expected = 400  # the handler's own answer, stored like any final 4xx
        assert first.status == expected, first.body[:200]
        assert first.header(b"content-type") == b"application/json"
        again = await h.post(user, [key.encode()], chunks, content_length=content_length)
        assert again.status == expected
        assert again.header(b"idempotent-replayed") == b"true"
        assert again.body == first.body
        assert h.runs == {user: 1}
        assert await h.record_count() == before + 1
    _assert_nothing_logged(caplog, key, body[:64], body[-64:])


# --- principals ----------------------------------------------------------------------------


@HYPO
@given(
    key=st.text(
        # Bare tokens: no leading quote, and no comma (which would make a list, a 400).
        st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=","),
        min_size=1,
        max_size=64,
    ).filter(lambda k: not k.startswith('"')),
    same_body=st.booleans(),
    anonymous_second=st.booleans(),
)
# A key that is part of the logger's own name must not read as a leaked key.
@example(key="asgi_idempot", same_body=False, anonymous_second=False)
async def test_a_key_reused_across_principals_never_leaks_a_response(
    store: Store,
    caplog: pytest.LogCaptureFixture,
    key: str,
    same_body: bool,
    anonymous_second: bool,
) -> None:
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    h = Hostile(store)
    alice = _user()
    bob = None if anonymous_second else _user()
    secret = f"alice-secret-{uuid.uuid4().hex}"
    alice_body = orjson.dumps({"note": secret})
    bob_body = alice_body if same_body else b'{"note": "bob"}'
    anon_key = f"{key}-{uuid.uuid4().hex}" if anonymous_second else key  # anon share one scope

    a1 = await h.post(alice, [key.encode()], [alice_body])
    b1 = await h.post(bob, [anon_key.encode()], [bob_body])
    a2 = await h.post(alice, [key.encode()], [alice_body])
    b2 = await h.post(bob, [anon_key.encode()], [bob_body])

    assert (a1.status, b1.status) == (201, 201)
    assert b1.header(b"idempotent-replayed") is None  # bob ran his own request
    assert orjson.loads(b1.body)["user"] == (bob or "")
    if not same_body:
        assert secret.encode() not in b1.body
    assert orjson.loads(b1.body)["id"] != orjson.loads(a1.body)["id"]
    assert a2.body == a1.body
    assert b2.body == b1.body
    assert h.runs == {alice: 1, (bob or ""): 1}
    stored = await store.get(scoped_key(bob or "", anon_key))
    assert stored is not None
    assert stored.response is not None
    assert stored.response.body == b1.body
    _assert_nothing_logged(caplog, key if len(key) >= 12 else "", secret, alice_body)


async def test_every_guard_path_logs_no_raw_key_and_no_body(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Replay, 409, 422, 413, 400: each logs (or not) without the key or the body."""
    caplog.set_level(logging.DEBUG)
    h, user = Hostile(store), _user()
    key = f"raw-key-{uuid.uuid4().hex}".encode()
    body = orjson.dumps({"card": f"4111-{uuid.uuid4().hex}"})
    other = orjson.dumps({"card": f"5500-{uuid.uuid4().hex}"})
    statuses = [
        (await h.post(user, [key], [body])).status,
        (await h.post(user, [key], [body])).status,  # replay
        (await h.post(user, [key], [other])).status,  # mismatch
        (await h.post(user, [key], [b" " * (LIMIT + 1)])).status,  # too large
        (await h.post(user, [key + b"\x00"], [body])).status,  # invalid key
        (await h.post(user, [key, key], [body])).status,  # duplicated header
    ]
    assert statuses == [201, 201, 422, 413, 400, 400]
    assert caplog.records  # the guard did log (mismatch, replay): the check is not vacuous
    _assert_nothing_logged(caplog, key, body, other, user)

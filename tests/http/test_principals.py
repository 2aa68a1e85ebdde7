"""Who the caller is: two callers with one key and one body never see each other's answer.

Every wiring a FastAPI or Starlette service authenticates with, built from the real
pieces (FastAPI security dependencies, SessionMiddleware and a login view, Starlette's
AuthenticationMiddleware, gateway headers): the guard either scopes the callers apart
or refuses, naming the setting, and with the helpers each caller gets their own run
while the same caller's retry (after a token refresh, a re-signed cookie) replays.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.security import (
    APIKeyCookie,
    APIKeyHeader,
    HTTPAuthorizationCredentials,
    HTTPBasic,
    HTTPBasicCredentials,
    HTTPBearer,
    OAuth2PasswordBearer,
)
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    BaseUser,
    SimpleUser,
)
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.middleware.sessions import SessionMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse, Response
from starlette.routing import Host, Mount, Route

from asgi_idempotency import (
    IdempotencyMiddleware,
    InMemoryMetrics,
    MemoryStore,
    Outcome,
    Policy,
    idempotent,
)
from asgi_idempotency.http.principals import (
    ANONYMOUS,
    from_dependency,
    from_headers,
    from_session,
    from_user,
)
from tests.apps import guarded
from tests.helpers.lifespan import refuses, served

pytestmark = pytest.mark.anyio

KEY = "refund-A-88214"
BODY = {"order": "A-88214", "amount_p": 4500}


class RefundIn(BaseModel):
    order: str
    amount_p: int


@dataclass
class Effects:
    """Who each run of the handler was for (and, for nested guards, what each counted)."""

    runs: list[str] = field(default_factory=list)
    store: MemoryStore = field(default_factory=MemoryStore)
    outer: InMemoryMetrics = field(default_factory=InMemoryMetrics)
    inner: InMemoryMetrics = field(default_factory=InMemoryMetrics)


# --- FastAPI auth in a dependency ------------------------------------------------------

# Tokens as an identity provider hands them out: several per user over time (a refresh
# gives a new one), each naming its user.
TOKENS = {"tok-alice-1": "alice", "tok-alice-2": "alice", "tok-bob-1": "bob"}


@dataclass(frozen=True)
class User:
    id: str


Wiring = Callable[[Effects, Any], FastAPI]


def _refund_route(app_or_router: FastAPI | APIRouter, effects: Effects, *deps: Any) -> None:
    @app_or_router.post("/refunds", status_code=201, dependencies=list(deps))
    @idempotent(required=True)
    async def refund(body: RefundIn, request: Request) -> dict[str, Any]:
        effects.runs.append(request.headers.get("x-who", "?"))
        return {"refund": len(effects.runs), "order": body.order}


def bearer_in_endpoint(effects: Effects, principal: Any) -> FastAPI:
    scheme = HTTPBearer()

    def current_user(creds: HTTPAuthorizationCredentials = Depends(scheme)) -> User:
        if creds.credentials not in TOKENS:
            raise HTTPException(401, "bad token")
        return User(TOKENS[creds.credentials])

    app = FastAPI()
    app.state.dep = current_user

    @app.post("/refunds", status_code=201)
    @idempotent(required=True)
    async def refund(body: RefundIn, user: User = Depends(current_user)) -> dict[str, Any]:
        effects.runs.append(user.id)
        return {"refund": len(effects.runs), "for": user.id}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **_principal(principal, app))
    return app


def _principal(principal: Any, app: FastAPI) -> dict[str, Any]:
    if principal == "dep":
        return {"principal": from_dependency(app.state.dep)}
    return {} if principal is None else {"principal": principal}


def _auth_dep_app(make_scheme: Callable[[], Any], read: Callable[[Any], str], where: str) -> Wiring:
    """A wiring where ``scheme`` reads the token and ``read`` turns its result into a token."""

    def build(effects: Effects, principal: Any) -> FastAPI:
        scheme = make_scheme()

        def current_user(found: Any = Depends(scheme)) -> str:
            token = read(found)
            if token not in TOKENS:
                raise HTTPException(401, "bad credentials")
            return TOKENS[token]

        app = FastAPI(dependencies=[Depends(current_user)] if where == "app" else [])
        app.state.dep = current_user
        if where == "router":
            router = APIRouter(dependencies=[Depends(current_user)])
            _refund_route(router, effects)
            app.include_router(router, prefix="/v1")
        elif where == "app":
            _refund_route(app, effects)
        else:
            _refund_route(app, effects, Depends(current_user))
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **_principal(principal, app))
        return app

    return build


def _basic(token: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{token}:pw".encode()).decode()}


@dataclass(frozen=True)
class Case:
    build: Wiring
    path: str
    creds: Callable[[str], dict[str, str]]  # token -> the headers/cookies that carry it


def _header(name: str, prefix: str = "") -> Callable[[str], dict[str, str]]:
    return lambda token: {name: prefix + token}


CASES = {
    "HTTPBearer in the endpoint": Case(
        bearer_in_endpoint, "/refunds", _header("authorization", "Bearer ")
    ),
    "APIKeyHeader in dependencies=[...]": Case(
        _auth_dep_app(lambda: APIKeyHeader(name="X-API-Key"), str, "route"),
        "/refunds",
        _header("x-api-key"),
    ),
    "OAuth2PasswordBearer on the router": Case(
        _auth_dep_app(lambda: OAuth2PasswordBearer(tokenUrl="/token"), str, "router"),
        "/v1/refunds",
        _header("authorization", "Bearer "),
    ),
    "APIKeyCookie on the app": Case(
        _auth_dep_app(lambda: APIKeyCookie(name="session"), str, "app"),
        "/refunds",
        _header("cookie", "session="),
    ),
    "HTTP Basic": Case(
        _auth_dep_app(
            HTTPBasic, lambda c: c.username if isinstance(c, HTTPBasicCredentials) else "", "route"
        ),
        "/refunds",
        _basic,
    ),
    "a token in a Header() parameter": Case(
        _auth_dep_app(
            lambda: lambda x_token: x_token,  # replaced below: Header() needs a signature
            str,
            "route",
        ),
        "/refunds",
        _header("x-token"),
    ),
}


def _header_token_app(effects: Effects, principal: Any) -> FastAPI:
    def current_user(x_token: Annotated[str, Header()]) -> str:
        if x_token not in TOKENS:
            raise HTTPException(401, "bad token")
        return TOKENS[x_token]

    app = FastAPI()
    app.state.dep = current_user
    _refund_route(app, effects, Depends(current_user))
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **_principal(principal, app))
    return app


CASES["a token in a Header() parameter"] = Case(_header_token_app, "/refunds", _header("x-token"))


CHOICES = ("from_dependency(", "from_user()", "from_session(", "from_headers(", "ANONYMOUS")


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_fastapi_auth_without_a_principal_does_not_start(case: Case) -> None:
    app = case.build(Effects(), None)
    with pytest.raises(TypeError) as refused:
        app.build_middleware_stack()  # what Starlette does as it starts
    assert all(choice in str(refused.value) for choice in CHOICES), refused.value


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
async def test_fastapi_auth_dependency_scopes_each_caller(case: Case) -> None:
    effects = Effects()
    app = case.build(effects, "dep")
    async with served(app) as c:

        def post(token: str) -> Any:
            return c.post(
                case.path, json=BODY, headers={"Idempotency-Key": KEY, **case.creds(token)}
            )

        alice = await post("tok-alice-1")
        bob = await post("tok-bob-1")
        assert alice.status_code == bob.status_code == 201, (alice.text, bob.text)
        assert "idempotent-replayed" not in bob.headers  # Bob never gets Alice's refund
        assert alice.json() != bob.json()
        # The same user after a token refresh: a replay, not a second refund.
        again = await post("tok-alice-2")
        assert again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == alice.json()
    assert len(effects.runs) == 2


async def test_a_failed_login_and_a_validation_422_are_never_stored() -> None:
    effects = Effects()
    app = bearer_in_endpoint(effects, "dep")
    async with served(app) as c:
        headers = {"Idempotency-Key": KEY, "authorization": "Bearer expired"}
        assert (await c.post("/refunds", json=BODY, headers=headers)).status_code == 401
        headers["authorization"] = "Bearer tok-alice-1"
        bad = await c.post("/refunds", json={"order": "A-88214"}, headers=headers)
        assert bad.status_code == 422  # FastAPI's own validation: the endpoint never ran
        assert "idempotent-replayed" not in bad.headers
        ok = await c.post("/refunds", json=BODY, headers=headers)
        assert ok.status_code == 201, ok.text  # the fixed request runs: nothing was stored
        assert "idempotent-replayed" not in ok.headers
        replay = await c.post("/refunds", json=BODY, headers=headers)
        assert replay.headers["idempotent-replayed"] == "true"
    assert effects.runs == ["alice"]


async def test_a_missing_required_header_422_is_not_stored() -> None:
    effects = Effects()
    app = FastAPI()

    def current_user(authorization: Annotated[str, Header()]) -> str:
        return TOKENS[authorization]

    @app.post("/refunds", status_code=201)
    @idempotent(required=True)
    async def refund(
        body: RefundIn, x_order_ref: Annotated[str, Header()], user: str = Depends(current_user)
    ) -> dict[str, str]:
        effects.runs.append(user)
        return {"ref": x_order_ref}

    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), principal=from_dependency(current_user)
    )
    async with served(app) as c:
        headers = {"Idempotency-Key": KEY, "authorization": "tok-bob-1"}
        assert (await c.post("/refunds", json=BODY, headers=headers)).status_code == 422
        fixed = await c.post("/refunds", json=BODY, headers={**headers, "x-order-ref": "r1"})
        assert fixed.status_code == 201
        assert fixed.json() == {"ref": "r1"}
    assert effects.runs == ["bob"]


async def test_the_claim_runs_once_under_a_storm_of_one_caller() -> None:
    effects = Effects()
    app = bearer_in_endpoint(effects, "dep")
    async with served(app) as c:
        headers = {"Idempotency-Key": KEY, "authorization": "Bearer tok-alice-1"}
        answers = await asyncio.gather(
            *(c.post("/refunds", json=BODY, headers=headers) for _ in range(20))
        )
    codes = sorted(a.status_code for a in answers)
    assert set(codes) <= {201, 409}
    assert effects.runs == ["alice"]


def test_a_security_scheme_is_not_a_principal() -> None:
    with pytest.raises(TypeError, match="credentials"):
        from_dependency(HTTPBearer())


async def test_a_dependency_result_without_identity_is_a_500_naming_the_fix() -> None:
    class Account:
        display_name = "Jordan Lee"

    def current_account() -> Account:
        return Account()

    app = FastAPI()

    @app.post("/refunds", status_code=201)
    async def refund(account: Any = Depends(current_account)) -> dict[str, str]:
        raise AssertionError("must not run")

    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), principal=from_dependency(current_account)
    )
    async with served(app) as c:
        r = await c.post("/refunds", json=BODY, headers={"Idempotency-Key": KEY})
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/problem+json"
    assert "identity" in r.json()["detail"]


async def test_an_explicit_policy_on_a_route_without_the_dependency_is_refused() -> None:
    def current_user() -> str:
        return "alice"

    app = FastAPI()

    @app.post("/public", status_code=201)
    async def public() -> dict[str, str]:
        return {}

    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        principal=from_dependency(current_user),
        policies={"POST /public": Policy(required=True)},
    )
    message = await refuses(app)
    assert "POST /public" in message
    assert "Depends(current_user)" in message


# --- Sessions ----------------------------------------------------------------------------


def session_app(effects: Effects, principal: Any, *, guard_outside: bool = False) -> Starlette:
    async def login(request: Request) -> Response:
        request.session["user_id"] = request.query_params["user"]
        return JSONResponse({"ok": True})

    @idempotent(required=True)
    async def refund(request: Request) -> Response:
        effects.runs.append(request.session.get("user_id", "?"))
        return JSONResponse({"refund": len(effects.runs)}, status_code=201)

    guard = Middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        **({} if principal is None else {"principal": principal}),
    )
    session = Middleware(SessionMiddleware, secret_key="s3cret")
    return Starlette(
        routes=[
            Route("/login", login, methods=["POST"]),
            Route("/refunds", refund, methods=["POST"]),
        ],
        middleware=[guard, session] if guard_outside else [session, guard],
    )


def test_session_middleware_without_a_principal_does_not_start() -> None:
    with pytest.raises(TypeError, match=r"from_session\("):
        session_app(Effects(), None).build_middleware_stack()


async def test_from_session_inside_session_middleware_is_refused() -> None:
    message = await refuses(session_app(Effects(), from_session("user_id"), guard_outside=True))
    assert "SessionMiddleware is inside IdempotencyMiddleware" in message


async def test_from_session_scopes_each_user_and_a_re_signed_cookie_replays() -> None:
    effects = Effects()
    app = session_app(effects, from_session("user_id"))
    async with served(app) as alice, served(app) as bob:
        await alice.post("/login?user=alice")
        await bob.post("/login?user=bob")
        a = await alice.post("/refunds", json=BODY, headers={"Idempotency-Key": KEY})
        b = await bob.post("/refunds", json=BODY, headers={"Idempotency-Key": KEY})
        assert a.status_code == b.status_code == 201
        assert "idempotent-replayed" not in b.headers
        old_cookie = alice.cookies["session"]
        await asyncio.sleep(1.1)  # itsdangerous signs with a timestamp in seconds
        await alice.post("/login?user=alice")  # a fresh login: the same user, a new cookie
        assert alice.cookies["session"] != old_cookie
        again = await alice.post("/refunds", json=BODY, headers={"Idempotency-Key": KEY})
        assert again.headers["idempotent-replayed"] == "true"
        async with served(app) as nobody:
            anon = await nobody.post("/refunds", json=BODY, headers={"Idempotency-Key": KEY})
            assert anon.status_code == 401
            assert anon.json()["type"] == "urn:asgi-idempotency:problem:unauthenticated"
    assert effects.runs == ["alice", "bob"]


# --- Gateway headers and hosts ------------------------------------------------------------


def gateway_app(effects: Effects, **guard: Any) -> Starlette:
    @idempotent(required=True)
    async def subscribe(request: Request) -> Response:
        effects.runs.append(
            request.headers.get("x-tenant-id", "") + "/" + request.headers.get("x-user-id", "")
        )
        return JSONResponse({"subscription": len(effects.runs)}, status_code=201)

    return Starlette(
        routes=[Route("/subscriptions", subscribe, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), **guard)],
    )


def test_gateway_headers_without_a_principal_do_not_start() -> None:
    with pytest.raises(TypeError, match=r"from_headers\("):
        gateway_app(Effects()).build_middleware_stack()  # what Starlette does as it starts


async def test_from_headers_keeps_tenants_apart() -> None:
    effects = Effects()
    app = gateway_app(effects, principal=from_headers("X-Tenant-Id", "X-User-Id"))
    async with served(app) as c:
        answers = [
            await c.post(
                "/subscriptions",
                json=BODY,
                headers={"Idempotency-Key": KEY, "X-Tenant-Id": tenant, "X-User-Id": "1"},
            )
            for tenant in ("acme", "globex", "acme")
        ]
        missing = await c.post("/subscriptions", json=BODY, headers={"Idempotency-Key": KEY})
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert "idempotent-replayed" not in answers[1].headers
    assert answers[2].headers["idempotent-replayed"] == "true"
    assert missing.status_code == 401
    assert effects.runs == ["acme/1", "globex/1"]


async def test_tenant_local_ids_on_two_subdomains_stay_apart() -> None:
    effects = Effects()
    app = gateway_app(effects, principal=from_headers("X-User-Id"))
    async with (
        served(app, "http://acme.shop.example") as acme,
        served(app, "http://globex.shop.example") as globex,
    ):
        headers = {"Idempotency-Key": KEY, "X-User-Id": "1"}
        first = await acme.post("/subscriptions", json=BODY, headers=headers)
        other = await globex.post("/subscriptions", json=BODY, headers=headers)
        again = await acme.post("/subscriptions", json=BODY, headers=headers)
    assert "idempotent-replayed" not in other.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert first.json() == again.json() != other.json()
    assert len(effects.runs) == 2


async def test_scope_by_host_off_shares_records_across_names() -> None:
    effects = Effects()
    app = gateway_app(effects, principal=from_headers("X-User-Id"), scope_by_host=False)
    async with served(app, "http://a.example") as a, served(app, "http://b.example") as b:
        headers = {"Idempotency-Key": KEY, "X-User-Id": "1"}
        await a.post("/subscriptions", json=BODY, headers=headers)
        via_b = await b.post("/subscriptions", json=BODY, headers=headers)
    assert via_b.headers["idempotent-replayed"] == "true"
    assert len(effects.runs) == 1


# --- Starlette users ----------------------------------------------------------------------


class NamedUser(BaseUser):
    """A user class as many apps write it: a display name, no identity."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.name


class Backend(AuthenticationBackend):
    def __init__(self, user: Callable[[str], BaseUser]) -> None:
        self.user = user

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        token = conn.headers.get("authorization", "").removeprefix("Bearer ")
        if token not in TOKENS:
            return None
        return AuthCredentials(["authenticated"]), self.user(TOKENS[token])


def starlette_auth_app(
    effects: Effects, user: Callable[[str], BaseUser], *, inside: bool = False, **guard: Any
) -> Starlette:
    @idempotent(required=True)
    async def refund(request: Request) -> Response:
        effects.runs.append(request.user.display_name)
        return JSONResponse({"refund": len(effects.runs)}, status_code=201)

    auth = Middleware(AuthenticationMiddleware, backend=Backend(user))
    idem = Middleware(IdempotencyMiddleware, store=MemoryStore(), **guard)
    return Starlette(
        routes=[Route("/refunds", refund, methods=["POST"])],
        middleware=[idem, auth] if inside else [auth, idem],
    )


async def test_authentication_middleware_inside_the_guard_is_refused() -> None:
    message = await refuses(
        starlette_auth_app(Effects(), SimpleUser, inside=True, principal=from_user())
    )
    assert "AuthenticationMiddleware is inside IdempotencyMiddleware" in message


async def test_a_user_without_identity_is_a_500_never_its_display_name() -> None:
    effects = Effects()
    app = starlette_auth_app(effects, lambda name: NamedUser("Jordan Lee"), principal=from_user())
    async with served(app) as c:
        r = await c.post(
            "/refunds",
            json=BODY,
            headers={"Idempotency-Key": KEY, "authorization": "Bearer tok-alice-1"},
        )
    assert r.status_code == 500
    assert "identity" in r.json()["detail"]
    assert effects.runs == []


async def test_from_user_finds_an_authenticated_user_s_identity() -> None:
    effects = Effects()

    class Person(SimpleUser):
        @property
        def identity(self) -> str:
            return "user-" + self.username

    app = starlette_auth_app(effects, Person, principal=from_user())
    async with served(app) as c:

        def post(token: str) -> Any:
            return c.post(
                "/refunds",
                json=BODY,
                headers={"Idempotency-Key": KEY, "authorization": f"Bearer {token}"},
            )

        alice = await post("tok-alice-1")
        bob = await post("tok-bob-1")
        again = await post("tok-alice-2")
    assert alice.status_code == 201
    assert "idempotent-replayed" not in bob.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert effects.runs == ["alice", "bob"]


@pytest.mark.parametrize(
    "identity", [lambda u: "id:" + u.name, "name"], ids=["function", "attribute"]
)
async def test_from_user_with_an_identity_function(identity: Any) -> None:
    effects = Effects()
    app = starlette_auth_app(effects, NamedUser, principal=from_user(identity=identity))
    async with served(app) as c:
        first = await c.post(
            "/refunds",
            json=BODY,
            headers={"Idempotency-Key": KEY, "authorization": "Bearer tok-alice-1"},
        )
        anon = await c.post("/refunds", json=BODY, headers={"Idempotency-Key": KEY})
    assert first.status_code == 201
    assert anon.status_code == 401
    assert effects.runs == ["alice"]


async def test_anonymous_callers_share_keys_only_when_the_app_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    effects = Effects()
    ANONYMOUS.warned = False  # once per process: this test looks at the first time
    caplog.set_level(logging.WARNING, logger="asgi_idempotency")
    async with served(gateway_app(effects, principal=ANONYMOUS)) as c:
        headers = {"Idempotency-Key": KEY, "X-User-Id": "1"}
        await c.post("/subscriptions", json=BODY, headers=headers)
        again = await c.post("/subscriptions", json=BODY, headers={**headers, "X-User-Id": "2"})
    assert again.headers["idempotent-replayed"] == "true"
    assert len(effects.runs) == 1
    warned = [r for r in caplog.records if "anonymous_with_credentials" in r.getMessage()]
    assert len(warned) == 1  # once, not per request
    assert "x-user-id" in warned[0].getMessage()
    assert "X-User-Id: 1" not in warned[0].getMessage()


# --- Middleware order and nesting -----------------------------------------------------------


async def test_trusted_host_inside_the_guard_is_refused_and_outside_stores_nothing() -> None:
    def app_with(order: str) -> Starlette:
        @idempotent(required=True)
        async def refund(request: Request) -> Response:
            return JSONResponse({}, status_code=201)

        th = Middleware(TrustedHostMiddleware, allowed_hosts=["shop.example"])
        idem = Middleware(IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS)
        return Starlette(
            routes=[Route("/refunds", refund, methods=["POST"])],
            middleware=[idem, th] if order == "inside" else [th, idem],
        )

    assert "TrustedHostMiddleware is inside" in await refuses(app_with("inside"))
    async with served(app_with("outside"), "http://evil.example") as c:
        assert (await c.post("/refunds", headers={"Idempotency-Key": KEY})).status_code == 400
    async with served(app_with("outside")) as c:
        ok = await c.post("/refunds", headers={"Idempotency-Key": KEY})
    assert ok.status_code == 201


async def test_a_guarded_sub_app_in_a_guarded_app_runs_once_and_replays() -> None:
    store = MemoryStore()
    effects = Effects()

    @idempotent(required=True)
    async def refund(request: Request) -> Response:
        effects.runs.append("run")
        return JSONResponse({"refund": len(effects.runs)}, status_code=201)

    inner = guarded(store, [Route("/refunds", refund, methods=["POST"])])
    outer = guarded(store, [Mount("/api", inner)], methods=("POST",))
    async with served(outer) as c:
        first = await c.post("/api/refunds", json=BODY, headers={"Idempotency-Key": KEY})
        again = await c.post("/api/refunds", json=BODY, headers={"Idempotency-Key": KEY})
    assert first.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert effects.runs == ["run"]


def test_helpers_refuse_what_cannot_name_a_caller() -> None:
    with pytest.raises(ValueError, match="at least one header"):
        from_headers()
    with pytest.raises(ValueError, match="non-empty name"):
        from_session("")
    assert repr(ANONYMOUS) == "ANONYMOUS"
    assert from_headers("A")({"headers": [(b"a", b"x")]}) == "1:x"
    assert from_headers("A")({"headers": [(b"a", b"x"), (b"A", b"y")]}) is None  # sent twice


async def test_two_listeners_of_one_host_name_share_its_records() -> None:
    """Workers or replicas behind one name may take requests on different ports."""
    effects = Effects()
    app = gateway_app(effects, principal=from_headers("X-User-Id"))
    async with (
        served(app, "http://shop.example:8001") as a,
        served(app, "http://SHOP.example:8002") as b,
    ):
        headers = {"Idempotency-Key": KEY, "X-User-Id": "1"}
        await a.post("/subscriptions", json=BODY, headers=headers)
        via_b = await b.post("/subscriptions", json=BODY, headers=headers)
    assert via_b.headers["idempotent-replayed"] == "true"
    assert len(effects.runs) == 1


# --- principal= is required (no default that guesses) ------------------------------------


def _x_token_app(effects: Effects, **guard: Any) -> Starlette:
    """An app with its own auth header: a BaseHTTPMiddleware reads ``X-Token`` and sets
    ``request.state.user``, as many apps do; no header the guard could know of."""

    class TokenAuth(BaseHTTPMiddleware):
        async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
            user = TOKENS.get(request.headers.get("x-token", ""))
            if user is None:
                return JSONResponse({"detail": "unauthenticated"}, status_code=401)
            request.state.user = user
            return await call_next(request)

    @idempotent(required=True)
    async def refund(request: Request) -> Response:
        effects.runs.append(request.state.user)
        return JSONResponse({"refund": len(effects.runs)}, status_code=201)

    return Starlette(
        routes=[Route("/refunds", refund, methods=["POST"])],
        middleware=[
            Middleware(TokenAuth),  # outside the guard: it runs first
            Middleware(IdempotencyMiddleware, store=MemoryStore(), **guard),
        ],
    )


def test_the_guard_does_not_start_without_being_told_who_the_caller_is() -> None:
    # Before: the default looked for headers it knew, found none in X-Token, scoped
    # every caller as anonymous, and Bob received Alice's stored refund.
    with pytest.raises(TypeError) as refused:
        _x_token_app(Effects()).build_middleware_stack()  # what Starlette does as it starts
    assert all(choice in str(refused.value) for choice in CHOICES), refused.value
    with pytest.raises(TypeError, match="ANONYMOUS"):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), principal=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a principal"):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), principal="alice")  # type: ignore[arg-type]


async def test_an_app_s_own_auth_header_scopes_each_caller_once_named() -> None:
    effects = Effects()

    def state_user(scope: Any) -> str | None:
        user = scope.get("state", {}).get("user")
        return user if isinstance(user, str) else None

    async with served(_x_token_app(effects, principal=state_user)) as c:

        def post(token: str) -> Any:
            return c.post("/refunds", json=BODY, headers={"Idempotency-Key": KEY, "X-Token": token})

        alice = await post("tok-alice-1")
        bob = await post("tok-bob-1")
        again = await post("tok-alice-2")
    assert alice.status_code == bob.status_code == 201
    assert "idempotent-replayed" not in bob.headers  # Bob never gets Alice's refund
    assert again.headers["idempotent-replayed"] == "true"
    assert effects.runs == ["alice", "bob"]


# --- A mounted app with its own guard: that guard decides ---------------------------------


def _mounted(
    effects: Effects, outer_policies: dict[str, Policy] | None = None, *, how: str = "app"
) -> Starlette:
    """An outer guard (ANONYMOUS: a public API) around a Mount with a guard of its own,
    scoped by the ``X-User`` its gateway verifies: in the mounted app's middleware, or in
    the Mount's own ``middleware=``; or around a Host (billing.example) whose app has it."""

    @idempotent(required=True)
    async def refund(request: Request) -> Response:
        effects.runs.append(request.headers["x-user"])
        return JSONResponse({"refund": len(effects.runs)}, status_code=201)

    inner_guard = Middleware(
        IdempotencyMiddleware,
        store=effects.store,
        principal=from_headers("X-User"),
        metrics=effects.inner,
    )
    routes = [Route("/refunds", refund, methods=["POST"])]
    mount: Mount | Host
    if how == "app":
        mount = Mount("/billing", Starlette(routes=routes, middleware=[inner_guard]))
    elif how == "host":
        mount = Host("billing.example", Starlette(routes=routes, middleware=[inner_guard]))
    else:
        mount = Mount("/billing", routes=routes, middleware=[inner_guard])
    return guarded(effects.store, [mount], metrics=effects.outer, policies=outer_policies)


async def test_a_mounted_app_s_own_guard_decides_with_its_principal() -> None:
    effects = Effects()
    async with served(_mounted(effects)) as c:

        def post(user: str) -> Any:
            return c.post(
                "/billing/refunds", json=BODY, headers={"Idempotency-Key": KEY, "X-User": user}
            )

        alice = await post("alice")
        bob = await post("bob")
        again = await post("alice")
        nobody = await c.post("/billing/refunds", json=BODY, headers={"Idempotency-Key": KEY})
    assert alice.status_code == bob.status_code == 201, (alice.text, bob.text)
    # Before: the outer guard decided with ANONYMOUS and Bob received Alice's refund.
    assert "idempotent-replayed" not in bob.headers
    assert bob.json() != alice.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert nobody.status_code == 401  # the inner principal's answer, not the outer's
    assert effects.runs == ["alice", "bob"]
    # Guarded exactly once: the inner guard saw every request, the outer none.
    assert effects.outer.snapshot().total() == 0
    inner = effects.inner.snapshot()
    assert inner.total(Outcome.EXECUTED) == 2
    assert inner.total(Outcome.REPLAYED) == 1


async def test_a_guard_in_a_mount_s_own_middleware_is_refused() -> None:
    # It would resolve no route (the Mount's routes are not the app's) and so never
    # decide: the outer guard, with its principal, would.
    message = await refuses(_mounted(Effects(), how="mount"))
    assert "Mount('/billing', middleware=[...])" in message


async def test_an_outer_policy_for_a_route_a_guarded_mount_serves_is_refused() -> None:
    message = await refuses(_mounted(Effects(), {"POST /billing/refunds": Policy(required=True)}))
    assert "/billing" in message
    assert "its own" in message


async def test_a_host_s_own_guard_decides_with_its_principal() -> None:
    effects = Effects()
    async with served(_mounted(effects, how="host"), "http://billing.example") as c:

        def post(user: str) -> Any:
            return c.post("/refunds", json=BODY, headers={"Idempotency-Key": KEY, "X-User": user})

        alice = await post("alice")
        bob = await post("bob")
        again = await post("alice")
        nobody = await c.post("/refunds", json=BODY, headers={"Idempotency-Key": KEY})
    assert alice.status_code == bob.status_code == 201, (alice.text, bob.text)
    # Before: the outer guard decided with ANONYMOUS and Bob received Alice's refund.
    assert "idempotent-replayed" not in bob.headers
    assert bob.json() != alice.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert nobody.status_code == 401  # the inner principal's answer, not the outer's
    assert effects.runs == ["alice", "bob"]
    assert effects.outer.snapshot().total() == 0
    inner = effects.inner.snapshot()
    assert inner.total(Outcome.EXECUTED) == 2
    assert inner.total(Outcome.REPLAYED) == 1


async def test_an_outer_policy_for_a_route_a_guarded_host_serves_is_refused() -> None:
    policies = {"POST /refunds": Policy(required=True)}
    message = await refuses(_mounted(Effects(), policies, how="host"))
    assert "Host('billing.example')" in message
    assert "its own" in message


async def test_from_dependency_outside_a_mount_with_its_own_guard_leaves_it_to_that_guard() -> None:
    """The outer FastAPI guard neither claims at the mounted app's routes nor refuses them
    for not using its dependency: the inner guard is theirs."""
    effects = Effects()

    def current_client(key: Annotated[str, Depends(APIKeyHeader(name="X-API-Key"))]) -> str:
        if key not in TOKENS:
            raise HTTPException(401, "bad key")
        return TOKENS[key]

    outer = FastAPI()

    @outer.post("/orders", status_code=201)
    async def order(client: str = Depends(current_client)) -> dict[str, str]:
        return {"for": client}

    outer.mount("/billing", _mounted(effects).routes[0].app)  # type: ignore[attr-defined]
    outer.add_middleware(
        IdempotencyMiddleware, store=effects.store, principal=from_dependency(current_client)
    )
    async with served(outer) as c:
        for user in ("alice", "bob"):
            r = await c.post(
                "/billing/refunds", json=BODY, headers={"Idempotency-Key": KEY, "X-User": user}
            )
            assert r.status_code == 201
            assert "idempotent-replayed" not in r.headers
    assert effects.runs == ["alice", "bob"]


async def test_from_dependency_outside_a_host_with_its_own_guard_leaves_it_to_that_guard() -> None:
    """A FastAPI app behind a Host, guarded by its own principal: the outer guard does not
    refuse its routes for not using the outer dependency, nor claim there."""
    effects = Effects()

    def current_client(key: Annotated[str, Depends(APIKeyHeader(name="X-API-Key"))]) -> str:
        if key not in TOKENS:
            raise HTTPException(401, "bad key")
        return TOKENS[key]

    billing = FastAPI()

    @billing.post("/refunds", status_code=201)
    async def refund(request: Request) -> dict[str, int]:
        effects.runs.append(request.headers["x-user"])
        return {"refund": len(effects.runs)}

    billing.add_middleware(
        IdempotencyMiddleware, store=effects.store, principal=from_headers("X-User")
    )
    outer = FastAPI()

    @outer.post("/orders", status_code=201)
    async def order(client: str = Depends(current_client)) -> dict[str, str]:
        return {"for": client}

    outer.host("billing.example", billing)
    outer.add_middleware(
        IdempotencyMiddleware, store=effects.store, principal=from_dependency(current_client)
    )
    async with served(outer, "http://billing.example") as c:
        for user in ("alice", "bob"):
            r = await c.post(
                "/refunds", json=BODY, headers={"Idempotency-Key": KEY, "X-User": user}
            )
            assert r.status_code == 201
            assert "idempotent-replayed" not in r.headers
    assert effects.runs == ["alice", "bob"]


# --- from_dependency: every keyed route names its caller, or the app does not start ------


def _two_auth_app(effects: Effects, **guard: Any) -> FastAPI:
    """Clients authenticate with X-API-Key (``current_client``); the admin refund route
    with its own header, through another dependency."""

    def current_client(key: Annotated[str, Depends(APIKeyHeader(name="X-API-Key"))]) -> str:
        if key not in TOKENS:
            raise HTTPException(401, "bad key")
        return TOKENS[key]

    def current_admin(x_admin_token: Annotated[str, Header()]) -> str:
        if x_admin_token != "admin-secret":
            raise HTTPException(401, "not an admin")
        return "admin"

    app = FastAPI()

    @app.post("/refunds", status_code=201)
    async def refund(client: str = Depends(current_client)) -> dict[str, int]:
        effects.runs.append(client)
        return {"refund": len(effects.runs)}

    @app.post("/admin/refunds", status_code=201)
    async def admin_refund(admin: str = Depends(current_admin)) -> dict[str, int]:
        effects.runs.append(admin)
        return {"refund": len(effects.runs)}

    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        principal=from_dependency(current_client),
        **guard,
    )
    return app


async def test_a_keyed_route_authenticated_by_another_dependency_does_not_start() -> None:
    # Before: the app started, and two keyed POSTs to /admin/refunds both ran (201, 201).
    message = await refuses(_two_auth_app(Effects()))
    assert "POST /admin/refunds" in message
    assert "current_client" in message
    assert "Policy(enabled=False)" in message
    assert "POST /refunds " not in message  # the route that uses it is fine


async def test_an_exempted_route_runs_as_the_app_says_and_the_others_stay_guarded() -> None:
    effects = Effects()
    app = _two_auth_app(effects, policies={"POST /admin/refunds": Policy(enabled=False)})
    async with served(app) as c:
        admin = {"Idempotency-Key": KEY, "X-Admin-Token": "admin-secret"}
        runs = [(await c.post("/admin/refunds", headers=admin)).status_code for _ in range(2)]
        client = {"Idempotency-Key": KEY, "X-API-Key": "tok-alice-1"}
        first = await c.post("/refunds", headers=client)
        again = await c.post("/refunds", headers=client)
    assert runs == [201, 201]  # exempted in so many words: the app's choice
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert effects.runs == ["admin", "admin", "alice"]


async def test_a_route_added_after_startup_refuses_keyed_requests_rather_than_run_twice() -> None:
    effects = Effects()
    app = _two_auth_app(effects, policies={"POST /admin/refunds": Policy(enabled=False)})
    async with served(app) as c:

        @app.post("/late", status_code=201)
        async def late() -> dict[str, str]:
            effects.runs.append("late")
            return {}

        keyed = await c.post("/late", headers={"Idempotency-Key": KEY})
        plain = await c.post("/late")
    assert keyed.status_code == 500
    assert keyed.headers["content-type"] == "application/problem+json"
    assert "Policy(enabled=False)" in keyed.json()["detail"]
    assert plain.status_code == 201  # no key: nothing to keep, the default policy's way
    assert effects.runs == ["late"]


# --- from_dependency: what the dependency returns names the caller ------------------------


class TutorialUser(BaseModel):
    """FastAPI's JWT tutorial user: no id, no identity."""

    username: str
    email: str | None = None
    full_name: str | None = None
    disabled: bool | None = None


def _tutorial_app(effects: Effects, **identity: Any) -> FastAPI:
    oauth2_scheme = OAuth2PasswordBearer(tokenUrl="token")

    async def get_current_user(token: str = Depends(oauth2_scheme)) -> TutorialUser:
        if token not in TOKENS:
            raise HTTPException(401, "bad token")
        return TutorialUser(username=TOKENS[token], full_name="Jordan Lee")

    app = FastAPI()

    @app.post("/token")
    async def login() -> dict[str, str]:
        return {"access_token": "tok-alice-1", "token_type": "bearer"}

    @app.post("/refunds", status_code=201)
    async def refund(user: TutorialUser = Depends(get_current_user)) -> dict[str, int]:
        effects.runs.append(user.username)
        return {"refund": len(effects.runs)}

    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        principal=from_dependency(get_current_user, **identity),
        policies={"POST /token": Policy(enabled=False)},
    )
    return app


async def test_a_dependency_returning_a_user_without_identity_does_not_start() -> None:
    # Before: the app started, and every guarded request was a 500.
    message = await refuses(_tutorial_app(Effects()))
    assert "TutorialUser" in message
    assert "identity=" in message


@pytest.mark.parametrize(
    "identity", ["username", lambda user: user.username], ids=["attribute", "function"]
)
async def test_identity_names_the_caller_of_a_user_without_one(identity: Any) -> None:
    effects = Effects()
    async with served(_tutorial_app(effects, identity=identity)) as c:

        def post(token: str) -> Any:
            return c.post(
                "/refunds",
                headers={"Idempotency-Key": KEY, "Authorization": f"Bearer {token}"},
            )

        alice = await post("tok-alice-1")
        bob = await post("tok-bob-1")
        refreshed = await post("tok-alice-2")
    assert alice.status_code == bob.status_code == 201
    assert "idempotent-replayed" not in bob.headers
    assert refreshed.headers["idempotent-replayed"] == "true"
    assert effects.runs == ["alice", "bob"]


async def test_an_identity_attribute_the_user_lacks_is_a_500_naming_it() -> None:
    effects = Effects()
    async with served(_tutorial_app(effects, identity="user_id")) as c:
        r = await c.post(
            "/refunds", headers={"Idempotency-Key": KEY, "Authorization": "Bearer tok-alice-1"}
        )
    assert r.status_code == 500
    assert "user_id" in r.json()["detail"]
    assert effects.runs == []


def test_return_annotations_that_name_a_caller_pass_the_startup_check() -> None:
    from asgi_idempotency.integrations.fastapi import unnamed_return

    @dataclass
    class Account:
        id: int

    class Person(BaseModel):
        identity: str

    def returns(annotation: Any) -> Callable[[], Any]:
        def dep() -> None: ...

        dep.__annotations__["return"] = annotation
        return dep

    for fine in (str, Account, Person, Account | None, Any, TutorialUser | Account):
        assert unnamed_return(from_dependency(returns(fine))) is None, fine
    for bad in (TutorialUser, TutorialUser | None, int, dict[str, str]):
        assert unnamed_return(from_dependency(returns(bad))) is not None, bad

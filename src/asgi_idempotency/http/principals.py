"""Who the caller is: the principal a record belongs to (``IdempotencyMiddleware(principal=...)``).

A record's key is a digest of (host, principal, client key), so the principal decides
who may receive a stored response. It is who the caller is, never the bytes of their
credentials (a refreshed token would run a retry twice), and never silently empty: a
helper that finds no caller answers 401. The helpers (``from_dependency``,
``from_user``, ``from_session``, ``from_headers``, ``ANONYMOUS``) and choosing one:
docs/guide/principal.md.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from asgi_idempotency.core.errors import PrincipalMisconfigured
from asgi_idempotency.http.asgi import Scope

__all__ = [
    "ANONYMOUS",
    "DependencyPrincipal",
    "PrincipalFunc",
    "from_dependency",
    "from_headers",
    "from_session",
    "from_user",
    "identity_of",
]

# The principal of a request: a string, ``""`` for anonymous (only from ANONYMOUS or a
# function that means it), ``None`` for "this request names no caller". Sync or async.
PrincipalFunc = Callable[[Scope], "Awaitable[str | None] | str | None"]

# Request headers that commonly carry a caller's credentials or session. Only for
# ANONYMOUS's warning: never to decide who the caller is, since an app may use any header.
CREDENTIAL_HEADERS: Final = frozenset(
    {
        b"authorization",
        b"proxy-authorization",
        b"cookie",
        b"x-api-key",
        b"api-key",
        b"apikey",
        b"x-auth-token",
        b"x-access-token",
        b"x-user-id",
        b"x-tenant-id",
    }
)

HELPERS: Final = (
    "principal=from_dependency(<your auth dependency>) for FastAPI, from_user(), "
    "from_session('<field>'), from_headers('<header>', ...), or ANONYMOUS for a public "
    "or single-caller service (from asgi_idempotency.http.principals)"
)


class _Anonymous:
    """Every request is the same caller: a public or single-caller service.

    The first request that carries credentials is logged once (at WARNING): the app
    may tell its callers apart after all, and then they would share stored answers.
    """

    __slots__ = ("warned",)

    def __init__(self) -> None:
        self.warned = False

    def __call__(self, scope: Scope) -> str:
        if not self.warned:
            for name, _ in scope["headers"]:
                if name.lower() in CREDENTIAL_HEADERS:
                    self.warned = True
                    logging.getLogger("asgi_idempotency").warning(
                        "idempotency.anonymous_with_credentials header=%s: principal=ANONYMOUS, "
                        "but requests carry credentials; if they come from different callers, "
                        "those callers share stored answers. Pass %s.",
                        name.decode("latin-1").lower(), HELPERS,
                        extra={"event": "idempotency.anonymous_with_credentials"},
                    )  # fmt: skip
                    break
        return ""

    def __repr__(self) -> str:
        return "ANONYMOUS"


ANONYMOUS: Final = _Anonymous()


def identity_of(value: Any, what: str) -> str:
    """The identity of an authenticated caller object: a ``str`` itself, else its
    ``identity`` or ``id`` attribute; never a display name, which two people share.

    Raises:
        PrincipalMisconfigured: the object has neither (``what`` names where it came from).
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        raise PrincipalMisconfigured(
            f"{what} returned bytes; the principal must say who the caller is (a str or an "
            "object with an 'identity' or 'id'), not carry their credentials."
        )
    for name in ("identity", "id"):
        try:
            found = getattr(value, name)
        except NotImplementedError:  # Starlette's BaseUser.identity when not overridden
            continue
        except AttributeError:
            continue
        if found is not None and not callable(found):
            return str(found)
    raise PrincipalMisconfigured(
        f"{what} returned a {type(value).__name__} with no 'identity' or 'id'; give it "
        "one, or pass identity=<function of it> to the principal helper. A display name "
        "is never used: two callers can share it."
    )


# How a caller object names its caller: a function of it, or the name of its attribute.
Identity = Callable[[Any], str] | str


def _identity_function(identity: Identity | None) -> Callable[[Any], str] | None:
    if identity is None or callable(identity):
        return identity
    if not isinstance(identity, str) or not identity:
        raise TypeError(
            "identity= takes a function of the caller object or an attribute name, "
            f"not {identity!r}"
        )
    return _Attribute(identity)


class _Attribute:
    """``identity="username"``: that attribute of the caller object, as a string."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, value: Any) -> str:
        found = getattr(value, self.name, None)
        if found is None or callable(found) or found == "":
            raise PrincipalMisconfigured(
                f"identity={self.name!r}: the {type(value).__name__} has no {self.name!r} "
                "to name its caller"
            )
        return str(found)

    def __repr__(self) -> str:
        return repr(self.name)


def _check_field(kind: str, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} needs a non-empty name, got {name!r}")
    return name


class _FromUser:
    __slots__ = ("identity",)

    def __init__(self, identity: Callable[[Any], str] | None) -> None:
        self.identity = identity

    def __call__(self, scope: Scope) -> str | None:
        if "user" not in scope:
            raise PrincipalMisconfigured(
                "from_user() found no scope['user']: add Starlette's AuthenticationMiddleware "
                "outside (before) IdempotencyMiddleware."
            )
        user = scope["user"]
        if not getattr(user, "is_authenticated", False):
            return None
        if self.identity is not None:
            return self.identity(user)
        return identity_of(user, "scope['user']")

    def __repr__(self) -> str:
        return "from_user()"


def from_user(*, identity: Identity | None = None) -> PrincipalFunc:
    """The authenticated ``scope["user"]``'s ``identity`` (or ``id``); never ``display_name``.

    Needs Starlette's ``AuthenticationMiddleware`` outside the guard (the guard refuses
    to start otherwise). An unauthenticated request is answered 401 on guarded routes.
    ``identity`` maps the user object to a string when it has neither attribute: a
    function of it, or the name of the attribute that says who it is (``"username"``).
    """
    return _FromUser(_identity_function(identity))


class _FromSession:
    __slots__ = ("field",)

    def __init__(self, field: str) -> None:
        self.field = field

    def __call__(self, scope: Scope) -> str | None:
        session = scope.get("session")
        if session is None:
            raise PrincipalMisconfigured(
                f"from_session({self.field!r}) found no scope['session']: add SessionMiddleware "
                "outside (before) IdempotencyMiddleware."
            )
        value = session.get(self.field)
        return None if value is None or value == "" else str(value)

    def __repr__(self) -> str:
        return f"from_session({self.field!r})"


def from_session(field: str) -> PrincipalFunc:
    """The session's ``field`` (e.g. the ``user_id`` a login view stored).

    Needs Starlette's ``SessionMiddleware`` outside the guard. The session's content
    is the caller, not its cookie: a re-signed cookie of the same user replays. A
    request whose session lacks the field is answered 401 on guarded routes.
    """
    return _FromSession(_check_field("from_session()", field))


class _FromHeaders:
    __slots__ = ("names",)

    def __init__(self, names: tuple[bytes, ...]) -> None:
        self.names = names

    def __call__(self, scope: Scope) -> str | None:
        found: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            name = name.lower()
            if name in self.names:
                if name in found:
                    return None  # sent twice: which one the gateway verified is unknowable
                found[name] = value
        if len(found) != len(self.names):
            return None
        # Length-prefixed, so ("a:b", "c") and ("a", "b:c") stay two callers.
        return "".join(f"{len(v)}:{v}" for v in (found[n].decode("latin-1") for n in self.names))

    def __repr__(self) -> str:
        return f"from_headers({', '.join(repr(n.decode()) for n in self.names)})"


def from_headers(*names: str) -> PrincipalFunc:
    """Headers that a gateway in front of the app has verified, all of them, in order
    (e.g. ``from_headers("X-Tenant-Id", "X-User-Id")``).

    Only for headers the client cannot set itself: the gateway must strip or overwrite
    them. A request missing any of them (or sending one twice) is answered 401.
    """
    if not names:
        raise ValueError("from_headers() needs at least one header name")
    encoded = tuple(_check_field("from_headers()", n).lower().encode("latin-1") for n in names)
    if len(set(encoded)) != len(encoded):
        raise ValueError(f"from_headers() names a header twice: {names!r}")
    return _FromHeaders(encoded)


class DependencyPrincipal:
    """The result of a FastAPI dependency, resolved by FastAPI itself (see
    :func:`from_dependency`). Not a function of the scope: the middleware defers the
    claim to the moment FastAPI has resolved ``dependency`` for the request."""

    __slots__ = ("dependency", "identity")

    def __init__(self, dependency: Callable[..., Any], identity: Callable[[Any], str] | None):
        self.dependency = dependency
        self.identity = identity

    def principal_of(self, value: Any) -> str:
        if self.identity is not None:
            found = self.identity(value)
            if not isinstance(found, str) or not found:
                raise PrincipalMisconfigured(
                    f"the identity function of from_dependency({self.name}) returned "
                    f"{type(found).__name__}, not a non-empty str"
                )
            return found
        return identity_of(value, f"the dependency {self.name}")

    @property
    def name(self) -> str:
        return getattr(self.dependency, "__name__", None) or type(self.dependency).__name__

    def __repr__(self) -> str:
        return f"from_dependency({self.name})"


def from_dependency(
    dependency: Callable[..., Any], *, identity: Identity | None = None
) -> DependencyPrincipal:
    """FastAPI: the caller is what the app's own auth dependency returns.

    ``dependency`` is the function (or callable) the routes already use in
    ``Depends(...)`` (directly, in ``dependencies=[...]`` of the route, router or
    app, or inside another dependency). Its result must name the caller: a ``str``,
    or an object with an ``identity`` or ``id`` attribute; for any other object
    (FastAPI's tutorial ``User`` with ``username``, ``email``, ...) pass
    ``identity=``: the attribute that names the caller (``identity="username"``)
    or a function of the result returning a ``str``. When the dependency's return
    annotation is a class with neither attribute and no ``identity=`` is given, the
    app does not start. The guard claims the key once FastAPI has resolved the
    dependency (FastAPI caches it per request, so it runs once), so a request it
    rejects (401, 403) is never claimed; one that fails validation after it is
    released, never stored. Every route the guard would guard (the default policy's
    methods, the policies map, ``@idempotent``) and that does not use the
    dependency is refused at startup: add ``Depends(dependency)`` to it or exempt
    it with ``Policy(enabled=False)``.

    Raises:
        TypeError: ``dependency`` is a FastAPI security scheme (``HTTPBearer()``,
            ``APIKeyHeader(...)``, ``OAuth2PasswordBearer(...)``): those return the
            credentials, which change on a token refresh; pass the dependency that
            turns them into a user.
    """
    if not callable(dependency):
        raise TypeError(f"from_dependency() needs a callable, got {dependency!r}")
    if identity is None and _is_security_scheme(dependency):
        raise TypeError(
            f"from_dependency({type(dependency).__name__}(...)): a security scheme returns "
            "the caller's credentials, which change when a token is refreshed; pass the "
            "dependency that turns them into the caller (e.g. get_current_user), or "
            "identity= a function of the credentials that names the caller."
        )
    return DependencyPrincipal(dependency, _identity_function(identity))


def _is_security_scheme(obj: object) -> bool:
    import sys

    security = sys.modules.get("fastapi.security.base")
    base = getattr(security, "SecurityBase", None)
    return base is not None and isinstance(obj, base)

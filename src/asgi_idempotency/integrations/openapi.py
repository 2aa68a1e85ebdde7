"""The guard's contract in a FastAPI app's OpenAPI schema, without touching its routes.

:func:`install_openapi` wraps ``app.openapi``, FastAPI's documented extension point, so
that each guarded operation (``guard_of(method, template)``; :func:`guard_of_for` gives
the middleware's own answer) shows the ``Idempotency-Key`` header, the problem answers
(400, 409, 410, 413, 422, 503, and 401 where the guard itself can refuse a request that
names no caller) with the shared ``IdempotencyProblem`` schema, and the ``Retry-After``
and ``Idempotent-Replayed`` headers. The middleware installs it once, at lifespan
startup or on its first request. Nothing here imports FastAPI; an app without an
``openapi`` method is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import orjson

from asgi_idempotency.core.errors import (
    BodyTooLarge,
    IdempotencyError,
    InvalidKey,
    InvalidSignature,
    KeyMismatch,
    MissingKey,
    PrincipalMissing,
    RequestInProgress,
    ResponseNotKept,
    StoreUnavailable,
)
from asgi_idempotency.core.keys import MAX_KEY_LENGTH
from asgi_idempotency.http.policy import Policy, ResolvedRoute, expand_routes, sub_app_route
from asgi_idempotency.http.principals import ANONYMOUS, DependencyPrincipal

__all__ = ["PROBLEM_SCHEMA_NAME", "GuardOf", "apply_to_schema", "guard_of_for", "install_openapi"]

# Not "Problem": apps that answer RFC 9457 themselves often have a model of that
# name, which FastAPI publishes under components.schemas; ours must not replace it.
PROBLEM_SCHEMA_NAME = "IdempotencyProblem"
_PROBLEM_REF = f"#/components/schemas/{PROBLEM_SCHEMA_NAME}"
_PROBLEM_JSON = "application/problem+json"

# The middleware's SAFE_METHODS, spelled again rather than imported: the middleware
# imports this module, and importing it back would be a cycle. tests/integrations/test_openapi.py
# checks that the two agree.
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# The keys of an OpenAPI Path Item that are operations ("query" is OpenAPI 3.2's);
# the others ("parameters", "summary", "servers", "$ref") are not.
_OPERATIONS = frozenset(
    {"get", "put", "post", "delete", "options", "head", "patch", "trace", "query"}
)

# Set on our wrapper of app.openapi: the callable it wraps, so that installing again
# wraps that one instead of our wrapper.
_ORIGINAL_ATTR = "__asgi_idempotency_openapi__"


class GuardOf(Protocol):
    """How an operation is guarded: ``(method, route template) -> Policy | None``.

    ``method`` is upper case (``"POST"``); the template is the one the policy lookup
    uses, include and mount prefixes in, root path out (``"/v1/orders/{order_id}"``).
    ``None``, or a policy with ``enabled=False``, means the operation is not guarded.

    An implementation may also have a true ``answers_unauthenticated`` attribute: the
    guard answers 401 itself to a request that names no caller, so guarded operations
    document it. The middleware's own (:func:`guard_of_for`) has it where its
    ``principal`` can answer ``None``; a plain function has not, and documents no 401.
    """

    def __call__(self, method: str, template: str, /) -> Policy | None: ...


class Guard(Protocol):
    """What :func:`guard_of_for` reads of the guard (``IdempotencyMiddleware`` is one):
    who its callers are, and its own decision for a request. A protocol, not the
    middleware's class: the middleware installs this module's schema, and this module
    never imports the middleware back."""

    @property
    def principal(self) -> object: ...

    def guard_for(self, method: str, resolved: ResolvedRoute | None, path: str) -> Policy | None:
        """How a request of ``method`` to ``resolved`` (at ``path``) is guarded, or ``None``."""
        ...


def install_openapi(app: Any, guard_of: GuardOf) -> bool:
    """Make ``app.openapi()`` document the guard, as :func:`apply_to_schema` does.

    Replaces ``app.openapi`` with a wrapper that calls the one it found, then adds
    the guard's header, responses and problem schema to what it returns (in place,
    as FastAPI's own customisation recipe does, so the cached ``app.openapi_schema``
    is the documented one). A schema is completed once: while the original keeps
    returning the same cached dict, the wrapper returns it as it is. Installing again
    wraps the original again with the new ``guard_of``, never our wrapper, so the
    work is not done twice per call. The routes are not touched.

    Returns:
        ``True`` once installed; ``False``, doing nothing, when ``app`` has no
        callable ``openapi`` (a Starlette app, ``None``).

    Raises:
        Nothing itself; the wrapper raises what the original ``openapi`` or
        ``guard_of`` raises.
    """
    current = getattr(app, "openapi", None)
    if not callable(current):
        return False
    original: Callable[[], dict[str, Any]] = getattr(current, _ORIGINAL_ATTR, current)
    done: list[dict[str, Any]] = []  # the schema this wrapper last completed

    def openapi() -> dict[str, Any]:
        schema = original()
        # FastAPI returns its cached dict until a route is added; only a new dict
        # needs the work (held strongly, so identity cannot be a reused id).
        if not done or done[0] is not schema:
            apply_to_schema(schema, guard_of)
            done[:] = [schema]
        return schema

    setattr(openapi, _ORIGINAL_ATTR, original)
    openapi.__doc__ = getattr(original, "__doc__", None)
    app.openapi = openapi
    return True


def apply_to_schema(schema: dict[str, Any], guard_of: GuardOf) -> dict[str, Any]:
    """Add the guard's contract to every guarded operation of ``schema``, in place.

    Safe methods (GET, HEAD, OPTIONS, TRACE) are never guarded by the middleware,
    so they are left alone whatever ``guard_of`` says. What the app documents
    itself is kept: an ``Idempotency-Key`` parameter it declares is not added again,
    and for a status it already answers its description, schemas and headers stay,
    with our ``application/problem+json`` content and headers added beside them.
    Applying twice gives the same schema as applying once.

    Returns:
        ``schema`` itself.

    Raises:
        Whatever ``guard_of`` raises.
    """
    paths: Mapping[str, Any] = schema.get("paths") or {}
    unauthenticated = bool(getattr(guard_of, "answers_unauthenticated", False))
    guarded = False
    for template, item in paths.items():
        if not isinstance(item, dict):
            continue
        for method, operation in item.items():
            if method not in _OPERATIONS or method.upper() in _SAFE_METHODS:
                continue
            policy = guard_of(method.upper(), template)
            if policy is None or not policy.enabled or not isinstance(operation, dict):
                continue
            _document(schema, item, operation, policy, unauthenticated)
            guarded = True
    if guarded:
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas[PROBLEM_SCHEMA_NAME] = _problem_schema()
    return schema


def guard_of_for(middleware: Guard, app: Any) -> GuardOf:
    """The middleware's own answer, per operation of ``app``'s router.

    Decides as the middleware does per request: its ``policies`` by
    ``"METHOD /template"`` or bare template, else ``@idempotent`` on the endpoint,
    else ``default_policy`` for methods in ``methods``; a disabled policy, a safe
    method or a template no route has is not guarded. The settings are read at each
    call, the routes once and again when a template is not found (a route added
    since); a template the schema has but the router lacks answers ``None``. The
    answer is the middleware's own ``guard_for``, which decides every request too.

    Raises:
        Nothing: an app without a router has no routes, so nothing is guarded.
    """
    return _MiddlewareGuardOf(middleware, _RouteIndex(app))


class _MiddlewareGuardOf:
    """:func:`guard_of_for`'s answer: a :class:`GuardOf` that knows the middleware's caller."""

    __slots__ = ("index", "middleware")

    def __init__(self, middleware: Guard, index: _RouteIndex) -> None:
        self.middleware, self.index = middleware, index

    def __call__(self, method: str, template: str, /) -> Policy | None:
        if method in _SAFE_METHODS:
            return None
        resolved = self.index.find(method, template)
        if resolved is None:
            # The router would answer 404 or 405: no handler runs, as in _decide.
            return None
        return self.middleware.guard_for(method, resolved, template)

    @property
    def answers_unauthenticated(self) -> bool:
        """Whether the guard answers 401 (``PrincipalMissing``) to a request naming no
        caller: a ``principal`` that may return ``None`` (``from_user``, ``from_session``,
        ``from_headers``, a callable of the app's). Not ``ANONYMOUS``, never ``None``;
        not ``from_dependency``, where the app's own auth dependency answers the 401."""
        who = self.middleware.principal
        return who is not ANONYMOUS and not isinstance(who, DependencyPrincipal)


class _RouteIndex:
    """(method, template) -> the route, as the policy lookup names it.

    Covers what FastAPI's schema lists: the app's routes and its included routers,
    flattened as :class:`~.policy.RouteResolver` flattens them, ``path_format``
    being the template (prefixes in, convertors out: ``/files/{name}``). A Mount's
    routes are never in the schema, so they are not walked. The first route per
    method and template is kept, since the router tries routes in order.
    """

    def __init__(self, app: Any) -> None:
        self._app = app
        self._routes: dict[tuple[str | None, str], ResolvedRoute] | None = None

    def find(self, method: str, template: str) -> ResolvedRoute | None:
        for fresh in (False, True):
            if self._routes is None or fresh:
                self._routes = self._build()
            # A route without methods (a Starlette Route of a bare ASGI app) takes any.
            found = self._routes.get((method, template)) or self._routes.get((None, template))
            if found is not None:
                return found
        return None

    def _build(self) -> dict[tuple[str | None, str], ResolvedRoute]:
        routes: dict[tuple[str | None, str], ResolvedRoute] = {}
        router = getattr(self._app, "router", None)
        for route in expand_routes(list(getattr(router, "routes", ()))):
            if sub_app_route(route) is not None:
                continue
            template = getattr(route, "path_format", None)
            if not isinstance(template, str):
                continue
            resolved = ResolvedRoute(template, getattr(route, "endpoint", None))
            methods: Iterable[str | None] = getattr(route, "methods", None) or (None,)
            for method in methods:
                routes.setdefault((method, template), resolved)
        return routes


def _problem_schema() -> dict[str, Any]:
    return {
        "title": PROBLEM_SCHEMA_NAME,
        "description": (
            "An RFC 9457 problem details object, answered by the idempotency guard "
            "before or instead of running the operation."
        ),
        "type": "object",
        "properties": {
            "type": {
                "type": "string",
                "format": "uri-reference",
                "description": "Stable identifier of the problem, "
                "urn:asgi-idempotency:problem:<name>; branch on this, not on title.",
            },
            "title": {"type": "string", "description": "Short summary of the problem type."},
            "status": {"type": "integer", "description": "The HTTP status code."},
            "detail": {"type": "string", "description": "What happened and what to do."},
        },
        "required": ["type", "title", "status", "detail"],
    }


def _document(
    schema: dict[str, Any],
    item: dict[str, Any],
    operation: dict[str, Any],
    policy: Policy,
    unauthenticated: bool,
) -> None:
    # A webhook route (key_from) takes its key from the sender's delivery, not this header.
    if policy.key_from is None and not _declares_key(schema, item, operation):
        operation.setdefault("parameters", []).append(_key_parameter(policy))
    responses: dict[str, Any] = operation.setdefault("responses", {})
    for status, response in responses.items():
        if str(status).startswith("2") and "$ref" not in response:  # "200", "201", "2XX"
            _add_header(response, "Idempotent-Replayed", _REPLAYED_HEADER)
    for status, description, errors, retry in _answers(policy, unauthenticated):
        response = responses.setdefault(status, {"description": description})
        if "$ref" in response:
            continue  # the app's shared response (components.responses): its own to describe
        content = response.setdefault("content", {})
        examples = {e.slug: _example(e) for e in errors}
        media = content.get(_PROBLEM_JSON)
        if media is None:
            content[_PROBLEM_JSON] = {"schema": {"$ref": _PROBLEM_REF}, "examples": examples}
        elif "example" not in media:  # OpenAPI allows "example" or "examples", not both
            for name, example in examples.items():
                media.setdefault("examples", {}).setdefault(name, example)
        if retry:
            _add_header(response, "Retry-After", _RETRY_AFTER_HEADER)


def _declares_key(schema: dict[str, Any], item: dict[str, Any], operation: dict[str, Any]) -> bool:
    """Whether the operation or its path item already has the header (names are case-blind)."""
    for parameter in (*item.get("parameters", ()), *operation.get("parameters", ())):
        if isinstance(parameter, dict) and "$ref" in parameter:
            parameter = _resolve(schema, parameter["$ref"])
        if (
            isinstance(parameter, dict)
            and parameter.get("in") == "header"
            and str(parameter.get("name", "")).lower() == "idempotency-key"
        ):
            return True
    return False


def _resolve(schema: dict[str, Any], ref: object) -> Any:
    """A local ``#/...`` reference's target, or ``None``."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node: Any = schema
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")  # JSON Pointer, RFC 6901 §4
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _add_header(response: dict[str, Any], name: str, header: dict[str, Any]) -> None:
    headers = response.setdefault("headers", {})
    if name.lower() not in {str(h).lower() for h in headers}:
        headers[name] = dict(header)


def _key_parameter(policy: Policy) -> dict[str, Any]:
    if policy.required:
        first = "Required: a request without it is refused with 400."
    else:
        first = "Optional: without it the request runs, but a retry may run it twice."
    return {
        "name": "Idempotency-Key",
        "in": "header",
        "required": policy.required,
        "description": (
            f"{first} A key of your choosing (a UUID is a good one), new for each "
            "operation. Send the same key on every retry of the same request: the "
            "operation then runs once, and a retry gets its first response again "
            "(marked Idempotent-Replayed: true). Reusing a key for a different request "
            "is refused with 422."
        ),
        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH},
    }


_REPLAYED_HEADER = {
    "description": (
        "true when this response is the stored response of an earlier request with "
        "the same Idempotency-Key, sent again without running the operation."
    ),
    "schema": {"type": "string", "enum": ["true"]},
}
_RETRY_AFTER_HEADER = {
    "description": "Seconds to wait before retrying with the same Idempotency-Key.",
    "schema": {"type": "integer", "minimum": 1},
}


def _answers(
    policy: Policy, unauthenticated: bool = False
) -> list[tuple[str, str, list[IdempotencyError], bool]]:
    """(status, description, the errors answered with it, whether Retry-After is sent)."""
    # A webhook's caller is its sender, known from the policy: never a 401 of ours.
    caller: list[tuple[str, str, list[IdempotencyError], bool]] = []
    if unauthenticated and policy.key_from is None:
        caller.append(
            (
                "401",
                "The request names no caller; nothing ran",
                [PrincipalMissing("Authenticate and retry with the same Idempotency-Key.")],
                False,
            )
        )
    if policy.key_from is not None:  # a webhook: the key is the sender's delivery id
        bad_key: list[IdempotencyError] = [
            InvalidSignature("The sender's signature on this delivery does not match."),
            MissingKey("This delivery carries no delivery id."),
        ]
        bad = "Delivery unsigned, wrongly signed, or without a delivery id"
    else:
        bad_key = [InvalidKey("The Idempotency-Key header is empty.")]
        if policy.required:  # without a required key a missing one just runs unguarded
            bad_key.insert(0, MissingKey("This endpoint requires an Idempotency-Key header."))
        bad = "Idempotency-Key missing or invalid"
    return [
        ("400", bad, bad_key, False),
        *caller,
        (
            "409",
            "A request with this Idempotency-Key is still in progress",
            [RequestInProgress("Retry after the Retry-After interval to get its response.")],
            True,
        ),
        (
            # A replay of a request whose streamed response was too large to keep: it
            # ran once, and a retry is told so instead of running it again.
            "410",
            "This Idempotency-Key's request ran; its response was too large to keep",
            [ResponseNotKept("The request ran once; its streamed response was not kept.")],
            False,
        ),
        (
            "413",
            f"Request body over {policy.max_body_bytes} bytes",
            [BodyTooLarge(f"The request body exceeds {policy.max_body_bytes} bytes.")],
            False,
        ),
        (
            "422",
            "Idempotency-Key reused with a different request",
            [KeyMismatch("This Idempotency-Key was already used with a different request.")],
            False,
        ),
        (
            "503",
            "Idempotency store unavailable; the operation did not run",
            [StoreUnavailable("The idempotency store could not be reached.")],
            True,
        ),
    ]


def _example(error: IdempotencyError) -> dict[str, Any]:
    # The body the middleware sends for this error, so the example cannot drift from it.
    value: dict[str, Any] = orjson.loads(error.body())
    return {"summary": error.title, "value": value}

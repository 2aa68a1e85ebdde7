"""Per-route policy, the ``@idempotent`` decorator, and route resolution through the router."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from starlette.routing import Host, Match, Mount

from asgi_idempotency.core.terms import (
    DEFAULT_TTL,
    LEASE_NOT_GIVEN,
    DefaultLease,
    duration,
    resolve_lease,
)
from asgi_idempotency.http.asgi import Scope
from asgi_idempotency.http.fingerprint import json_pointer_tokens
from asgi_idempotency.integrations.webhooks import DeliveryKey

__all__ = [
    "Policy",
    "ResolvedRoute",
    "has_router",
    "idempotent",
    "iter_endpoint_policies",
    "normalise_policies",
]

F = TypeVar("F", bound=Callable[..., Any])

_POLICY_ATTR = "__idempotency_policy__"


# The terms' defaults and checks are the core's (Once shares them); kept under these
# names for the modules that import them from here.
_DEFAULT_TTL = DEFAULT_TTL
_LEASE_NOT_GIVEN: Any = LEASE_NOT_GIVEN
_DefaultLease = DefaultLease
_duration = duration


class _DefaultBodyLimit(int):
    """A ``max_body_bytes`` left out, remembered as such: 1 MiB, or the largest delivery
    the route's webhook sender documents (``key_from``), derived again when
    ``dataclasses.replace`` changes ``key_from``."""

    __slots__ = ()


_DEFAULT_BODY_LIMIT: Any = _DefaultBodyLimit(1024 * 1024)


@dataclass(frozen=True, slots=True)
class Policy:
    """How one route is guarded.

    Durations are :class:`datetime.timedelta` values; a bare number is refused
    (``TypeError``) because it could mean seconds or milliseconds.

    Attributes:
        enabled: ``False`` exempts the route entirely (no store access).
        required: a request without ``Idempotency-Key`` gets 400 instead of running unguarded.
        ttl: how long a completed response is kept and replayed (default 24 hours).
        lease: how long an in-progress claim is honoured without renewal before it
            counts as abandoned. Left out, it is the smaller of 30 s and ``ttl``, so
            ``Policy(ttl=timedelta(seconds=1))`` works as written; after construction
            it always reads as a ``timedelta``. A live worker renews it every third
            of the lease, so this bounds a dead worker's silence, not the handler's
            run time.
        max_body_bytes: request bodies above this get 413 before the store is touched
            (default 1 MiB; on a webhook route, the largest delivery its sender
            documents where that is more: 25 MB for ``github(secret)``).
        fingerprint_headers: request headers (case-insensitive) that enter the
            fingerprint besides method, path, query and body.
        transactional: run the handler inside the claim's Postgres transaction.
        fingerprint_exclude: JSON Pointers (RFC 6901, e.g. ``"/timestamp"``,
            ``"/meta/request_id"``, ``"/items/0/nonce"``; ``~1`` for ``/`` and ``~0``
            for ``~`` in a name) of members removed from a JSON body before it is
            fingerprinted, for values a client stamps afresh on every attempt. A
            pointer that names nothing in a body is skipped. Other body types are
            not affected. Any iterable of strings; kept as a tuple.
        key_from: a webhook receiver's key source (:mod:`asgi_idempotency.integrations.webhooks`:
            ``stripe(secret)``, ``github(secret)``, ``standard_webhooks(secret)``,
            ``from_header(name, sender=...)``): the key is the sender's delivery id,
            taken after its signature is checked and only from what it covers,
            instead of ``Idempotency-Key``; records are scoped by the sender and the
            endpoint (method, path, query). A delivery without an id is 400.
        mode: ``"enforce"`` (default) answers as the guard decides; ``"report"`` claims,
            completes and records as usual but always runs the handler and returns
            its own answer, counting and logging (``idempotency.report``) the answer
            the guard would have given: for turning the guard on in a live service.
            Whatever the guard or its store would have answered, the handler runs (on a
            transactional route in a transaction whenever the store opens one, its
            writes committing alone when the record is another request's); only a
            webhook delivery whose signature fails is refused (400) in every mode.
        wait: how long a duplicate that arrives while the first request with its key
            still runs waits for the first's answer (default ``None``: 409 at once).
            It then gets the first's stored response, replayed byte for byte with
            ``Idempotent-Replayed: true``; if the first is released meanwhile (a 5xx,
            an exception), one waiter claims the key and runs the handler and the
            others wait for its answer; past ``wait``, 409 + ``Retry-After`` as
            without it. No store connection is held while waiting: a key held by a
            request of the same process is read once, when that request ends; one
            held elsewhere is read with backoff (10 ms doubling to 0.5 s, or
            ``retry_after`` if smaller), once per process and key however many wait.
            At most ``lease``. Not with ``transactional`` (a running first holds an
            open transaction, invisible to a reader). Ignored in ``mode="report"``.

    Raises:
        TypeError: ``ttl``, ``lease`` or ``wait`` is not a ``timedelta`` (a number, a
            bool, None for the first two); ``fingerprint_exclude`` is a single string
            rather than a collection of them.
        ValueError: ``ttl``, ``lease`` or ``wait`` is not positive; a ``lease`` given
            explicitly exceeds ``ttl``; ``wait`` exceeds ``lease``, or is given with
            ``transactional``; ``max_body_bytes`` is negative; a
            ``fingerprint_exclude`` pointer does not start with ``/`` or has a ``~``
            not followed by 0 or 1.
    """

    enabled: bool = True
    required: bool = False
    ttl: timedelta = _DEFAULT_TTL
    lease: timedelta = _LEASE_NOT_GIVEN
    max_body_bytes: int = _DEFAULT_BODY_LIMIT
    fingerprint_headers: tuple[str, ...] = ()
    transactional: bool = False
    fingerprint_exclude: tuple[str, ...] = ()
    mode: Literal["enforce", "report"] = "enforce"
    key_from: DeliveryKey | None = None
    wait: timedelta | None = None
    _header_names: frozenset[bytes] = field(init=False, repr=False, compare=False)
    _renew_every: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ttl = _duration("ttl", self.ttl)
        lease = resolve_lease(ttl, self.lease)
        if self.wait is not None:
            wait = _duration("wait", self.wait)
            if wait > lease:
                # A first request is renewed while it runs, so a longer wait would hold
                # duplicates (and their clients' connections) past the bound the lease
                # sets on a dead holder's silence. Refused rather than shortened.
                raise ValueError(
                    f"wait ({wait}) exceeds lease ({lease}): pass wait <= lease, or a longer lease"
                )
            if self.transactional:
                raise ValueError(
                    "wait is not available with transactional=True: a running first "
                    "request's claim is an open transaction that no reader can see"
                )
        if self.max_body_bytes < 0:
            raise ValueError("max_body_bytes must be >= 0")
        if isinstance(self.max_body_bytes, _DefaultBodyLimit):
            sender = self.key_from.max_body_bytes if self.key_from is not None else None
            # A sender's documented size is a floor for its route, never a cut: a
            # delivery the sender may send must not be a 413 it retries for days.
            limit = max(sender or 0, _DEFAULT_BODY_LIMIT)
            object.__setattr__(self, "max_body_bytes", _DefaultBodyLimit(limit))
        if self.mode not in ("enforce", "report"):
            raise ValueError(f"mode must be 'enforce' or 'report', not {self.mode!r}")
        names = frozenset(h.lower().encode("latin-1") for h in self.fingerprint_headers)
        if isinstance(self.fingerprint_exclude, str):
            # A lone "/timestamp" would otherwise be read as the pointers "/", "t", ...
            raise TypeError(
                "fingerprint_exclude takes a collection of JSON Pointers, e.g. "
                f"({self.fingerprint_exclude!r},), not a single string"
            )
        exclude = tuple(self.fingerprint_exclude)
        for pointer in exclude:
            json_pointer_tokens(pointer)  # refused here, at startup, not on a request
        object.__setattr__(self, "fingerprint_exclude", exclude)
        object.__setattr__(self, "lease", lease)
        object.__setattr__(self, "_header_names", names)
        object.__setattr__(self, "_renew_every", lease.total_seconds() / 3)

    @property
    def header_names(self) -> frozenset[bytes]:
        return self._header_names

    @property
    def renew_every(self) -> float:
        """Seconds between lease renewals while the handler runs: a third of the lease."""
        return self._renew_every


def idempotent(
    *,
    enabled: bool = True,
    required: bool = False,
    ttl: timedelta = _DEFAULT_TTL,
    lease: timedelta = _LEASE_NOT_GIVEN,
    max_body_bytes: int = _DEFAULT_BODY_LIMIT,
    fingerprint_headers: Iterable[str] = (),
    transactional: bool = False,
    fingerprint_exclude: Iterable[str] = (),
    mode: Literal["enforce", "report"] = "enforce",
    key_from: DeliveryKey | None = None,
    wait: timedelta | None = None,
) -> Callable[[F], F]:
    """Attach a :class:`Policy` to an endpoint; the middleware finds it through the router.

    Takes the same arguments as :class:`Policy`, with the same defaults (``lease``
    left out is the smaller of 30 s and ``ttl``; ``max_body_bytes`` left out follows
    ``key_from``'s sender) and the same errors, raised here at
    decoration time. Put it below the framework's route decorator (``@app.post(...)``
    on top). The function is returned unchanged, so FastAPI still sees its signature.
    """
    policy = Policy(
        enabled=enabled,
        required=required,
        ttl=ttl,
        lease=lease,  # "not given" passes through as itself
        max_body_bytes=max_body_bytes,  # "not given" passes through as itself
        fingerprint_headers=tuple(fingerprint_headers),
        transactional=transactional,
        fingerprint_exclude=tuple(fingerprint_exclude),
        mode=mode,
        key_from=key_from,
        wait=wait,
    )

    def mark(func: F) -> F:
        setattr(func, _POLICY_ATTR, policy)
        return func

    return mark


def policy_of(endpoint: Any) -> Policy | None:
    policy = getattr(endpoint, _POLICY_ATTR, None)
    return policy if isinstance(policy, Policy) else None


@dataclass(frozen=True, slots=True)
class ResolvedRoute:
    template: str  # e.g. "/orders/{order_id}/refunds", mount prefixes included
    endpoint: Any
    # Served by a Mount's or Host's app with its own IdempotencyMiddleware, which decides:
    # its principal is the one that app's auth yields (template: the Mount's path).
    delegated: bool = False


def mounted_app(route: Mount | Host) -> Any:
    """The app a Mount or Host was given, inside a Mount's own ``middleware=``."""
    return getattr(route, "_base_app", route.app)


# Routes that hand what they match to an app of their own, which the walkers enter.
SUB_APP_ROUTES: tuple[type[Mount | Host], ...] = (Mount, Host)


def sub_app_route(route: Any) -> Mount | Host | None:
    """``route`` (as FastAPI flattened it or not) when it hands what it matches to an app
    of its own, else ``None``."""
    original = getattr(route, "original_route", route)
    return original if isinstance(original, SUB_APP_ROUTES) else None


def sub_app_prefix(route: Mount | Host) -> str:
    """What the route adds to its app's templates: a Mount's path; nothing for a Host."""
    return route.path if isinstance(route, Mount) else ""


def decided_by_own_guard(route: Any, guard: object) -> bool:
    """Whether ``route`` hands its requests to an app with a guard other than ``guard``:
    that guard decides there, with the principal its app's auth yields, so ``guard``
    neither decides, checks policies, nor claims there. Every walker asks this."""
    sub = sub_app_route(route)
    return sub is not None and carries_guard(mounted_app(sub), guard)


def mount_level_guard(mount: Mount, besides: object = None) -> bool:
    """Whether a guard other than ``besides`` is in the Mount's own ``middleware=``. Such a
    guard resolves routes through the enclosing app's router with the Mount's
    ``root_path`` and finds none of them, so it cannot decide there."""
    node: Any = mount.app
    base = mounted_app(mount)
    for _ in range(100):
        if node is None or node is base:
            return False
        if getattr(type(node), "asgi_idempotency_guard", False) and node is not besides:
            return True
        node = getattr(node, "app", None)
    return False


def carries_guard(app: Any, besides: object = None) -> bool:
    """Whether ``app`` (a Mount's or Host's app) has an IdempotencyMiddleware of its own, other than
    ``besides`` (the guard asking): wrapping it, in the Mount's own middleware, or in a
    Starlette app's middleware (built, or still only listed)."""
    node = app
    for _ in range(100):  # a chain that loops is not followed for ever
        if node is None:
            return False
        if getattr(type(node), "asgi_idempotency_guard", False) and node is not besides:
            return True
        stack = getattr(node, "middleware_stack", None)
        if stack is None:  # not built yet: what it will build
            for entry in getattr(node, "user_middleware", ()):
                if getattr(getattr(entry, "cls", None), "asgi_idempotency_guard", False):
                    return True
        node = stack if stack is not None else getattr(node, "app", None)
    return False


def expand_routes(routes: Iterable[Any]) -> list[Any]:
    """Routes as the router tries them, FastAPI's included routers flattened.

    Recent FastAPI keeps included routers nested; its public ``iter_route_contexts``
    yields their effective routes with the full prefixed ``path_format``. If FastAPI
    was never imported there is no FastAPI router to flatten (and no import to pay).
    """
    fastapi_routing = sys.modules.get("fastapi.routing")
    flatten = getattr(fastapi_routing, "iter_route_contexts", None)
    if flatten is None:
        return list(routes)
    return list(flatten(list(routes)))


# The routes of an owner that has none (a Mount of a bare app): one list, so that two
# reads of such an owner compare equal.
_NO_ROUTES: list[Any] = []


def _routes_of(owner: Any) -> list[Any]:
    """A router's or a Mount's routes as they are now ([] for a Mount of a bare app)."""
    routes: list[Any] = getattr(owner, "routes", _NO_ROUTES)
    return routes


def _copy(routes: list[Any]) -> list[Any]:
    """What a route list holds now, to tell later whether it still holds the same.

    Compared with ``==``: CPython compares two lists item by item, by identity first, so
    an unchanged list costs a pointer comparison per route and a changed one stops at
    the first route that differs. A route swapped for another is seen even where the
    count stays the same; one equal to the route it replaced (Starlette's ``Route``
    compares path, endpoint and methods, the inputs of the decision) leaves it as it was.
    """
    return list(routes)


def _included_routers(routes: list[Any], found: list[tuple[Any, list[Any]]]) -> None:
    """Each FastAPI router included in ``routes`` (at any depth), with its routes now.

    Recent FastAPI keeps an included router nested: the app's list holds one entry for
    it whatever the router holds, and a route added to the router later changes only the
    router's own list, so that list is watched too.
    """
    for route in routes:
        router = getattr(route, "original_router", None)
        if router is None or any(owner is router for owner, _ in found):
            continue
        inner = _routes_of(router)
        found.append((router, _copy(inner)))
        _included_routers(inner, found)


def has_router(scope: Scope) -> bool:
    """Whether the app in ``scope`` routes requests itself (Starlette, FastAPI)."""
    return getattr(scope.get("app"), "router", None) is not None


# What a resolution read: each route list's owner, with what the list held then.
Seen = list[tuple[Any, list[Any]]]
# The flattened-route cache's entry: (the list, what it held, its routes flattened, the
# FastAPI routers included in it with what their lists held).
_Flat = tuple[list[Any], list[Any], list[Any], Seen]


class _Walk:
    """One resolution; notes whether the answer depended on more than method and path,
    and whose route lists it looked at (the router, the Mounts it entered, the FastAPI
    routers included in them) with what they held then, so a cached answer can tell
    that a route was added, removed or swapped for another since."""

    def __init__(self, expand: Callable[[list[Any]], _Flat], guard: object) -> None:
        self.expand = expand
        self.guard = guard
        self.cacheable = True
        self.seen: Seen = []

    def __call__(self, owner: Any, scope: dict[str, Any], prefix: str) -> ResolvedRoute | None:
        _, held, flat, included = self.expand(_routes_of(owner))
        self.seen.append((owner, held))
        self.seen += included
        for route in flat:
            sub = sub_app_route(route)
            if isinstance(sub, Host):
                self.cacheable = False  # the Host header decides, not the path
            try:
                match, child = route.matches(scope)
            except (AttributeError, NotImplementedError, KeyError):
                continue
            if match is not Match.FULL:
                continue
            if sub is not None and decided_by_own_guard(sub, self.guard):
                return ResolvedRoute(prefix + sub_app_prefix(sub), sub.app, delegated=True)
            if sub is not None:
                found = self(sub, {**scope, **child}, prefix + sub_app_prefix(sub))
                if found is not None:
                    return found
                continue
            template = str(getattr(route, "path_format", None) or getattr(route, "path", ""))
            endpoint = child.get("endpoint", getattr(route, "endpoint", None))
            return ResolvedRoute(prefix + template, endpoint)
        return None


T = TypeVar("T")

# What decides a request's answer from its route: (scope, the route the router would
# run or None, whether the app has a router at all) -> the answer to cache.
Decide = Callable[[Scope, "ResolvedRoute | None", bool], T]


class RouteResolver(Generic[T]):
    """Finds the route the app's own router would run, and caches what ``decide`` makes
    of it per (router, method, root path, path).

    Walks ``scope["app"].router`` with Starlette's public ``matches`` protocol,
    into Mounts and FastAPI's nested included routers. Only a full match counts:
    a 404 or 405 resolves to ``None`` because no handler runs. ``decide`` turns the
    route into the caller's answer (the middleware's: policy, label, fingerprint
    prefix), so that a repeated path costs one dict lookup and nothing else.

    A cached answer is used only while every route list the walk looked at (the
    router's, those of the Mounts it entered and of the FastAPI routers included on
    the way) holds the routes it held then, so a route added, removed or swapped for
    another anywhere on the way is seen on the next request. Apps
    whose walk meets a Host route are resolved afresh every time, since the Host
    header decides there. At most ``maxsize`` answers are kept, then the cache
    starts over. Call :meth:`clear` when what ``decide`` reads changes.
    """

    def __init__(self, decide: Decide[T], maxsize: int = 4096, *, guard: object = None) -> None:
        self.maxsize = maxsize
        self._decide = decide
        self._guard = guard  # the guard resolving: a Mount with another guard is that one's
        # (id(router), method, root_path, path) -> (answer, router, what the walk read)
        self._answers: dict[tuple[int, str, str, str], tuple[T, Any, Seen]] = {}
        # id(routes list) -> its flattened routes, and what they were made of (_Flat)
        self._flat: dict[int, _Flat] = {}

    def clear(self) -> None:
        self._answers.clear()

    def _expand(self, routes: list[Any]) -> _Flat:
        cached = self._flat.get(id(routes))
        if cached is not None and cached[0] is routes and _unchanged(cached[1], routes, cached[3]):
            return cached
        included: Seen = []
        _included_routers(routes, included)
        entry = (routes, _copy(routes), expand_routes(routes), included)
        if len(self._flat) >= self.maxsize:
            self._flat.clear()
        self._flat[id(routes)] = entry
        return entry

    def __call__(self, scope: Scope) -> T:
        router = getattr(scope.get("app"), "router", None)
        key = (id(router), scope["method"], scope.get("root_path", ""), scope["path"])
        cached = self._answers.get(key)
        # The router is compared as well as its id: a freed router's id can be reused.
        if cached is not None and cached[1] is router:
            for owner, held in cached[2]:
                # Read again, not remembered: a Mount's routes are its app's current list.
                if getattr(owner, "routes", _NO_ROUTES) != held:
                    break
            else:
                return cached[0]
        if router is None:
            answer = self._decide(scope, None, False)
            seen: Seen = []
        else:
            walk = _Walk(self._expand, self._guard)
            found = walk(router, dict(scope), "")
            answer = self._decide(scope, found, True)
            if not walk.cacheable:
                return answer
            seen = walk.seen
        if len(self._answers) >= self.maxsize:
            self._answers.clear()
        self._answers[key] = (answer, router, seen)
        return answer


def _unchanged(held: list[Any], routes: list[Any], included: Seen) -> bool:
    """Whether ``routes`` and the routers included in it hold what they held."""
    if routes != held:
        return False
    return all(_routes_of(router) == inner for router, inner in included)


def iter_endpoint_policies(app: Any, guard: object = None) -> list[Policy]:
    """Every ``@idempotent`` policy on an endpoint the app's router can reach, except in
    Mounts or Hosts whose app has a guard other than ``guard``."""
    found: list[Policy] = []

    def walk(routes: Iterable[Any]) -> None:
        for route in expand_routes(routes):
            sub = sub_app_route(route)
            if sub is not None and decided_by_own_guard(sub, guard):
                continue  # its own guard checks its policies
            if sub is not None:
                walk(sub.routes)
                continue
            policy = policy_of(getattr(route, "endpoint", None))
            if policy is not None:
                found.append(policy)

    walk(getattr(getattr(app, "router", None), "routes", ()))
    return found


def normalise_policies(policies: Mapping[str, Policy]) -> dict[str, Policy]:
    """The policies map with each entry spelled as requests are looked up: ``"METHOD
    /template"`` with the method upper-cased (``"post /refunds"`` is ``"POST /refunds"``,
    as ``methods=`` is read), or a bare template.

    Raises:
        ValueError: two entries name the same method and route once normalised.
    """
    found: dict[str, Policy] = {}
    given: dict[str, str] = {}
    for entry, policy in policies.items():
        method, _, template = entry.strip().rpartition(" ")
        method = method.strip().upper()
        key = f"{method} {template}" if method else template
        if key in found:
            raise ValueError(
                f"policies[{given[key]!r}] and policies[{entry!r}] both name {key!r}: "
                "keep one (methods are case-insensitive)"
            )
        found[key], given[key] = policy, entry
    return found


def lookup(
    policies: Mapping[str, Policy], method: str, resolved: ResolvedRoute | None, path: str
) -> Policy | None:
    """The explicit policy for a request: ``policies`` first, then the endpoint's decorator."""
    template = resolved.template if resolved is not None else path
    explicit = policies.get(f"{method} {template}") or policies.get(template)
    if explicit is not None:
        return explicit
    return policy_of(resolved.endpoint) if resolved is not None else None


class RouteGuard(NamedTuple):
    """How requests to one path are guarded: decided once per path, then cached."""

    policy: Policy
    route: str  # the route template, the label of logs and metrics
    prefix: bytes  # the fingerprint's method-and-path part (fingerprint.request_prefix)
    header_names: frozenset[bytes]  # the policy's, read here without a property call
    unnamed: bool = False  # from_dependency, on a route that does not use the dependency

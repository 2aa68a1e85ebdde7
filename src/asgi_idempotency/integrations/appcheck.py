"""Startup checks against the app the guard wraps: refuse what would guard wrongly.

Run at lifespan startup (a problem fails startup with a message naming the fix) or,
for an app served without lifespan, before its first request (a problem is then
answered 500 on every guarded request, and logged). What is checked:

- **who the caller is**: the middleware a principal helper reads from placed outside
  the guard; with :func:`~.principals.from_dependency`, every route the guard would
  guard using the dependency (those routes get the claim), and the dependency's
  return annotation naming the caller (a ``str``, or a class with ``identity``/``id``);
- **middleware order**: authentication, session, CORS, GZip and TrustedHost
  middleware inside the guard (their per-request output would be stored and replayed
  to other requests, or they would run after the guard has decided);
- **the policies map**: every entry names a route and method the app serves, and not
  one a mounted app with its own guard serves (that guard decides there).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.routing import Mount

from asgi_idempotency.core.errors import (
    GuardMisconfigured,
    MiddlewareMisplaced,
    PrincipalMisconfigured,
)
from asgi_idempotency.http.policy import (
    Policy,
    ResolvedRoute,
    decided_by_own_guard,
    expand_routes,
    mount_level_guard,
    sub_app_prefix,
    sub_app_route,
)
from asgi_idempotency.http.principals import DependencyPrincipal, _FromSession, _FromUser

__all__ = ["StartupReport", "inspect_app"]

# Middleware that must sit outside the guard, and why.
_OUTSIDE = {
    "AuthenticationMiddleware": (
        "it sets scope['user'] after the guard has already scoped the request"
    ),
    "SessionMiddleware": "it loads scope['session'] after the guard has already scoped the request",
    "CORSMiddleware": (
        "its per-origin Access-Control-* headers would be stored and replayed to other "
        "origins, and the guard's own 400/409/422 would reach browsers without them"
    ),
    "GZipMiddleware": (
        "a compressed body would be stored and replayed to clients that did not accept it"
    ),
    "TrustedHostMiddleware": "its 400 for an untrusted Host would be stored and replayed",
}
_MOVE = (
    "Add it after IdempotencyMiddleware with app.add_middleware (the last added runs "
    "first), or before it in middleware=[...]."
)


@dataclass
class StartupReport:
    """What the checks found, and what the guard set up on the way."""

    problems: list[str] = field(default_factory=list)  # who the caller is
    order: list[str] = field(default_factory=list)  # middleware inside the guard
    # Policies-map entries naming no route or method the app serves.
    unmatched: list[str] = field(default_factory=list)
    claim_endpoints: set[int] = field(default_factory=set)  # ids of endpoints given the claim

    def refusal(self, others: Iterable[str] = ()) -> GuardMisconfigured | None:
        """Every problem found (and ``others``), as the error that names their kind."""
        problems = [*self.problems, *self.order, *self.unmatched, *others]
        if not problems:
            return None
        kind = GuardMisconfigured
        if problems == self.problems:
            kind = PrincipalMisconfigured
        elif problems == self.order:
            kind = MiddlewareMisplaced
        if len(problems) == 1:
            return kind(problems[0])
        lines = "\n".join(f"- {p}" for p in problems)
        return kind(f"IdempotencyMiddleware cannot guard this app safely as wired:\n{lines}")


def _chain(node: Any, until: Any = None) -> list[Any]:
    """The ASGI apps from ``node`` inward, through each ``.app`` (and a Starlette app's
    built middleware stack), up to ``until`` or the router."""
    found: list[Any] = []
    for _ in range(100):  # a chain that loops is not followed for ever
        if node is None or node is until:
            break
        found.append(node)
        stack = getattr(node, "middleware_stack", None)
        node = stack if stack is not None else getattr(node, "app", None)
    return found


def _names(nodes: Iterable[Any]) -> list[str]:
    return [type(n).__name__ for n in nodes]


@dataclass(frozen=True, slots=True)
class _Delegated:
    """Where a Mount's or Host's app with a guard of its own serves requests."""

    where: str  # how a refusal names it
    prefix: str | None  # every template under it (a Mount's path, a Host of a bare app)
    templates: frozenset[str]  # the templates its app's routes serve

    def serves(self, template: str) -> bool:
        under = self.prefix is not None and template.startswith(self.prefix + "/")
        return under or template in self.templates


def _templates(app: Any, guard: object) -> tuple[dict[str, set[str]], list[_Delegated], list[str]]:
    """Every route template the app's router serves, with its methods ("*" for any);
    where Mounts' and Hosts' apps with a guard other than ``guard`` serve; and the paths
    of Mounts with a guard in their own ``middleware=``."""
    served: dict[str, set[str]] = {}
    guarded: list[_Delegated] = []
    mount_level: list[str] = []

    def walk(routes: Iterable[Any], prefix: str, into: dict[str, set[str]], outer: bool) -> None:
        for route in expand_routes(list(routes)):
            sub = sub_app_route(route)
            if sub is None:
                template = str(getattr(route, "path_format", None) or getattr(route, "path", ""))
                methods = getattr(route, "methods", None)
                into.setdefault(prefix + template, set()).update(methods or {"*"})
                continue
            sub_prefix = prefix + sub_app_prefix(sub)
            if not outer:  # inside a guarded app: only its templates are wanted
                walk(sub.routes, sub_prefix, into, outer)
                continue
            if isinstance(sub, Mount) and mount_level_guard(sub, guard):
                mount_level.append(sub_prefix)
            if not decided_by_own_guard(sub, guard):
                walk(sub.routes, sub_prefix, into, outer)
            elif isinstance(sub, Mount):
                guarded.append(
                    _Delegated(f"the app mounted at {sub_prefix}", sub_prefix, frozenset())
                )
            else:
                theirs: dict[str, set[str]] = {}
                walk(sub.routes, sub_prefix, theirs, False)
                bare = None if theirs else sub_prefix  # a bare ASGI app takes every path
                guarded.append(
                    _Delegated(f"the app at Host({sub.host!r})", bare, frozenset(theirs))
                )

    walk(getattr(getattr(app, "router", None), "routes", ()), "", served, True)
    return served, guarded, mount_level


def _check_policies_map(
    policies: Iterable[str], served: dict[str, set[str]], guarded: list[_Delegated]
) -> Iterator[str]:
    if not served and not guarded:
        return  # a bare ASGI app has no templates to check against
    for entry in policies:
        method, _, template = entry.rpartition(" ")
        method = method.strip().upper()
        methods = served.get(template)
        delegated = next((d for d in guarded if d.serves(template)), None)
        if methods is None and delegated is not None:
            yield (
                f"policies[{entry!r}]: {delegated.where} serves it and has an "
                "IdempotencyMiddleware of its own, which decides there: give the policy "
                "to that guard"
            )
        elif methods is None:
            near = difflib.get_close_matches(template, list(served), n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            yield f"policies[{entry!r}] names no route the app serves{hint}"
        elif method and "*" not in methods and method not in methods:
            yield (
                f"policies[{entry!r}]: {template} serves {', '.join(sorted(methods))}, not {method}"
            )


def inspect_app(
    app: Any,
    guard: Any,
    principal: Any,
    policies: Iterable[str],
    policy_for: Callable[[str, ResolvedRoute], tuple[Policy | None, bool]],
) -> StartupReport:
    """Check ``app`` as wrapped by ``guard``; give FastAPI routes the claim if deferred.

    ``policy_for(method, route)`` answers how a request to ``route`` is guarded and
    whether that policy is explicit (the policies map or ``@idempotent``) rather than
    the default policy.
    """
    report = StartupReport()
    problems = report.problems
    stack = getattr(app, "middleware_stack", None)
    # Outside: the app's built stack down to the guard, when the guard is in it (added
    # with add_middleware or middleware=[...]); a guard wrapping the app has none.
    in_stack = any(n is guard for n in _chain(stack))
    outside = set(_names(_chain(stack, until=guard))) if in_stack else set()
    inside = _names(_chain(guard.app))

    for name in inside:
        why = _OUTSIDE.get(name)
        if why is None:
            continue
        if name in ("AuthenticationMiddleware", "SessionMiddleware") and isinstance(
            principal, DependencyPrincipal
        ):
            continue  # read by the app's dependency, after them: their place does not matter
        report.order.append(f"{name} is inside IdempotencyMiddleware: {why}. {_MOVE}")

    names = outside | set(inside)
    if isinstance(principal, _FromUser) and "AuthenticationMiddleware" not in names:
        problems.append(
            "principal=from_user() needs Starlette's AuthenticationMiddleware outside "
            "IdempotencyMiddleware; none is in the app's middleware."
        )
    if isinstance(principal, _FromSession) and "SessionMiddleware" not in names:
        problems.append(
            f"principal={principal!r} needs SessionMiddleware outside "
            "IdempotencyMiddleware; none is in the app's middleware."
        )
    served, guarded, mount_level = _templates(app, guard)
    report.unmatched.extend(_check_policies_map(policies, served, guarded))
    for path in mount_level:
        problems.append(
            f"Mount({path!r}, middleware=[...]) holds an IdempotencyMiddleware, which cannot "
            "see the Mount's routes from there and would leave its requests to this guard "
            "and this principal: put it in the mounted app's own middleware instead "
            f"(Mount({path!r}, app=Starlette(routes=..., middleware=[...])))."
        )

    fastapi = sys.modules.get("fastapi")
    if fastapi is None or not isinstance(app, fastapi.FastAPI):
        if isinstance(principal, DependencyPrincipal):
            problems.append(
                f"principal={principal!r} needs a FastAPI app; this is "
                f"{type(app).__name__}: pass a function of the scope instead."
            )
        return report
    if not isinstance(principal, DependencyPrincipal):
        return report
    from asgi_idempotency.integrations import fastapi as fastapi_claim

    unnamed = fastapi_claim.unnamed_return(principal)
    if unnamed is not None:
        problems.append(unnamed)
    claim = fastapi_claim.claim_dependency(principal)
    for op in fastapi_claim.operations(app, guard):
        resolved = ResolvedRoute(op.template, op.endpoint)
        for method in sorted(op.methods):
            policy, explicit = policy_for(method, resolved)
            if policy is None or not policy.enabled or policy.key_from is not None:
                continue  # a webhook's caller is its sender, whatever the app's auth
            where = f"{method} {op.template}"
            if not fastapi_claim.uses(op.dependant, principal.dependency):
                # Even under the default policy only: a keyed request there would run
                # unguarded, however the route authenticates its callers.
                how = (
                    "is guarded"
                    if explicit
                    else "is guarded by the default policy when a request carries Idempotency-Key"
                )
                problems.append(
                    f"{where} {how}, but does not use {principal.name}, so {principal!r} "
                    f"cannot name its caller: add Depends({principal.name}) to it, or "
                    f"exempt it with policies={{{where!r}: Policy(enabled=False)}}."
                )
                continue
            fastapi_claim.instrument(op, claim)
            report.claim_endpoints.add(id(op.endpoint))
    return report

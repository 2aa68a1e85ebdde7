"""FastAPI: what the guard reads from routes' dependencies, and the claim at the auth dependency.

With :func:`~.principals.from_dependency`, the caller is known only once FastAPI has
resolved the app's auth dependency. At startup the guard adds one dependency of its
own to every guarded route that uses it (:func:`instrument`); FastAPI caches the auth
dependency per request, so it still runs once. That dependency claims the key through
the request's :class:`~.responder.Responder`, so a request auth rejects (401, 403)
is never claimed; one that then fails FastAPI's validation is released (never stored);
and when the guard answers itself (replay, 409, 422, 503) it stops the endpoint with
:class:`~.responder.GuardAnswered` and drops what the app sends instead.

The routes are read through FastAPI's public ``iter_route_contexts`` (included routers
flattened, with their effective dependencies), and the dependency is added both to
the dependant each context runs and to the route's ``dependencies``, from which
FastAPI builds contexts anew when routes change.

Only imported when the app is a FastAPI app: FastAPI is not a dependency.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import get_dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.security.base import SecurityBase
from starlette.routing import Host, Mount

from .errors import IdempotencyError, PrincipalMisconfigured
from .keys import HEADER
from .principals import DependencyPrincipal
from .responder import GUARD_SCOPE_KEY, GuardAnswered, Responder

__all__ = ["GuardedOperation", "claim_dependency", "instrument", "operations", "per_caller_inputs"]

_IDEMPOTENCY_HEADER = HEADER.decode()


@dataclass(frozen=True, slots=True)
class GuardedOperation:
    """One FastAPI route context the app serves: its template, methods and dependant."""

    template: str  # with every prefix (Mounts, included routers)
    methods: frozenset[str]
    endpoint: Any
    dependant: Dependant
    route: APIRoute  # the original route (its ``dependencies`` feed rebuilt contexts)


def operations(app: Any) -> Iterator[GuardedOperation]:
    """Every FastAPI route the app can reach, included routers and Mounts walked."""

    def walk(routes: list[Any], prefix: str) -> Iterator[GuardedOperation]:
        for context in iter_route_contexts(routes):
            original = context.original_route
            if isinstance(original, Mount):
                yield from walk(list(original.routes), prefix + original.path)
                continue
            if isinstance(original, Host):
                yield from walk(list(original.routes), prefix)
                continue
            if not isinstance(original, APIRoute):
                continue
            dependant = getattr(context, "dependant", None)
            if not isinstance(dependant, Dependant):
                continue
            template = str(getattr(context, "path_format", None) or original.path_format)
            yield GuardedOperation(
                prefix + template,
                frozenset(context.methods or ()),
                original.endpoint,
                dependant,
                original,
            )

    router = getattr(app, "router", None)
    if router is not None:
        yield from walk(list(router.routes), "")


def _walk(dependant: Dependant) -> Iterator[tuple[Dependant, Dependant | None]]:
    """Every dependant under ``dependant``, with the top-level dependency it hangs from."""
    for top in dependant.dependencies:
        stack = [top]
        while stack:
            node = stack.pop()
            yield node, top
            stack.extend(node.dependencies)


def _name(call: Any) -> str:
    if call is None:
        return "?"
    if isinstance(call, SecurityBase) or not (inspect.isfunction(call) or inspect.ismethod(call)):
        return f"{type(call).__name__}(...)"
    return str(getattr(call, "__qualname__", call))


def uses(dependant: Dependant, dependency: Callable[..., Any]) -> bool:
    """Whether ``dependency`` is among what FastAPI resolves for ``dependant``."""
    return any(node.call is dependency for node, _ in _walk(dependant))


def per_caller_inputs(dependant: Dependant) -> list[str]:
    """What in a route's dependencies tells callers apart and that the guard cannot key on:
    security schemes (named by the dependency the route uses them through), header and
    cookie parameters. Empty when nothing does."""
    found: list[str] = []
    for node, top in _walk(dependant):
        if isinstance(node.call, SecurityBase):
            via = top.call if top is not None else node.call
            label = (
                f"the security scheme {_name(node.call)}"
                if via is node.call
                else f"{_name(via)} (through {_name(node.call)})"
            )
            found.append(label)
    for node in [dependant, *(n for n, _ in _walk(dependant))]:
        for param in node.header_params:
            alias = str(param.alias or param.name).lower().replace("_", "-")
            if alias != _IDEMPOTENCY_HEADER and alias not in ("content-type", "content-length"):
                found.append(f"the header parameter {param.alias or param.name!r}")
        for param in node.cookie_params:
            found.append(f"the cookie parameter {param.alias or param.name!r}")
    return list(dict.fromkeys(found))


def claim_dependency(principal: DependencyPrincipal) -> Callable[..., AsyncIterator[None]]:
    """The dependency the guard adds to a route: claim once ``principal``'s dependency
    has named the caller."""
    caller_param = Depends(principal.dependency)  # FastAPI reads it from the signature

    async def claim(request: Request, caller: Any = caller_param) -> AsyncIterator[None]:
        responder = request.scope.get(GUARD_SCOPE_KEY)
        if not isinstance(responder, Responder) or not responder.waiting:
            yield  # not guarded (no key on an optional route), or claimed already
            return
        refusal: IdempotencyError | None = None
        try:
            who = principal.principal_of(caller)
        except IdempotencyError as exc:
            refusal = exc
        else:
            if not who:
                refusal = PrincipalMisconfigured(f"{principal!r} named an empty caller")
        if refusal is not None:
            if not await responder.refuse(refusal):
                raise GuardAnswered()
            yield  # report-only mode: the endpoint runs, and its answer goes out
            return
        if not await responder.claim_deferred(who):
            raise GuardAnswered()
        try:
            yield
        except RequestValidationError:
            # Rejected before the endpoint: nothing ran, so nothing is kept.
            await responder.endpoint_skipped()
            raise

    claim.__qualname__ = claim.__name__ = "idempotency_claim"
    return claim


def _has(dependant: Dependant, claim: Callable[..., Any]) -> bool:
    return any(d.call is claim for d in dependant.dependencies)


def instrument(operation: GuardedOperation, claim: Callable[..., Any]) -> None:
    """Add ``claim`` to the dependencies FastAPI resolves for ``operation``, once."""
    if not _has(operation.dependant, claim):
        operation.dependant.dependencies.append(get_dependant(path=operation.template, call=claim))
    route = operation.route
    if not any(getattr(d, "dependency", None) is claim for d in route.dependencies):
        route.dependencies.append(Depends(claim))

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

import collections.abc
import inspect
import types
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import get_dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.security.base import SecurityBase

from asgi_idempotency.core.errors import IdempotencyError, PrincipalMisconfigured
from asgi_idempotency.http.policy import decided_by_own_guard, sub_app_prefix, sub_app_route
from asgi_idempotency.http.principals import DependencyPrincipal
from asgi_idempotency.http.responder import GUARD_SCOPE_KEY, GuardAnswered, Responder

__all__ = ["GuardedOperation", "claim_dependency", "instrument", "operations", "unnamed_return"]


@dataclass(frozen=True, slots=True)
class GuardedOperation:
    """One FastAPI route context the app serves: its template, methods and dependant."""

    template: str  # with every prefix (Mounts, included routers)
    methods: frozenset[str]
    endpoint: Any
    dependant: Dependant
    route: APIRoute  # the original route (its ``dependencies`` feed rebuilt contexts)


def operations(app: Any, guard: object = None) -> Iterator[GuardedOperation]:
    """Every FastAPI route the app can reach, included routers, Mounts and Hosts walked,
    except Mounts or Hosts whose app has a guard other than ``guard``."""

    def walk(routes: list[Any], prefix: str) -> Iterator[GuardedOperation]:
        for context in iter_route_contexts(routes):
            original = context.original_route
            sub = sub_app_route(original)
            if sub is not None and decided_by_own_guard(sub, guard):
                continue  # its own guard decides there, with its own principal
            if sub is not None:
                yield from walk(list(sub.routes), prefix + sub_app_prefix(sub))
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


def unnamed_return(principal: DependencyPrincipal) -> str | None:
    """Why the dependency's return annotation cannot name a caller, or ``None``.

    Read where the annotation names one class (``User``, ``User | None``,
    ``Annotated[User, ...]``, a generator dependency's yield type): a ``str``, or a class
    with an ``identity`` or ``id`` attribute or field, names one. Anything looser (no
    annotation, ``Any``, a union of classes) is left to the request's own check.
    """
    if principal.identity is not None:
        return None
    call = principal.dependency
    target = call if inspect.isroutine(call) else getattr(call, "__call__", call)  # noqa: B004
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # an annotation that does not resolve: nothing to read
        return None
    returned = _one_class(hints.get("return"))
    if returned is None or returned is str or issubclass(returned, str):
        return None
    if any(_has_attribute(returned, name) for name in ("identity", "id")):
        return None
    return (
        f"principal={principal!r}: {principal.name} returns {returned.__qualname__}, which "
        "has neither an 'identity' nor an 'id' to name the caller, so every guarded request "
        "would fail. Pass identity= the attribute that names the caller (e.g. "
        f'from_dependency({principal.name}, identity="username")) or a function of the '
        f"{returned.__qualname__} returning a str; never a display name, which two callers "
        "can share."
    )


def _one_class(annotation: Any) -> type | None:
    """The one class ``annotation`` promises, unwrapping Annotated, Optional and the
    iterators a generator dependency is annotated with; ``None`` if not one class."""
    for _ in range(10):
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        union = origin in (typing.Union, types.UnionType)
        if not args or not (origin is typing.Annotated or origin in _ITERATORS or union):
            break
        if union and len(args) != 1:
            return None  # several classes: which one comes is the request's to say
        annotation = args[0]
    generic = typing.get_origin(annotation)
    if isinstance(generic, type):
        annotation = generic  # dict[str, str]: a dict
    if not isinstance(annotation, type) or annotation in (object, typing.Any):
        return None
    if getattr(annotation, "_is_protocol", False):
        return None
    return annotation


_ITERATORS = (
    collections.abc.Iterator,
    collections.abc.Generator,
    collections.abc.AsyncIterator,
    collections.abc.AsyncGenerator,
    collections.abc.Iterable,
    collections.abc.AsyncIterable,
)


def _has_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute or property, a
    dataclass or pydantic field, or an annotation anywhere in its MRO."""
    if hasattr(cls, name):
        return True
    if name in getattr(cls, "model_fields", {}):  # pydantic v2 fields are not class attributes
        return True
    return any(name in getattr(base, "__annotations__", {}) for base in cls.__mro__)


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
    """Add ``claim`` to the dependencies FastAPI resolves for ``operation``, once.

    First among the endpoint's own dependencies (FastAPI resolves them in order), so a
    transactional route's claim has opened the transaction before a dependency of the
    handler asks for its session (:func:`.transactional.get_session`); the auth
    dependency it names the caller by is resolved first, as its own dependency.
    """
    if not _has(operation.dependant, claim):
        dependency = get_dependant(path=operation.template, call=claim)
        operation.dependant.dependencies.insert(0, dependency)
    route = operation.route
    if not any(getattr(d, "dependency", None) is claim for d in route.dependencies):
        route.dependencies.insert(0, Depends(claim))

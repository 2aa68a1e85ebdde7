"""What a guarded call is made of: its record key, its fingerprint, the codec of its
result, and the checks of what the guard is given (a key, a namespace, a wait)."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import orjson

from asgi_idempotency.core.canonical import canonical_json
from asgi_idempotency.core.terms import duration

__all__ = ["Call", "Codec", "fingerprint", "record_key"]


class Codec(Protocol):
    """How a result becomes the record's bytes and back (the default: ``orjson``)."""

    def dumps(self, value: Any, /) -> bytes: ...

    def loads(self, data: bytes, /) -> Any: ...


class ORJSON:
    """orjson: JSON types, plus what orjson serialises natively (returned as JSON)."""

    __slots__ = ()

    def dumps(self, value: Any, /) -> bytes:
        return orjson.dumps(value)

    def loads(self, data: bytes, /) -> Any:
        return orjson.loads(data)


def record_key(namespace: str, key: str) -> str:
    """The record's primary key: a digest of (namespace, key), never the raw key.

    Built as :func:`.keys.scoped_key` is, length-prefixed, with the namespace in the
    principal's place; its material starts with ``o`` where scoped_key's starts with a
    digit or ``h``, so a function's record never shares a key with a request's even
    when the middleware and the function guard share one store.
    """
    material = f"o{len(namespace)}:{namespace}\x00{key}"
    return hashlib.sha256(material.encode()).hexdigest()


def fingerprint(
    name: str,
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exclude: Collection[str] = (),
) -> str:
    """SHA-256 hex of the canonical JSON of ``name`` and the call's bound arguments.

    Bound through ``signature`` with defaults applied, so ``f(1)``, ``f(x=1)`` and
    ``f(1, y=<its default>)`` are one call.

    Raises:
        TypeError: the arguments do not fit the signature (as calling it would).
        CanonicalJSONError: an argument has no canonical JSON form (convert it first,
            or name its parameter in ``exclude``).
    """
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = {k: v for k, v in bound.arguments.items() if k not in exclude}
    return hashlib.sha256(canonical_json([name, arguments])).hexdigest()


class Call(NamedTuple):
    """One guarded call, as the store steps see it."""

    key: str  # the record key (a digest)
    fingerprint: str
    namespace: str  # logged as the route: the programmer's name, not the caller's data
    wait: timedelta | None
    function: str  # the qualified name, for traces (code.function.name)
    transactional: bool = False  # the function gets ``session``, in the claim's transaction


NO_WAIT_IN_TRANSACTIONS = (
    "wait is not available with transactional=True: a running holder's claim is an open "
    "transaction that no reader can see"
)


def without_session(fn: Callable[..., Any], signature: inspect.Signature) -> inspect.Signature:
    """``fn``'s signature without the ``session`` the guard passes it: what callers bind."""
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"transactional=True needs an async function ({qualname(fn)} is not): its "
            "session is an SQLAlchemy AsyncSession"
        )
    session = signature.parameters.get("session")
    if session is None or session.kind not in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        raise TypeError(
            f"transactional=True passes the function a keyword argument session (an "
            f"AsyncSession in the claim's transaction): give {qualname(fn)} a parameter "
            "`*, session`"
        )
    return signature.replace(
        parameters=[p for name, p in signature.parameters.items() if name != "session"]
    )


def qualname(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", type(fn).__qualname__))


def key_of(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"a key is a str, got {type(key).__name__}")
    if not key:
        raise ValueError("a key is a non-empty str")
    return key


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("namespace must be a non-empty str")
    if namespace.startswith("/"):
        # Metrics and logs count a function's calls under its namespace where a request
        # is counted under its route template, which always starts with "/".
        raise ValueError(f"namespace must not start with '/' (route templates do): {namespace!r}")
    return namespace


def check_wait(wait: timedelta | None) -> timedelta | None:
    # Not bounded by the lease, unlike Policy(wait=...): no client connection is held
    # open meanwhile, and a redelivery may well wait out a dead holder's lease to take
    # its key over.
    return None if wait is None else duration("wait", wait)

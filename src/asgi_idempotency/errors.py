"""Every error the server side raises, in one tree, and its RFC 9457 rendering.

::

    IdempotencyError            (abstract; carries status, type, title)
    ├── MissingKey              400  required key absent
    ├── InvalidKey              400  empty, too long, not printable ASCII, sent twice
    ├── BodyTooLarge            413  request body over the policy's limit
    ├── KeyMismatch             422  same key, different request
    ├── RequestInProgress       409  same key still running elsewhere (Retry-After)
    ├── ResponseNotKept         410  stored for a streamed response too large to keep
    ├── PrincipalMissing        401  the request names no caller, and keys are per caller
    ├── PrincipalMisconfigured  500  the guard cannot tell callers apart as wired: names the fix
    └── StoreUnavailable        503  the store failed; the handler did not run (Retry-After)
        └── StoreError               raised by a store: unreachable, timed out, driver error
            └── SchemaMissing        the table or its migration is missing: names the fix

Stores translate their driver's exceptions into :class:`StoreError` at their own
boundary (``raise StoreError(...) from exc``), so nothing above ``stores/`` ever
catches a driver type. The client half (``asgi_idempotency.client``) has errors of
its own and imports nothing from here.
"""

from __future__ import annotations

import math

import orjson

from .asgi import Send, send_response

__all__ = [
    "BodyTooLarge",
    "IdempotencyError",
    "InvalidKey",
    "KeyMismatch",
    "MissingKey",
    "PrincipalMisconfigured",
    "PrincipalMissing",
    "RequestInProgress",
    "ResponseNotKept",
    "SchemaMissing",
    "StoreError",
    "StoreUnavailable",
]

# Stable, dereference-free identifiers (RFC 9457 §3.1.1 allows non-resolvable URIs).
_TYPE_PREFIX = "urn:asgi-idempotency:problem:"


class IdempotencyError(Exception):
    """Base of every error the middleware answers for itself."""

    status: int = 500
    slug: str = "error"
    title: str = "Idempotency error"

    def __init__(self, detail: str, *, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPE_PREFIX + self.slug

    def body(self) -> bytes:
        return orjson.dumps(
            {"type": self.type, "title": self.title, "status": self.status, "detail": self.detail}
        )

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/problem+json")]
        if self.retry_after is not None:
            seconds = max(1, math.ceil(self.retry_after))
            headers.append((b"retry-after", str(seconds).encode()))
        return headers

    async def send(self, send: Send) -> None:
        """Answer the request with this problem."""
        await send_response(send, self.status, self.headers(), self.body())


class MissingKey(IdempotencyError):
    status = 400
    slug = "missing-key"
    title = "Idempotency-Key header required"


class InvalidKey(IdempotencyError):
    status = 400
    slug = "invalid-key"
    title = "Invalid Idempotency-Key header"


class BodyTooLarge(IdempotencyError):
    status = 413
    slug = "body-too-large"
    title = "Request body too large"


class KeyMismatch(IdempotencyError):
    status = 422
    slug = "key-reused"
    title = "Idempotency-Key reused with a different request"


class RequestInProgress(IdempotencyError):
    status = 409
    slug = "in-progress"
    title = "A request with this Idempotency-Key is in progress"


class ResponseNotKept(IdempotencyError):
    """Stored in place of a streamed response too large to keep: the request ran once,
    and a retry is told so rather than running it again or replaying part of it."""

    status = 410
    slug = "response-not-kept"
    title = "The response to this Idempotency-Key was not kept"


class PrincipalMissing(IdempotencyError):
    """A guarded request names no caller (no user, session field or gateway header),
    while the guard was told that keys belong to callers: never run it as anonymous."""

    status = 401
    slug = "unauthenticated"
    title = "Caller not identified"


class PrincipalMisconfigured(IdempotencyError):
    """The guard cannot tell callers apart as the app is wired; the detail names the fix.

    A configuration error, raised at startup where the guard can see it, else answered
    500 (and logged) on the request that shows it: scoping a caller's key by a guess
    could hand one caller another's stored response.
    """

    status = 500
    slug = "principal-unknown"
    title = "The idempotency guard cannot identify the caller"


class StoreUnavailable(IdempotencyError):
    status = 503
    slug = "store-unavailable"
    title = "Idempotency store unavailable"


class StoreError(StoreUnavailable):
    """A store could not answer: unreachable, timed out, read-only, or a driver error.

    The message names the driver's exception class and its message, never a key or a
    body; the middleware answers such a failure with its own 503 (or runs the handler
    unguarded with ``fail_open``).
    """

    def __init__(self, detail: str) -> None:
        super().__init__(detail)

    @classmethod
    def wrap(cls, exc: BaseException) -> StoreError:
        """The one spelling of a translated driver error: ``"ClassName: message"``."""
        return cls(f"{type(exc).__name__}: {exc}")


class SchemaMissing(StoreError):
    """The store's database lacks the records table, or the migration head is not applied.

    On Postgres the schema is the operator's: the message names the table and the
    command that fixes it (``asgi-idempotency migrate --database-url ...``). Raised by
    ``SQLStore.prepare()``; the middleware fails lifespan startup with it, or answers
    503 with it as the ``detail`` when the app runs without a lifespan.
    """

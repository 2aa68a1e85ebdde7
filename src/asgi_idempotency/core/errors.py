"""Every error the server side raises, in one tree, and its RFC 9457 rendering.

::

    IdempotencyError            (abstract; carries status, type, title)
    ├── MissingKey              400  required key absent
    ├── InvalidKey              400  empty, too long, not printable ASCII, sent twice
    ├── InvalidHost             400  the request names its host twice (two Host headers)
    ├── InvalidSignature        400  a webhook delivery its sender did not sign
    ├── BodyTooLarge            413  request body over the policy's limit
    ├── KeyMismatch             422  same key, different request
    ├── RequestInProgress       409  same key still running elsewhere (Retry-After; no-store)
    ├── ResponseNotKept         410  stored for a streamed response too large to keep
    ├── PrincipalMissing        401  the request names no caller, and keys are per caller
    ├── GuardMisconfigured      500  the startup checks refuse the app as wired: names the fix
    │   ├── PrincipalMisconfigured   the guard cannot tell callers apart as wired
    │   └── MiddlewareMisplaced      middleware inside the guard that must run before it
    ├── AppNotStarted           503  the app's startup has not completed, or failed (no-store)
    └── StoreUnavailable        503  the store failed, the handler never ran (Retry-After; no-store)

    StoreError                  infrastructure: a store could not answer (unreachable,
    │                           timed out, read-only, a driver error); the function did not run
    └── SchemaMissing           the table or its migration is missing: names the fix

    OnceError                   the function guard's answers (asgi_idempotency.Once)
    ├── InProgress              same key still running elsewhere (retry_after, seconds)
    ├── KeyReused               same key, other arguments or another function
    ├── MissingMessageId        a broker message with no id to key it by (integrations)
    ├── AttemptsUnknown         a redelivery whose broker does not count deliveries
    └── Undecodable             a message whose payload cannot be decoded: never retried

Three roots, for three audiences: ``IdempotencyError`` s are HTTP answers, sent as
problems; a :class:`StoreError` is the infrastructure failing, raised to whoever called
the store (only the responder turns it into :class:`StoreUnavailable`); an
:class:`OnceError` is raised to a caller in the same process, never rendered as HTTP.
Each error renders its own problem document (``body()``, ``headers()``); sending it is
HTTP's (:func:`asgi_idempotency.http.problems.send_problem`), so nothing here imports
ASGI. ``detail`` is what any client may read; ``str(exc)`` is for the server's log (for a
store error, the driver's reason, which may name the host, database and user).
"""

from __future__ import annotations

import math
import re

import orjson

__all__ = [
    "AppNotStarted",
    "AttemptsUnknown",
    "BodyTooLarge",
    "GuardMisconfigured",
    "IdempotencyError",
    "InProgress",
    "InvalidHost",
    "InvalidKey",
    "InvalidSignature",
    "KeyMismatch",
    "KeyReused",
    "MiddlewareMisplaced",
    "MissingKey",
    "MissingMessageId",
    "OnceError",
    "PrincipalMisconfigured",
    "PrincipalMissing",
    "RequestInProgress",
    "ResponseNotKept",
    "SchemaMissing",
    "StoreError",
    "StoreUnavailable",
    "Undecodable",
]

# Stable, dereference-free identifiers (RFC 9457 §3.1.1 allows non-resolvable URIs).
_TYPE_PREFIX = "urn:asgi-idempotency:problem:"


class IdempotencyError(Exception):
    """Base of every error the middleware answers for itself."""

    status: int = 500
    slug: str = "error"
    title: str = "Idempotency error"
    # Answers about this moment only (a request still running, a store that is down): a
    # cache that kept one would go on answering it after the cause had passed.
    no_store: bool = False

    def __init__(
        self, detail: str, *, retry_after: float | None = None, message: str | None = None
    ) -> None:
        """``detail`` goes to the client; ``message`` (default: ``detail``) is ``str(exc)``."""
        super().__init__(detail if message is None else message)
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
        if self.no_store:
            headers.append((b"cache-control", b"no-store"))
        return headers


class MissingKey(IdempotencyError):
    status = 400
    slug = "missing-key"
    title = "Idempotency-Key header required"


class InvalidKey(IdempotencyError):
    status = 400
    slug = "invalid-key"
    title = "Invalid Idempotency-Key header"


class InvalidHost(IdempotencyError):
    """A request that names its host twice: two ``Host`` headers (RFC 9112 §3.2 makes
    that a 400), or a host-naming proxy header sent twice. Servers pass both on, the
    app reads one and the guard cannot know which: never claimed."""

    status = 400
    slug = "invalid-host"
    title = "Ambiguous request host"


class InvalidSignature(IdempotencyError):
    """A webhook delivery whose sender's signature is missing or wrong: never claimed."""

    status = 400
    slug = "invalid-signature"
    title = "Invalid webhook signature"


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
    no_store = True


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


class GuardMisconfigured(IdempotencyError):
    """The startup checks refuse the app as wired; the detail names each problem and its fix.

    Raised (as ``ValueError``, failing lifespan startup) where the guard can see it,
    else answered 500 on every guarded request of an app served without lifespan:
    guarding by a guess could run an effect twice or replay one caller's response to
    another. Its subclasses name the kind when every problem is of one kind.
    """

    status = 500
    slug = "guard-misconfigured"
    title = "The idempotency guard cannot run safely as the app is wired"


class PrincipalMisconfigured(GuardMisconfigured):
    """The guard cannot tell callers apart as the app is wired; the detail names the fix.

    A configuration error, raised at startup where the guard can see it, else answered
    500 (and logged) on the request that shows it: scoping a caller's key by a guess
    could hand one caller another's stored response.
    """

    slug = "principal-unknown"
    title = "The idempotency guard cannot identify the caller"


class MiddlewareMisplaced(GuardMisconfigured):
    """Middleware that must run before the guard (authentication, session, CORS, GZip,
    TrustedHost) is inside it; the detail names it and where to add it."""

    slug = "middleware-order"
    title = "Middleware is in the wrong order around the idempotency guard"


class AppNotStarted(IdempotencyError):
    """A guarded request reached an app whose lifespan startup began but did not complete
    (still running, or failed): the handler never runs before the guard's checks and the
    store's have passed. The reason is in the server's log, never in the detail."""

    status = 503
    slug = "not-started"
    title = "The app has not finished starting"
    no_store = True


class StoreUnavailable(IdempotencyError):
    status = 503
    slug = "store-unavailable"
    title = "Idempotency store unavailable"
    no_store = True


# What a client learns of any store failure: the reason (a host, a database, a role,
# the driver's words) is the operator's, and goes to the log with the key digest.
UNAVAILABLE_DETAIL = (
    "The idempotency store is unavailable and the request was not processed; "
    "retry with the same Idempotency-Key."
)


class StoreError(Exception):
    """A store could not answer: unreachable, timed out, read-only, or a driver error.

    An infrastructure failure, not an HTTP answer: ``str(exc)`` names the driver's
    exception class and its message (credentials removed), never a key or a body: it
    is for the log. ``detail``, what a client may see, is a fixed sentence. The
    middleware answers such a failure with its own 503 (:class:`StoreUnavailable`),
    or runs the handler unguarded with ``fail_open``.
    """

    def __init__(self, message: str, *, detail: str = UNAVAILABLE_DETAIL) -> None:
        super().__init__(message)
        self.detail = detail

    @classmethod
    def wrap(cls, exc: BaseException) -> StoreError:
        """The one spelling of a translated driver error: ``"ClassName: message"``, with
        any password in the message masked (a driver's message may quote its DSN)."""
        return cls(f"{type(exc).__name__}: {_scrub(str(exc))}")


# userinfo in a URL (scheme://user:secret@host), and key=value forms of a DSN or option.
_URL_PASSWORD = re.compile(r"(?P<keep>\b[a-z][a-z0-9+.-]*://[^:/?#@\s]*:)[^@\s]*@", re.IGNORECASE)
_KEY_PASSWORD = re.compile(
    r"(?P<keep>\b(?:password|passwd|pwd|passfile)\s*[=:]\s*)(?:'[^']*'|\"[^\"]*\"|[^\s,;&)]+)",
    re.IGNORECASE,
)


def _scrub(message: str) -> str:
    """``message`` with any password in it replaced by ``***``."""
    message = _URL_PASSWORD.sub(r"\g<keep>***@", message)
    return _KEY_PASSWORD.sub(r"\g<keep>***", message)


class SchemaMissing(StoreError):
    """The store's database lacks the records table, or the migration head is not applied.

    On Postgres the schema is the operator's: the message names the table, the
    database's URL (password masked) and the command that fixes it (``asgi-idempotency
    migrate --database-url ...``); ``detail`` says the same without the URL. Raised by
    ``SQLStore.prepare()``; the middleware fails lifespan startup with the ``detail``
    (and logs the message), or answers 503 with the ``detail`` when the app runs
    without a lifespan.
    """


class OnceError(Exception):
    """Base of the function guard's answers (:class:`~asgi_idempotency.Once`).

    Messages name the key's digest (the first 16 hex digits of its record key) and the
    namespace, never the raw key or the arguments: they are for logs.
    """


class InProgress(OnceError):
    """Another call holds the key and is running (its lease is live).

    ``retry_after``: seconds to wait before calling again, never past the holder's lease.
    """

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class KeyReused(OnceError):
    """The key was used with other arguments, or by another function: a new call
    needs a new key. The stored result is never returned for a different call."""


class MissingMessageId(OnceError):
    """A broker message carries no id to key it by (its publisher set none).

    Keying it by what the broker assigns per delivery (a delivery tag) would run it
    again on every redelivery, so the broker presets refuse it rather than guess.
    """


class AttemptsUnknown(OnceError):
    """A redelivered message whose broker does not count deliveries (a classic RabbitMQ
    queue): handed off rather than retried without a bound."""


class Undecodable(OnceError):
    """A broker message whose payload cannot be decoded (not the format it should be, a
    field missing): it would fail the same way on every delivery, so the broker presets
    hand it to ``on_exhausted`` at once, without retries, and acknowledge it.

    Raise it from a handler, from the decoding error (``raise Undecodable("not a
    refund") from exc``); the Celery preset raises it itself for task arguments that
    have no canonical JSON form (NaN, say), which it cannot fingerprint.
    """

"""Sending the guard's own answers: an :class:`~asgi_idempotency.IdempotencyError` as
an RFC 9457 problem response.

Each error carries its status, its problem document (``body()``) and its headers
(``headers()``); sending them over ASGI is HTTP's, so it lives here and the core's
error tree imports nothing of ASGI.
"""

from __future__ import annotations

from asgi_idempotency.core.errors import IdempotencyError
from asgi_idempotency.http.asgi import Send, send_response

__all__ = ["send_problem"]


async def send_problem(send: Send, problem: IdempotencyError) -> None:
    """Answer the request with ``problem``: its status, headers and problem+json body."""
    await send_response(send, problem.status, problem.headers(), problem.body())


# What the middleware answers in its own words (the problems' ``detail``), and the
# TypeError of a middleware built without principal=.
MISSING_KEY_DETAIL = (
    "This endpoint requires an Idempotency-Key header; generate one key "
    "per logical operation and send the same key on every retry."
)
PRINCIPAL_REQUIRED = (
    "IdempotencyMiddleware needs principal=, who the caller is (records are kept per "
    "caller, so one caller never receives another's stored response): "
    "from_dependency(get_current_user) for a FastAPI auth dependency, from_user() for "
    "Starlette's AuthenticationMiddleware, from_session('<field>') for SessionMiddleware, "
    "from_headers('<header>', ...) for headers a gateway has verified, or ANONYMOUS for "
    "a public or single-caller service (all from asgi_idempotency.http.principals)."
)
NO_CALLER_DETAIL = (
    "This endpoint keeps each Idempotency-Key per caller, and this request names no "
    "caller: authenticate and retry with the same key."
)
NOT_STARTED_DETAIL = (
    "The app's startup has not completed, so this request was not processed; retry "
    "with the same Idempotency-Key once the app is up."
)
STARTUP_FAILED_DETAIL = (
    "The app's startup failed, so this request was not processed; the reason is in the "
    "server's log."
)
MISMATCH_DETAIL = (
    "This Idempotency-Key was already used with a different request "
    "(method, path, query or body). Use a new key for a new operation."
)
IN_PROGRESS_DETAIL = (
    "A request with this Idempotency-Key is still being processed; "
    "retry after the Retry-After interval to get its response."
)
NOT_KEPT_DETAIL = (
    "The request with this Idempotency-Key was processed once; its response was "
    "streamed and too large to keep, so it cannot be replayed."
)

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

"""httpx transports that retry a request under one Idempotency-Key.

``IdempotentTransport`` (sync) and ``AsyncIdempotentTransport`` wrap another
transport. Per request they fix the key first, once, outside the retry loop, then
let stamina drive the attempts, each classified by :func:`retryable`. Every attempt
therefore carries the same ``Idempotency-Key`` header: a timeout followed by a
retry reaches the server as the same logical request, and an idempotency-aware
server answers it with 409 while the first is in flight and with the stored
response once it is done.

Sitting below the client matters: httpx has already put the client's timeouts in
``request.extensions["timeout"]``, so a read timeout is raised inside
``handle_request`` and can be retried here.
"""

from __future__ import annotations

import uuid
from typing import NoReturn, Protocol

from asgi_idempotency._extras import missing_extra

try:
    import httpx
    import stamina
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise missing_extra(__name__, "httpx and stamina", "client") from exc

from asgi_idempotency.client.retry import (
    _IDEMPOTENT_METHODS,
    IDEMPOTENCY_KEY_HEADER,
    RetriesExhausted,
    RetryPolicy,
    _AttemptLog,
    retryable,
)

__all__ = [
    "AsyncIdempotentTransport",
    "IDEMPOTENCY_KEY_HEADER",
    "IdempotentTransport",
    "KeyFunction",
    "random_key",
]


class KeyFunction(Protocol):
    """Mints the key of a request that arrived without one; ``None`` means "no key"."""

    def __call__(self, request: httpx.Request, /) -> str | None: ...


def random_key(request: httpx.Request, /) -> str | None:
    """A fresh UUID4 for POST and PATCH, ``None`` for other methods.

    Use it only towards servers that honour ``Idempotency-Key``: with a key the
    transport retries ambiguous failures, which duplicates effects on a server
    that ignores the header. For calls that must survive a process restart, derive
    the key with :func:`derive_key` and set the header yourself instead.
    """
    return str(uuid.uuid4()) if request.method in ("POST", "PATCH") else None


class _RetryableResponse(Exception):
    """Carries a response verdict through stamina, which only retries on exceptions."""


def _resolve_key(request: httpx.Request, key_for: KeyFunction | None) -> str | None:
    key: str | None = request.headers.get(IDEMPOTENCY_KEY_HEADER)
    if key is None and key_for is not None:
        key = key_for(request)
        if key is not None:
            request.headers[IDEMPOTENCY_KEY_HEADER] = key
    return key


class _Run:
    """One logical request: its key, fixed before the first attempt, and its attempt log."""

    __slots__ = ("key", "log", "repeatable", "request")

    def __init__(self, request: httpx.Request, key: str | None, policy: RetryPolicy) -> None:
        self.request = request
        self.key = key
        # Without a key only an idempotent method may be resent after an ambiguous failure.
        # Passed to retryable() explicitly: below the client, the inner transport's
        # exceptions and responses do not carry the request yet.
        self.repeatable = key is not None or request.method in _IDEMPOTENT_METHODS
        self.log = _AttemptLog(policy)

    def note_error(self, exc: Exception) -> None:
        self.log.note(retryable(exc, has_key=self.repeatable), failure=exc)

    def note_response(self, response: httpx.Response) -> Exception | None:
        """Record ``response``; return the exception that makes stamina retry, if any."""
        decision = retryable(response, has_key=self.repeatable)
        failure = _RetryableResponse(decision.reason) if decision.retry else None
        self.log.note(decision, status=response.status_code, failure=failure)
        return failure

    def give_up(self, exc: Exception) -> NoReturn:
        """Raise the final error once stamina lets ``exc`` through."""
        if self.log.wanted_retry(exc):
            records = tuple(self.log.records)
            raise RetriesExhausted(records, self.key, request=self.request) from exc
        if len(self.log.records) > 1:
            exc.add_note(f"after {len(self.log.records)} attempts: {self.log.summary()}")
        raise exc


class IdempotentTransport(httpx.BaseTransport):
    """Sync transport: same key on every attempt, retries per :func:`retryable`.

    Args:
        transport: The transport that sends each attempt. Default:
            ``httpx.HTTPTransport()``. Closed with this one.
        policy: Attempts, total budget and backoff. Default: ``RetryPolicy()``.
        key_for: Mints a key for a request without an ``Idempotency-Key`` header
            (e.g. :func:`random_key`). Default ``None``: such requests go without a
            key, and ambiguous failures of POST/PATCH are then not retried.

    Raises (from ``handle_request``, i.e. from ``client.post`` and friends):
        RetriesExhausted: the last outcome was still retryable when attempts or
            budget ran out; it lists every attempt.
        httpx.HTTPError: an outcome that is never retried, re-raised unchanged.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        policy: RetryPolicy | None = None,
        key_for: KeyFunction | None = None,
    ) -> None:
        self._transport = httpx.HTTPTransport() if transport is None else transport
        self._policy = RetryPolicy() if policy is None else policy
        self._key_for = key_for

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        # The key is fixed here, once, before the loop: every attempt must carry it.
        run = _Run(request, _resolve_key(request, self._key_for), self._policy)
        # Buffer the body once so every attempt can send it again.
        request.read()
        attempts = stamina.retry_context(run.log.hook, **self._policy.stamina_kwargs())
        try:
            for attempt in attempts:
                with attempt:
                    return self._attempt(run)
        except Exception as exc:
            run.give_up(exc)
        raise AssertionError("unreachable: stamina either returns or raises")

    def _attempt(self, run: _Run) -> httpx.Response:
        try:
            response = self._transport.handle_request(run.request)
        except Exception as exc:
            run.note_error(exc)
            raise
        retry = run.note_response(response)
        if retry is None:
            return response
        response.close()
        raise retry

    def close(self) -> None:
        self._transport.close()


class AsyncIdempotentTransport(httpx.AsyncBaseTransport):
    """Async twin of :class:`IdempotentTransport`; same arguments and errors.

    The default inner transport is ``httpx.AsyncHTTPTransport()``. Backoff sleeps
    run on the current event loop (asyncio or trio).
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        policy: RetryPolicy | None = None,
        key_for: KeyFunction | None = None,
    ) -> None:
        self._transport = httpx.AsyncHTTPTransport() if transport is None else transport
        self._policy = RetryPolicy() if policy is None else policy
        self._key_for = key_for

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        run = _Run(request, _resolve_key(request, self._key_for), self._policy)
        await request.aread()
        attempts = stamina.retry_context(run.log.hook, **self._policy.stamina_kwargs())
        try:
            async for attempt in attempts:
                with attempt:
                    return await self._attempt(run)
        except Exception as exc:
            run.give_up(exc)
        raise AssertionError("unreachable: stamina either returns or raises")

    async def _attempt(self, run: _Run) -> httpx.Response:
        try:
            response = await self._transport.handle_async_request(run.request)
        except Exception as exc:
            run.note_error(exc)
            raise
        retry = run.note_response(response)
        if retry is None:
            return response
        await response.aclose()
        raise retry

    async def aclose(self) -> None:
        await self._transport.aclose()

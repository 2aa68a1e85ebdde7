"""When may a failed call be sent again? A pure classification, plus the retry budget.

:func:`retryable` looks at one outcome (an exception or an :class:`httpx.Response`)
and answers with a :class:`Decision`: retried always when the server cannot have
acted (connect errors, 408, 425, 429), only under an ``Idempotency-Key`` when it may
have (timeouts and read errors, 409, 502, 503, 504), never otherwise. It never sleeps
and never sends; the loop that acts on it is stamina's (:mod:`.transport`). The full
table: docs/client.md.
"""

from __future__ import annotations

import email.utils
import re
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Final, TypedDict

from asgi_idempotency._extras import missing_extra

try:
    import httpx
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise missing_extra(__name__, "httpx", "client") from exc

__all__ = ["AttemptRecord", "Decision", "RetriesExhausted", "RetryPolicy", "retryable"]

IDEMPOTENCY_KEY_HEADER: Final = "Idempotency-Key"

# RFC 9110 9.2.2: repeating these has the effect of sending them once, so an
# ambiguous failure may be retried without a key.
_IDEMPOTENT_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do about one outcome.

    Attributes:
        retry: Send the same request (same key) again.
        reason: Why, in words fit for a log line or an exception message.
        delay: Seconds to wait before the retry, from the server's ``Retry-After``;
            ``None`` means "use the exponential backoff". Always ``None`` when
            ``retry`` is false.
    """

    retry: bool
    reason: str
    delay: float | None = None


class _StaminaKwargs(TypedDict):
    attempts: int
    timeout: float
    wait_initial: float
    wait_max: float
    wait_jitter: float
    wait_exp_base: float


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Backoff and budget for one logical request; the defaults are stamina's.

    The wait before retry ``n`` (1-based) is
    ``min(wait_max, wait_initial * wait_exp_base ** (n - 1) + uniform(0, wait_jitter))``
    seconds, unless the server sent ``Retry-After``, which then wins as long as it
    fits in the remaining budget.

    Attributes:
        attempts: Maximum number of attempts, the first one included. Default 10.
        timeout: Total budget in seconds, measured from the first attempt. It is
            checked between attempts, so an attempt in progress (bounded by the
            httpx timeouts) or one backoff (at most ``wait_max``) can overrun it.
            Default 45.0.
        wait_initial: Seconds of the first backoff before jitter. Default 0.1.
        wait_max: Ceiling in seconds for any exponential backoff. Default 5.0.
        wait_jitter: Maximum random seconds added to each backoff. Default 1.0.
        wait_exp_base: Growth factor between backoffs. Default 2.0.
    """

    attempts: int = 10
    timeout: float = 45.0
    wait_initial: float = 0.1
    wait_max: float = 5.0
    wait_jitter: float = 1.0
    wait_exp_base: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")

    def stamina_kwargs(self) -> _StaminaKwargs:
        """Keyword arguments for ``stamina.retry_context`` (or ``stamina.retry``)."""
        return {
            "attempts": self.attempts,
            "timeout": self.timeout,
            "wait_initial": self.wait_initial,
            "wait_max": self.wait_max,
            "wait_jitter": self.wait_jitter,
            "wait_exp_base": self.wait_exp_base,
        }


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """How one attempt ended.

    Attributes:
        number: 1-based attempt number.
        reason: The :class:`Decision` reason for this outcome.
        status_code: The response status, or ``None`` when the attempt raised.
        error: ``repr`` of the exception, or ``None`` when a response arrived.
        elapsed: Seconds from the start of the first attempt to the end of this one.
    """

    number: int
    reason: str
    status_code: int | None
    error: str | None
    elapsed: float


class RetriesExhausted(httpx.TransportError):
    """The transport still wanted to retry but ran out of attempts or time budget.

    A subclass of :class:`httpx.TransportError`, so existing ``except
    httpx.HTTPError`` handlers keep working. Outcomes that are never retried (a 400,
    a read timeout without a key) are not wrapped: the response is returned, the
    exception re-raised as is.

    Attributes:
        attempts: One :class:`AttemptRecord` per attempt that ran, in order.
        key: The ``Idempotency-Key`` every attempt carried, or ``None``.
    """

    def __init__(
        self,
        attempts: tuple[AttemptRecord, ...],
        key: str | None,
        *,
        request: httpx.Request | None = None,
    ) -> None:
        self.attempts = attempts
        self.key = key
        elapsed = attempts[-1].elapsed if attempts else 0.0
        lines = "; ".join(f"#{a.number} {a.reason}" for a in attempts)
        super().__init__(
            f"gave up after {len(attempts)} attempt(s) in {elapsed:.2f}s: {lines}",
            request=request,
        )


class _AttemptLog:
    """Bookkeeping for one logical call across its attempts; the stamina hook lives here.

    Used by the transports and the ledger. ``note`` records how an attempt ended and
    which exception will carry that outcome out of the attempt block; ``hook`` then
    hands stamina the recorded decision.
    """

    __slots__ = ("_decision", "_failure", "policy", "records", "started")

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.started = time.monotonic()
        self.records: list[AttemptRecord] = []
        self._decision = Decision(False, "not attempted")
        self._failure: BaseException | None = None

    def note(
        self,
        decision: Decision,
        *,
        status: int | None = None,
        failure: BaseException | None = None,
    ) -> None:
        self._decision = decision
        self._failure = failure
        error = None if failure is None or status is not None else repr(failure)
        elapsed = time.monotonic() - self.started
        self.records.append(
            AttemptRecord(len(self.records) + 1, decision.reason, status, error, elapsed)
        )

    def hook(self, exc: Exception) -> bool | float:
        """stamina backoff hook: ``False`` stops, ``True`` backs off, a float waits that long."""
        # Only an outcome noted for this attempt may be retried; anything else raised
        # inside the attempt block is a bug and must surface.
        if exc is not self._failure or not self._decision.retry:
            return False
        delay = self._decision.delay
        if delay is None:
            return True
        if delay > self.policy.timeout - (time.monotonic() - self.started):
            # Sleeping past the budget only to give up is worse than giving up now.
            last = self.records[-1]
            reason = f"{last.reason}; Retry-After {delay:g}s exceeds the remaining budget"
            self.records[-1] = replace(last, reason=reason)
            return False
        return delay

    def wanted_retry(self, exc: BaseException) -> bool:
        """``exc`` carries a retryable outcome that stamina stopped retrying."""
        return exc is self._failure and self._decision.retry

    def summary(self) -> str:
        return "; ".join(f"#{r.number} {r.reason}" for r in self.records)


# Nothing reached the server: the connection never opened, or no pooled connection
# became free. Safe to resend even without a key.
_NOT_SENT: Final = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Bytes were (or may have been) sent and no complete response came back: the server
# may have acted. TimeoutError covers callers wrapping a call in anyio.fail_after.
_AMBIGUOUS: Final = (
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    TimeoutError,
)
# The server says it did not process the request (RFC 9110 15.5.9, RFC 8470 5.2,
# RFC 6585 4).
_NOT_PROCESSED: Final = {408: "408 request timeout", 425: "425 too early", 429: "429 rate limited"}
_GATEWAY: Final = {502: "502 bad gateway", 503: "503 unavailable", 504: "504 gateway timeout"}
_DELTA_SECONDS: Final = re.compile(r"[0-9]+")


def retryable(
    outcome: BaseException | httpx.Response,
    *,
    has_key: bool | None = None,
    now: datetime | None = None,
) -> Decision:
    """Classify one outcome of sending a request.

    Args:
        outcome: The exception an attempt raised, or the response it returned. An
            :class:`httpx.HTTPStatusError` is judged by its response.
        has_key: Whether the request repeats safely. Without that, outcomes after
            which the server may have acted are not retried. Default ``None``: read
            it from the request httpx attached to the outcome
            (:attr:`httpx.RequestError.request` or :attr:`httpx.Response.request`),
            which repeats safely when it carries an ``Idempotency-Key`` header or
            its method is idempotent (GET, HEAD, OPTIONS, TRACE, PUT, DELETE). An
            outcome without an attached request (a builtin :class:`TimeoutError`,
            an exception or response built by hand or by a transport before the
            client attaches the request) counts as having no key. Pass ``True``
            or ``False`` to decide it yourself; an explicit value wins over the
            attached request.
        now: Timezone-aware "now" for an HTTP-date ``Retry-After``. Default: the
            current UTC time.

    Returns:
        A :class:`Decision`; ``delay`` is set only from a valid ``Retry-After``.
    """
    if isinstance(outcome, httpx.HTTPStatusError):
        outcome = outcome.response
    if has_key is None:
        request = _attached_request(outcome)
        has_key = request is not None and _repeats_safely(request)
    if isinstance(outcome, httpx.Response):
        return _classify_response(outcome, has_key=has_key, now=now)
    if isinstance(outcome, _NOT_SENT):
        return Decision(True, f"{type(outcome).__name__}: nothing was sent")
    if isinstance(outcome, _AMBIGUOUS):
        return _ambiguous(f"{type(outcome).__name__}: the server may have acted", has_key)
    return Decision(False, f"{type(outcome).__name__}: not a transient failure")


def _attached_request(outcome: BaseException | httpx.Response) -> httpx.Request | None:
    """The request httpx attached to ``outcome``, or ``None``."""
    if not isinstance(outcome, httpx.Response | httpx.RequestError):
        return None
    try:
        return outcome.request
    except RuntimeError:
        # httpx raises rather than return None when the request was never set: the
        # client attaches it only after the transport returns or raises.
        return None


def _repeats_safely(request: httpx.Request) -> bool:
    return IDEMPOTENCY_KEY_HEADER in request.headers or request.method in _IDEMPOTENT_METHODS


def _ambiguous(what: str, has_key: bool, delay: float | None = None) -> Decision:
    if has_key:
        return Decision(True, f"{what}; retrying under the same key", delay)
    return Decision(False, f"{what}; not retried without an idempotency key")


def _classify_response(
    response: httpx.Response, *, has_key: bool, now: datetime | None
) -> Decision:
    status = response.status_code
    if status < 400:
        return Decision(False, f"{status}: final response")
    if status in _NOT_PROCESSED:
        return Decision(
            True, f"{_NOT_PROCESSED[status]}: not processed", _retry_after(response, now)
        )
    if status in _GATEWAY:
        return _ambiguous(_GATEWAY[status], has_key, _retry_after(response, now))
    if status == 409 and has_key:
        # draft-ietf-httpapi-idempotency-key-header, section 2.7: a request with the
        # same key is still being processed. Poll with the exponential backoff: servers
        # differ in what Retry-After means here (some send the whole remaining lease,
        # an upper bound), while most handlers finish far sooner.
        # Without a key a 409 is the application's own conflict: final.
        return Decision(True, "409: the same key is still in flight; polling")
    if status < 500:
        return Decision(False, f"{status}: the server refused the request")
    # A 500 is most often a bug that a retry only repeats, and 501/505 are permanent.
    return Decision(False, f"{status}: server error, not known to be transient")


def _retry_after(response: httpx.Response, now: datetime | None) -> float | None:
    """Seconds from ``Retry-After`` (RFC 9110 10.2.3), or ``None`` if absent or invalid."""
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return None
    if _DELTA_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        # RFC 9110 dates are always GMT; parsedate_to_datetime leaves "-0000" naive.
        when = when.replace(tzinfo=UTC)
    current = datetime.now(UTC) if now is None else now
    return max(0.0, (when - current).total_seconds())

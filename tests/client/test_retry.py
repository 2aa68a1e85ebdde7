"""retryable(): the classification table, Retry-After, and the policy's validation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from asgi_idempotency.client import Decision, RetryPolicy, retryable

NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
REQUEST = httpx.Request("POST", "http://127.0.0.1/refunds")


def _response(status: int, **headers: str) -> httpx.Response:
    return httpx.Response(status, headers=headers, request=REQUEST)


NOT_SENT = [
    httpx.ConnectError("refused", request=REQUEST),
    httpx.ConnectTimeout("slow handshake", request=REQUEST),
    httpx.PoolTimeout("no free connection", request=REQUEST),
]
AMBIGUOUS_ERRORS = [
    httpx.ReadTimeout("slow", request=REQUEST),
    httpx.WriteTimeout("slow", request=REQUEST),
    httpx.ReadError("reset", request=REQUEST),
    httpx.WriteError("broken pipe", request=REQUEST),
    httpx.RemoteProtocolError("Server disconnected", request=REQUEST),
    TimeoutError(),
]
NEVER_ERRORS = [
    httpx.LocalProtocolError("bad header", request=REQUEST),
    httpx.UnsupportedProtocol("ftp", request=REQUEST),
    httpx.DecodingError("gzip", request=REQUEST),
    ValueError("a bug"),
    KeyboardInterrupt(),
]


@pytest.mark.parametrize("has_key", [True, False])
@pytest.mark.parametrize("exc", NOT_SENT, ids=lambda e: type(e).__name__)
def test_nothing_sent_is_retried_even_without_a_key(exc: Exception, has_key: bool) -> None:
    decision = retryable(exc, has_key=has_key)
    assert decision.retry
    assert decision.delay is None
    assert "nothing was sent" in decision.reason


@pytest.mark.parametrize("exc", AMBIGUOUS_ERRORS, ids=lambda e: type(e).__name__)
def test_ambiguous_errors_are_retried_only_with_a_key(exc: Exception) -> None:
    assert retryable(exc, has_key=True).retry
    without = retryable(exc, has_key=False)
    assert not without.retry
    assert "not retried without an idempotency key" in without.reason


@pytest.mark.parametrize("exc", NEVER_ERRORS, ids=lambda e: type(e).__name__)
def test_other_errors_are_never_retried(exc: BaseException) -> None:
    assert not retryable(exc, has_key=True).retry


@pytest.mark.parametrize("status", [502, 503, 504])
def test_gateway_errors_are_ambiguous(status: int) -> None:
    assert retryable(_response(status), has_key=True).retry
    assert not retryable(_response(status), has_key=False).retry


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 410, 413, 415, 422])
def test_client_errors_are_never_retried(status: int) -> None:
    assert not retryable(_response(status), has_key=True).retry


@pytest.mark.parametrize("status", [500, 501, 505, 599])
def test_other_server_errors_are_never_retried(status: int) -> None:
    assert not retryable(_response(status), has_key=True).retry


@pytest.mark.parametrize("status", [200, 201, 204, 301, 304])
def test_success_and_redirects_are_final(status: int) -> None:
    decision = retryable(_response(status), has_key=True)
    assert decision == Decision(False, f"{status}: final response")


def test_409_polls_with_a_key_and_is_final_without() -> None:
    # Some servers put the whole remaining lease in a 409's Retry-After; polling ignores it.
    in_flight = _response(409, **{"Retry-After": "30"})
    assert retryable(in_flight, has_key=True) == Decision(
        True, "409: the same key is still in flight; polling", None
    )
    assert not retryable(in_flight, has_key=False).retry


@pytest.mark.parametrize("status", [408, 425, 429])
def test_not_processed_is_retried_without_a_key(status: int) -> None:
    assert retryable(_response(status), has_key=False).retry


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_seconds(status: int) -> None:
    decision = retryable(_response(status, **{"Retry-After": "7"}), has_key=True)
    assert decision.retry
    assert decision.delay == 7.0


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_http_date(status: int) -> None:
    later = format_datetime(NOW + timedelta(seconds=90), usegmt=True)
    decision = retryable(_response(status, **{"Retry-After": later}), has_key=True, now=NOW)
    assert decision.delay == 90.0


def test_retry_after_in_the_past_means_now() -> None:
    earlier = format_datetime(NOW - timedelta(minutes=5), usegmt=True)
    decision = retryable(_response(429, **{"Retry-After": earlier}), has_key=False, now=NOW)
    assert decision.delay == 0.0


def test_retry_after_date_without_zone_is_gmt() -> None:
    decision = retryable(
        _response(429, **{"Retry-After": "Wed, 01 May 2024 12:00:30 -0000"}), has_key=False, now=NOW
    )
    assert decision.delay == 30.0


@pytest.mark.parametrize("value", ["", "soon", "-5", "1.5", "Wed, 99 Foo 2024"])
def test_invalid_retry_after_falls_back_to_backoff(value: str) -> None:
    decision = retryable(_response(503, **{"Retry-After": value}), has_key=True)
    assert decision.retry
    assert decision.delay is None


def test_http_status_error_is_judged_by_its_response() -> None:
    error = httpx.HTTPStatusError("", request=REQUEST, response=_response(429))
    assert retryable(error, has_key=False).retry
    error = httpx.HTTPStatusError("", request=REQUEST, response=_response(422))
    assert not retryable(error, has_key=True).retry


KEYED = httpx.Request("POST", "http://127.0.0.1/refunds", headers={"Idempotency-Key": "k1"})


def test_an_exception_with_a_keyed_request_is_retried_without_has_key() -> None:
    decision = retryable(httpx.ReadTimeout("slow", request=KEYED))
    assert decision == Decision(
        True, "ReadTimeout: the server may have acted; retrying under the same key"
    )


def test_an_exception_with_an_unkeyed_post_is_not_retried() -> None:
    decision = retryable(httpx.ReadTimeout("slow", request=REQUEST))
    assert not decision.retry
    assert "not retried without an idempotency key" in decision.reason


def test_a_response_with_a_keyed_request_is_retried_without_has_key() -> None:
    assert retryable(httpx.Response(503, request=KEYED)).retry
    assert retryable(httpx.Response(409, request=KEYED)).retry
    assert not retryable(_response(503)).retry  # REQUEST: a POST without a key


def test_the_key_header_is_matched_case_insensitively() -> None:
    lower = httpx.Request("POST", "http://127.0.0.1/refunds", headers={"idempotency-key": "k1"})
    assert retryable(httpx.ReadError("reset", request=lower)).retry


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"])
def test_an_idempotent_method_repeats_safely_without_a_key(method: str) -> None:
    request = httpx.Request(method, "http://127.0.0.1/refunds/1")
    assert retryable(httpx.ReadTimeout("slow", request=request)).retry
    assert retryable(httpx.Response(504, request=request)).retry


@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_non_idempotent_method_without_a_key_does_not(method: str) -> None:
    request = httpx.Request(method, "http://127.0.0.1/refunds/1")
    assert not retryable(httpx.ReadTimeout("slow", request=request)).retry
    assert not retryable(httpx.Response(504, request=request)).retry


def test_an_explicit_has_key_beats_the_attached_request() -> None:
    assert not retryable(httpx.ReadTimeout("slow", request=KEYED), has_key=False).retry
    assert not retryable(httpx.Response(503, request=KEYED), has_key=False).retry
    assert retryable(httpx.ReadTimeout("slow", request=REQUEST), has_key=True).retry
    assert retryable(httpx.Response(503, request=REQUEST), has_key=True).retry


def test_an_http_status_error_reads_the_request_of_its_response() -> None:
    error = httpx.HTTPStatusError("", request=KEYED, response=httpx.Response(502, request=KEYED))
    assert retryable(error).retry


@pytest.mark.parametrize(
    "outcome",
    [TimeoutError(), httpx.ReadTimeout("slow"), httpx.Response(503)],
    ids=["builtin TimeoutError", "ReadTimeout without request", "503 without request"],
)
def test_without_an_attached_request_there_is_no_key(
    outcome: BaseException | httpx.Response,
) -> None:
    # Conservative: nothing says the request repeats safely, so it is not resent.
    decision = retryable(outcome)
    assert not decision.retry
    assert "not retried without an idempotency key" in decision.reason
    assert retryable(outcome, has_key=True).retry


def test_without_a_request_outcomes_that_need_no_key_are_still_retried() -> None:
    assert retryable(httpx.ConnectError("refused")).retry
    assert retryable(httpx.Response(429)).retry


def test_decision_is_frozen() -> None:
    decision = Decision(True, "x")
    with pytest.raises(AttributeError):
        decision.retry = False  # type: ignore[misc]  # frozen: what the test checks


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"timeout": 0}, {"timeout": -1.0}])
def test_policy_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]  # floats where attempts takes an int


def test_policy_defaults_are_staminas() -> None:
    assert RetryPolicy().stamina_kwargs() == {
        "attempts": 10,
        "timeout": 45.0,
        "wait_initial": 0.1,
        "wait_max": 5.0,
        "wait_jitter": 1.0,
        "wait_exp_base": 2.0,
    }

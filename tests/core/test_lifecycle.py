"""The record rules: judge() gives the answer state() implies, for every kind of row."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest

from asgi_idempotency.core.lifecycle import (
    ClaimOutcome,
    RecordState,
    completion_backoff,
    completion_retries,
    judge,
    state_of,
)
from asgi_idempotency.stores.base import Record, RecordStatus, utcnow

NOW = utcnow()
SECOND = timedelta(seconds=1)

# What each state means for a new request with the same fingerprint.
SAME_REQUEST = {
    RecordState.EXPIRED: ClaimOutcome.CLAIMED,
    RecordState.COMPLETED: ClaimOutcome.COMPLETED,
    RecordState.ABANDONED: ClaimOutcome.TAKEN_OVER,
    RecordState.RUNNING: ClaimOutcome.IN_PROGRESS,
}


def expected(record: Record, request_hash: str) -> ClaimOutcome:
    current = state_of(record, NOW)
    if current is not RecordState.EXPIRED and record.request_hash != request_hash:
        return ClaimOutcome.MISMATCH
    return SAME_REQUEST[current]


@pytest.mark.parametrize(
    ("status", "expires_in", "locked_for", "request_hash"),
    list(
        itertools.product(
            RecordStatus,
            [-SECOND, timedelta(0), SECOND],
            [-SECOND, timedelta(0), SECOND],
            ["h", "x"],
        )
    ),
)
def test_judge_answers_as_the_state_of_the_row_says(
    status: RecordStatus, expires_in: timedelta, locked_for: timedelta, request_hash: str
) -> None:
    # Deadlines exactly at now count as passed, as state_of() reads them.
    record = Record("k", "h", status, "t", NOW - SECOND, NOW + locked_for, NOW + expires_in)
    assert judge(record, request_hash, NOW) is expected(record, request_hash)


def test_no_row_is_a_claim() -> None:
    assert judge(None, "h", NOW) is ClaimOutcome.CLAIMED


def test_a_live_claim_past_its_ttl_is_running_not_expired() -> None:
    # Renewed past expires_at (a handler outliving its ttl): its owner is still at work.
    record = Record("k", "h", RecordStatus.IN_PROGRESS, "t", NOW - 3 * SECOND, NOW + SECOND,
                    NOW - SECOND)  # fmt: skip
    assert state_of(record, NOW) is RecordState.RUNNING
    assert judge(record, "h", NOW) is ClaimOutcome.IN_PROGRESS
    assert judge(record, "x", NOW) is ClaimOutcome.MISMATCH
    # Once its lease is over too, it is expired: the key is new again.
    assert state_of(record, NOW + SECOND) is RecordState.EXPIRED
    assert judge(record, "x", NOW + SECOND) is ClaimOutcome.CLAIMED


def test_an_orphaned_claims_release_is_tried_a_few_times_within_one_lease() -> None:
    assert completion_retries(timedelta(seconds=30)) == [0.1, 0.2, 0.4, 0.8, 1.6]
    assert completion_retries(timedelta(seconds=1)) == [0.1, 0.2, 0.4]  # 0.8 more is past it
    assert completion_retries(timedelta(milliseconds=100)) == []


def test_a_failed_completion_is_retried_for_the_leases_life() -> None:
    delays = completion_backoff(timedelta(seconds=30))
    assert delays[:6] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0]  # doubling, then two seconds apart
    assert set(delays[5:]) == {2.0}
    assert 28.0 <= sum(delays) < 30.0  # the last attempt within two seconds of the lease's end
    assert completion_backoff(timedelta(seconds=1)) == [0.1, 0.2, 0.4]  # 0.8 more is past it
    assert completion_backoff(timedelta(milliseconds=100)) == []

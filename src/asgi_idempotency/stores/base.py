"""The store protocol: a few atomic primitives under the middleware's state machine."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

__all__ = [
    "Claim",
    "ClaimOutcome",
    "Record",
    "RecordStatus",
    "Store",
    "StoreError",
    "StoredResponse",
]


# The default clock: the current aware UTC time, with no Python frame of its own.
utcnow = functools.partial(datetime.now, UTC)


class StoreError(Exception):
    """The store could not answer: unreachable, timed out, or a driver error."""


class RecordStatus(enum.StrEnum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


# A row's status column to its member: a dict lookup, where RecordStatus(value) is a call.
STATUS_OF = {status.value: status for status in RecordStatus}


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A captured response: replayed byte for byte."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Record:
    """One row of ``idempotency_records``."""

    key: str
    request_hash: str
    status: RecordStatus
    token: str
    created_at: datetime
    locked_until: datetime
    expires_at: datetime
    response: StoredResponse | None = None


class ClaimOutcome(enum.Enum):
    CLAIMED = "claimed"  # the caller owns the key: run the handler
    TAKEN_OVER = "taken_over"  # claimed an abandoned in-progress row (lease ran out)
    COMPLETED = "completed"  # a stored response exists for this request
    IN_PROGRESS = "in_progress"  # another owner holds a live lease
    MISMATCH = "mismatch"  # the key belongs to a different request


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: ClaimOutcome
    record: Record | None = None  # the existing row, for every outcome but CLAIMED/TAKEN_OVER

    @property
    def owned(self) -> bool:
        return self.outcome in (ClaimOutcome.CLAIMED, ClaimOutcome.TAKEN_OVER)


# The two answers that carry no row, shared: claims are frozen, and the hot path is hot.
CLAIMED = Claim(ClaimOutcome.CLAIMED)
TAKEN_OVER = Claim(ClaimOutcome.TAKEN_OVER)


def decide(existing: Record, request_hash: str, now: datetime) -> ClaimOutcome:
    """What an existing, unexpired row means for a new request with ``request_hash``.

    One function so that every store answers the same; the SQL store re-checks the
    takeover case inside a conditional update.
    """
    if existing.request_hash != request_hash:
        return ClaimOutcome.MISMATCH
    if existing.status is RecordStatus.COMPLETED:
        return ClaimOutcome.COMPLETED
    if existing.locked_until <= now:
        return ClaimOutcome.TAKEN_OVER
    return ClaimOutcome.IN_PROGRESS


@runtime_checkable
class Store(Protocol):
    """Atomic primitives. Every method raises :class:`StoreError` on store failure.

    Times come from the caller's clock so that leases and retention are testable;
    hosts sharing a store need synchronised clocks (NTP), as for any lease.
    """

    async def claim(
        self,
        key: str,
        request_hash: str,
        token: str,
        *,
        now: datetime,
        locked_until: datetime,
        expires_at: datetime,
    ) -> Claim:
        """Insert an in-progress row, or report the live row that is in the way.

        Expired rows (``expires_at <= now``) count as absent. An in-progress row
        whose lease ran out is taken over only for the same ``request_hash``.
        """
        ...

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, expires_at: datetime
    ) -> bool:
        """Store the response and mark the row completed, if ``token`` still owns it."""
        ...

    async def release(self, key: str, token: str) -> bool:
        """Delete the row if ``token`` still owns it, so a retry runs again."""
        ...

    async def renew(self, key: str, token: str, *, locked_until: datetime) -> bool:
        """Extend a live claim's lease, if ``token`` still owns it."""
        ...

    async def get(self, key: str) -> Record | None:
        """The row for a scoped key, expired or not (for inspection, not the hot path)."""
        ...

    async def prune(self, *, now: datetime, batch_size: int = 1000) -> int:
        """Delete up to ``batch_size`` expired rows; return how many went."""
        ...

    async def close(self) -> None: ...

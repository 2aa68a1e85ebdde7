"""The record lifecycle: every rule about what a stored record means, in one place.

Stores only insert, compare-and-swap, update and delete (:mod:`.stores.base`); this
module says what their answers mean: the state of a row (:func:`state_of`), what an
existing row means for a new request (:func:`judge`: claim, 409, take-over, 422 or
replay), the claim as store primitives (:func:`claim`), complete or release
(:func:`completes`), a failed completion's retry schedule, the orphaned claim
(:func:`release_orphan`) and the 409's ``Retry-After``. The record's life and why an
owned, renewed claim is never expired: docs/design.md.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Literal, NamedTuple, Protocol

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.store import BUSY, Busy, NewClaim, Record, RecordStatus

__all__ = [
    "Claim",
    "ClaimOutcome",
    "RecordState",
    "claim",
    "completes",
    "completion_backoff",
    "completion_retries",
    "in_progress_wait",
    "judge",
    "release_orphan",
    "sighting",
    "state",
    "state_of",
]


class RecordState(enum.StrEnum):
    """What a stored row is at a given moment."""

    RUNNING = "running"  # in progress, lease live: its owner is at work
    ABANDONED = "abandoned"  # in progress, lease over: the owner died or hangs
    COMPLETED = "completed"  # a response is stored and replayed
    EXPIRED = "expired"  # past retention: behaves as absent, awaits pruning


def state(status: RecordStatus, *, expired: bool, lease_over: bool) -> RecordState:
    """The state of a row from its status and which side of ``now`` its deadlines fall.

    An in-progress row whose lease is live is RUNNING even past ``expires_at``: its
    owner is still at work and renewing it (the rule in the module docstring).
    """
    if status is RecordStatus.COMPLETED:
        return RecordState.EXPIRED if expired else RecordState.COMPLETED
    if not lease_over:
        return RecordState.RUNNING
    return RecordState.EXPIRED if expired else RecordState.ABANDONED


def state_of(record: Record, now: datetime) -> RecordState:
    """The state of ``record`` at the store's time when it was read, or at ``now`` if
    the store keeps no clock of its own (:attr:`Record.read_at`)."""
    at = now if record.read_at is None else record.read_at
    return state(
        record.status,
        expired=record.expires_at <= at,
        lease_over=record.locked_until <= at,
    )


class ClaimOutcome(enum.Enum):
    CLAIMED = "claimed"  # the caller owns the key: run the handler
    TAKEN_OVER = "taken_over"  # claimed an abandoned in-progress row (lease ran out)
    COMPLETED = "completed"  # a stored response exists for this request
    IN_PROGRESS = "in_progress"  # another owner holds a live lease
    MISMATCH = "mismatch"  # the key belongs to a different request

    # Members are singletons compared by identity, so identity hashing agrees with
    # equality; Enum's own __hash__ is a Python call (hash of the name), and every
    # request tests an outcome against _OWNED.
    __hash__ = object.__hash__


class Claim(NamedTuple):
    outcome: ClaimOutcome
    # The row in the way, for every outcome but CLAIMED/TAKEN_OVER; None for an
    # IN_PROGRESS that a transactional store answered from its lock alone.
    record: Record | None = None

    @property
    def owned(self) -> bool:
        return self.outcome in _OWNED


_OWNED = frozenset({ClaimOutcome.CLAIMED, ClaimOutcome.TAKEN_OVER})

# The answers that carry no row, shared: claims are frozen, and the hot path is hot.
CLAIMED = Claim(ClaimOutcome.CLAIMED)
TAKEN_OVER = Claim(ClaimOutcome.TAKEN_OVER)
_LOCKED_ELSEWHERE = Claim(ClaimOutcome.IN_PROGRESS)


def judge(existing: Record | None, request_hash: str, now: datetime) -> ClaimOutcome:
    """What the row in the way (or none) means for a new request with ``request_hash``."""
    # state_of(existing, now), read in the order state() tests it, without its two
    # calls: every replay, 409 and 422 comes here. tests/core/test_lifecycle.py holds the
    # two to the same answer for every combination.
    if existing is None:
        return ClaimOutcome.CLAIMED
    if existing.expires_at <= now and (
        existing.status is RecordStatus.COMPLETED or existing.locked_until <= now
    ):
        # An expired key behaves as new, pruned or not; a live claim is never expired.
        return ClaimOutcome.CLAIMED
    if existing.request_hash != request_hash:
        return ClaimOutcome.MISMATCH
    if existing.status is RecordStatus.COMPLETED:
        return ClaimOutcome.COMPLETED
    if existing.locked_until <= now:
        return ClaimOutcome.TAKEN_OVER  # abandoned: the owner's lease ran out
    return ClaimOutcome.IN_PROGRESS


class Claimant(Protocol):
    """The two primitives a claim needs: a store, or a transaction of one."""

    async def insert(self, new: NewClaim) -> Record | Literal[Busy.BUSY] | None: ...

    async def replace(self, expected: Record, new: NewClaim) -> bool: ...


# A take-over loses a race to another claimant at most a few times; past that something
# is wrong with the store, and the request gets the 503 path.
CLAIM_ATTEMPTS = 5


async def claim(
    store: Claimant,
    key: str,
    request_hash: str,
    token: str,
    *,
    now: datetime,
    lease: timedelta,
    ttl: timedelta,
    orphaned: Callable[[NewClaim], object] | None = None,
    scope_digest: str | None = None,
    route: str | None = None,
) -> Claim:
    """Claim ``key`` for ``token``: one insert, and a compare-and-swap only to take over.

    Round trips: a fresh key 1; a replay, 409 or 422 1; a take-over 2.

    The claim holds the key for ``lease`` and its record is kept for ``ttl``, both
    counted on the store's clock; the row in the way is judged at the store's time
    when it was read (:attr:`Record.read_at`), or at ``now`` for a store on one host.

    ``orphaned``, when given, is called with the claim if the caller is cancelled while
    a statement of the claim is in flight: the claim may then have landed, or may land
    in a moment, for a requester that is gone. The caller hands it to
    :func:`release_orphan` in the background (a transaction's claim needs none: it
    rolls back).

    ``scope_digest`` and ``route`` ride in the claim's own statement for the audit
    (:mod:`.stores.duplicates`): no round trip of their own.

    Raises:
        StoreError: the store failed, or the row kept changing under the claim.
    """
    if ttl < lease:
        # Retention never ends within the lease (the rule above); Policy already
        # refuses lease > ttl, this holds it for any caller.
        ttl = lease
    new = NewClaim(key, request_hash, token, now, lease, ttl, scope_digest, route)
    try:
        for _ in range(CLAIM_ATTEMPTS):
            existing = await store.insert(new)
            if existing is None:
                return CLAIMED
            if existing is BUSY:
                return _LOCKED_ELSEWHERE
            at = now if existing.read_at is None else existing.read_at
            outcome = judge(existing, request_hash, at)
            if outcome not in _OWNED:
                return Claim(outcome, existing)
            if await store.replace(existing, new):
                return CLAIMED if outcome is ClaimOutcome.CLAIMED else TAKEN_OVER
    except asyncio.CancelledError:
        if orphaned is not None:
            orphaned(new)
        raise
    raise StoreError(f"claim did not settle after {CLAIM_ATTEMPTS} attempts")


async def sighting(store: Claimant, marker: NewClaim, now: datetime) -> str | None:
    """Write a sighting ``marker`` (the regenerated-key detector's, :mod:`.regenerated`):
    the request hash of the sighting it meets within its window, if any.

    One ``insert``; a ``replace`` too when the marker found is past its window (this
    sighting starts a new one; losing that swap means a concurrent one restarted it).

    Raises:
        StoreError: the store failed.
    """
    found = await store.insert(marker)
    if found is None or found is BUSY:
        # The first sighting; or, in a transaction, another one holds the marker's lock
        # right now (a concurrent twin: missed, the count is a lower bound).
        return None
    if state_of(found, now) is RecordState.EXPIRED:
        await store.replace(found, marker)
        return None
    return found.request_hash


class Releaser(Protocol):
    async def release(self, key: str, token: str) -> bool: ...


async def release_orphan(store: Releaser, new: NewClaim) -> bool:
    """Release a claim whose requester went away while the claim was in flight.

    Nothing ran for it, so its key must not answer 409 until the lease ends. Whether
    its statement landed is unknown, and it may land after this begins (it is still on
    its way, or queued in a batch), so a release fenced by the claim's token is tried
    at once and then after each delay of :func:`completion_retries` of its lease,
    until one changes a row. A claim that never landed costs those few releases and
    changes nothing; one that did is gone within its lease. Failures of the store are
    retried the same way; the last is raised for the caller's log.

    Returns:
        Whether a release removed the claim.
    """
    failure: StoreError | None = None
    for delay in (0.0, *completion_retries(new.lease)):
        if delay:
            await asyncio.sleep(delay)
        try:
            if await store.release(new.key, new.token):
                return True
            failure = None
        except StoreError as exc:
            failure = exc
    if failure is not None:
        raise failure
    return False


# Outcomes a retry could change, so the key is released rather than stored: timeouts,
# conflicts, rate limits, and "you may not ask" (401, 407), which the caller answers by
# authenticating and retrying the same request.
RELEASED_STATUSES = frozenset({401, 407, 408, 409, 425, 429})


def completes(status: int) -> bool:
    """Whether a handler's response completes the key (stored, replayed) or releases it.

    2xx, 3xx and deterministic 4xx complete; 5xx and 401/407/408/409/425/429, which a
    retry could change, release the key so that the retry runs again.
    """
    return status < 500 and status not in RELEASED_STATUSES


def in_progress_wait(record: Record | None, now: datetime, retry_after: float) -> float:
    """Seconds a 409 suggests: the short retry interval, never past the running lease.

    Most handlers finish long before their lease ends, so the lease itself (an upper
    bound) would make callers wait far longer than needed.
    """
    if record is None:
        return retry_after
    at = now if record.read_at is None else record.read_at  # the store's clock, where shared
    return min((record.locked_until - at).total_seconds(), retry_after)


# A completion the store failed leaves the claim in progress although the handler's
# effect happened: retries get 409 until the lease ends, and then one takes the claim
# over and runs the handler again. So the owner tries again, in the background (the
# client already has its answer), keeping its lease renewed meanwhile so that nobody
# takes the claim over (lease.complete_later). A release of an orphaned claim that may
# never have landed tries a few times only (completion_retries); a completion tries for
# the lease's life (completion_backoff): a store away for longer than that leaves the
# key as a crash would.
COMPLETION_RETRY_FIRST = 0.1
COMPLETION_RETRIES = 5
COMPLETION_RETRY_CEILING = 2.0


def completion_retries(lease: timedelta) -> list[float]:
    """Seconds to wait before each further attempt at a release of an orphaned claim.

    Doubling from :data:`COMPLETION_RETRY_FIRST` (0.1 s), at most
    :data:`COMPLETION_RETRIES` (5) of them, their sum less than ``lease``; empty when
    even the first would not fit.
    """
    budget = lease.total_seconds()
    delays: list[float] = []
    delay, total = COMPLETION_RETRY_FIRST, 0.0
    while len(delays) < COMPLETION_RETRIES and total + delay < budget:
        delays.append(delay)
        total += delay
        delay *= 2
    return delays


def completion_backoff(lease: timedelta) -> list[float]:
    """Seconds to wait before each further attempt at a completion the store failed.

    Doubling from :data:`COMPLETION_RETRY_FIRST` (0.1 s) up to
    :data:`COMPLETION_RETRY_CEILING` (2 s) apart, as many as fit within ``lease`` (their
    sum less than it): a store that comes back while the claim's lease still holds gets
    the completion within two seconds. Past the last, the owner gives up: the claim
    stays in progress until its lease ends, as after a crash. Empty when even the first
    would not fit.
    """
    budget = lease.total_seconds()
    delays: list[float] = []
    delay, total = COMPLETION_RETRY_FIRST, 0.0
    while total + delay < budget:
        delays.append(delay)
        total += delay
        delay = min(delay * 2, COMPLETION_RETRY_CEILING)
    return delays

"""The store protocol the core runs on: the records and the atomic, token-fenced
primitives every store offers.

Stores decide nothing: what a row means for a new request, and whether a response
completes or releases a key, is :mod:`asgi_idempotency.core.lifecycle`. A store only
inserts, compares-and-swaps, updates and deletes rows atomically, and reports what
it found. Every method raises :class:`~asgi_idempotency.StoreError` on failure.

Defined here, on the ground floor, because the core calls it: the stores above
(:mod:`asgi_idempotency.stores`) implement it, and :mod:`asgi_idempotency.stores.base`
re-exports every name, so ``asgi_idempotency.stores.base.Record`` keeps working.
"""

from __future__ import annotations

import enum
import functools
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

__all__ = [
    "BUSY",
    "STATUS_OF",
    "Bucket",
    "Busy",
    "Capabilities",
    "NewClaim",
    "Record",
    "RecordStatus",
    "Store",
    "StoreTransaction",
    "StoredResponse",
    "TransactionalStore",
    "capabilities",
    "utcnow",
]


# The default clock: the current aware UTC time, with no Python frame of its own.
utcnow = functools.partial(datetime.now, UTC)


class RecordStatus(enum.StrEnum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


# A row's status column to its member: a dict lookup, where RecordStatus(value) is a call.
STATUS_OF = {status.value: status for status in RecordStatus}


# Record, StoredResponse (and lifecycle.Claim) are NamedTuples, like NewClaim, not
# frozen dataclasses: every replay builds one of each, and a frozen dataclass's
# __init__ sets each field through object.__setattr__, several times the cost of
# building a tuple. Immutable either way.
class StoredResponse(NamedTuple):
    """A captured response: replayed byte for byte."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


class Record(NamedTuple):
    """One row of ``idempotency_records``."""

    key: str
    request_hash: str
    status: RecordStatus
    token: str
    created_at: datetime
    locked_until: datetime
    expires_at: datetime
    response: StoredResponse | None = None
    # The store's own time when it read the row, where the store is shared and read
    # it (Postgres and MariaDB/MySQL always; Redis with the row in an insert's way):
    # the row's deadlines are judged at it, never at the caller's clock. ``None`` from
    # a store on one host (memory, SQLite): judged at the caller's ``now``.
    read_at: datetime | None = None


class Busy(enum.Enum):
    """A transactional store's answer when another transaction holds the key's lock."""

    BUSY = "busy"


BUSY = Busy.BUSY


class NewClaim(NamedTuple):
    """A fresh in-progress claim, as ``insert`` and ``replace`` write it.

    The lease and the retention are durations: the store adds them to its own time
    (``created_at``, ``locked_until = created_at + lease``, ``expires_at =
    created_at + ttl``), so that hosts whose clocks disagree agree on every lease.
    """

    key: str  # the scoped key: sha256 hex of (principal, client key)
    request_hash: str
    token: str  # fences complete/release/renew to this claim
    now: datetime  # the caller's clock: the time of a store on one host (memory, SQLite)
    lease: timedelta
    ttl: timedelta  # never shorter than lease (lifecycle.claim sees to it)
    # What the audit groups by (:mod:`.duplicates`), written with the claim at no extra
    # round trip: a digest of the caller (host and principal, :func:`.keys.scope_digest`)
    # and the route template. None for claims that are not HTTP requests.
    scope_digest: str | None = None
    route: str | None = None


@dataclass(frozen=True, slots=True)
class Bucket:
    """Rows grouped by status and by which side of ``now`` their two deadlines fall.

    What a bucket *means* (live, expired, abandoned) is the lifecycle's to say.
    """

    status: RecordStatus
    expired: bool  # expires_at <= now
    lease_over: bool  # locked_until <= now
    count: int
    oldest_created_at: datetime | None


class Capabilities(NamedTuple):
    """What a store offers beyond the primitives every store has, declared by the store.

    A store declares them as its ``capabilities`` attribute; :func:`capabilities` reads
    them, so that callers ask one question instead of testing types.
    """

    # Holds the claim, the handler's writes and the record in one transaction
    # (:class:`TransactionalStore`, ``Policy(transactional=True)``).
    transactions: bool = False
    # Sends operations that arrive while one is in flight together (this instance).
    batching: bool = False
    # ``buckets`` and ``count_expired`` answer: ``asgi-idempotency stats`` refuses a
    # store without them (exit 2, saying so).
    stats: bool = True
    # Expired records stay until ``prune`` deletes them, so a prune job is needed (the
    # CLI's ``prune``, :class:`~asgi_idempotency.ops.retention.Pruner`). False: the store
    # deletes them itself when their retention ends (Redis: the key's TTL), and
    # ``asgi-idempotency prune`` says there is nothing to prune.
    prune: bool = True
    # Records live in a schema that ``asgi-idempotency migrate`` creates and upgrades
    # (the SQL stores); False: ``migrate`` says there is nothing to migrate.
    migrations: bool = False
    # ``suspected_duplicates`` answers (``asgi-idempotency audit``, its gauge): the
    # store keeps each claim's scope digest and route where the audit can find them.
    audit: bool = False
    # Leases, take-overs, renewals, completion and expiry are decided on the store's own
    # clock (a shared database's or Redis's time), whatever ``now`` a caller passes; the
    # caller's clock decides on a store of one host (memory, SQLite).
    own_clock: bool = False


def capabilities(store: object) -> Capabilities:
    """What ``store`` declares; for a store of one's own that declares nothing, the
    primitives alone, with transactions if it is a :class:`TransactionalStore` that
    says it can open them."""
    declared = getattr(store, "capabilities", None)
    if isinstance(declared, Capabilities):
        return declared
    return Capabilities(
        transactions=isinstance(store, TransactionalStore)
        and store.transactions_unavailable is None
    )


@runtime_checkable
class Store(Protocol):
    """Atomic primitives over records keyed by the scoped key (a sha256 hex digest).

    ``insert`` and ``replace`` write a fresh in-progress claim; ``complete``,
    ``release`` and ``renew`` are fenced by the claim's ``token``, so a stale owner
    never changes a row it lost.

    Leases and retention are decided on the store's clock: a store shared by several
    hosts (Postgres, MariaDB/MySQL, Redis) computes every deadline from its own time
    inside the statement or script, given the lease or ttl as a duration, compares
    with its own time, and reports that time with the rows it reads
    (:attr:`Record.read_at`), so that a host whose clock is ahead never takes over a
    live claim and one behind never waits past a dead one. A store on one host
    (memory, SQLite) takes the caller's ``now`` as its clock, which keeps tests'
    clocks in control. The ``now`` arguments are that clock; shared stores ignore
    them for every decision.
    """

    async def insert(self, new: NewClaim) -> Record | Literal[Busy.BUSY] | None:
        """Insert an in-progress row; ``None`` if inserted, else the row in the way.

        The row in the way is returned whatever its state (expired included): the
        caller decides. One round trip on SQL stores. :data:`BUSY` when the row is
        held by an open transaction, which is deciding the key right now (the batching
        Postgres store answers so rather than make a batch wait for it): in progress.
        """
        ...

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        """Overwrite ``expected`` with a fresh claim, only if the row is still exactly it.

        Compare-and-swap on the row as read (its token, status and lease), so of two
        racing callers at most one wins, and a renewal or completion that landed
        in between makes the swap fail.
        """
        ...

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        """Store the response and mark the row completed, if ``token`` still owns it;
        it expires ``ttl`` after the store's time."""
        ...

    async def release(self, key: str, token: str) -> bool:
        """Delete the row if ``token`` still owns it, so a retry runs again."""
        ...

    async def renew(self, key: str, token: str, *, now: datetime, lease: timedelta) -> bool:
        """Extend a live claim's lease to ``lease`` past the store's time, if ``token``
        still owns it.

        Also moves the row's ``expires_at`` to at least the new ``locked_until`` (never back),
        so that a handler outliving its ``ttl`` keeps its claim: an in-progress row
        whose lease is live is then never expired, neither to a claim nor to ``prune``
        (nor to a store's own expiry, such as a Redis key's TTL).
        """
        ...

    async def get(self, key: str) -> Record | None:
        """The row for a scoped key, expired or not (for inspection, not the hot path)."""
        ...

    async def find(self, prefix: str, *, limit: int = 2) -> list[Record]:
        """Up to ``limit`` rows whose scoped key starts with ``prefix`` (the logs' digest)."""
        ...

    async def buckets(self, *, now: datetime | None = None) -> list[Bucket]:
        """Every row counted into :class:`Bucket` s at ``now`` (an admin query).

        ``now`` ``None``: the store's time (shared stores), the local clock (others).
        """
        ...

    async def count_expired(self, *, now: datetime | None = None) -> int:
        """How many rows have ``expires_at <= now`` (``now`` as in :meth:`buckets`)."""
        ...

    async def prune(self, *, now: datetime | None = None, batch_size: int = 1000) -> int:
        """Delete up to ``batch_size`` rows with ``expires_at <= now``; return how many went.

        ``now`` ``None``: the store's time (shared stores), the local clock (others).
        """
        ...

    async def close(self) -> None: ...


class StoreTransaction(Protocol):
    """One open transaction of a :class:`TransactionalStore`, under the key's lock.

    ``insert`` takes a non-blocking lock on the key first: :data:`BUSY` means
    another transaction is deciding this key right now. The lock does not make the
    row read with it current (a rival may commit just before this transaction wins
    it), so ``insert`` answers only from the row the insert met, and ``replace`` is
    a compare-and-swap as everywhere.
    """

    @property
    def state(self) -> Any:
        """What the handler writes through, as ``request.state.idempotency``."""
        ...

    async def insert(self, new: NewClaim) -> Record | Literal[Busy.BUSY] | None:
        """``None`` if inserted, else the row in the way, or :data:`BUSY` if another
        transaction holds the key's lock."""
        ...

    async def replace(self, expected: Record, new: NewClaim) -> bool: ...

    async def commit(self, key: str, token: str, response: StoredResponse, *,
                     now: datetime, ttl: timedelta) -> None:  # fmt: skip
        """Flush the handler's writes, complete the record, and commit, all or nothing.

        Raises:
            StoreError: the store failed, or the record is not this claim's (the
                completion changed no row); nothing is committed.
        """
        ...

    async def commit_writes(self) -> None:
        """Flush the handler's writes and commit them alone, with no record: report-only
        mode runs the handler of a request whose key's record is another request's.

        Raises:
            StoreError: the store failed; nothing is committed.
        """
        ...


@runtime_checkable
class TransactionalStore(Store, Protocol):
    """A store that can run the claim, the handler's writes and the record in one transaction."""

    @property
    def transactions_unavailable(self) -> str | None:
        """``None`` when this instance can open transactions, else why not (for the error)."""
        ...

    def transaction(self) -> AbstractAsyncContextManager[StoreTransaction]:
        """Open a transaction; leaving the context without ``commit`` rolls it back."""
        ...

"""The store base: what every store declares beyond the protocol, and the protocol's
names where stores have always imported them.

The protocol itself (:class:`Store`, :class:`Record`, :class:`NewClaim` ...) is the
core's (:mod:`asgi_idempotency.core.store`): the core runs on it and imports nothing
above it. It is re-exported here, so ``asgi_idempotency.stores.base.X`` keeps working.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import NamedTuple, Protocol, runtime_checkable

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.store import BUSY as BUSY
from asgi_idempotency.core.store import STATUS_OF as STATUS_OF
from asgi_idempotency.core.store import (
    Bucket,
    NewClaim,
    Record,
    RecordStatus,
    Store,
    StoredResponse,
    StoreTransaction,
    TransactionalStore,
    utcnow,
)
from asgi_idempotency.core.store import Busy as Busy
from asgi_idempotency.stores.duplicates import SuspectedDuplicate

# Re-exported too, not public: BUSY, Busy and STATUS_OF, where the stores find them.
__all__ = [
    "AuditableStore",
    "Bucket",
    "Capabilities",
    "NewClaim",
    "PreparedStore",
    "Record",
    "RecordStatus",
    "Store",
    "StoreError",
    "StoreTransaction",
    "StoredResponse",
    "TransactionalStore",
    "capabilities",
    "utcnow",
]


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
class AuditableStore(Protocol):
    """A store that finds likely duplicates keys could not catch (``Capabilities.audit``)."""

    async def suspected_duplicates(
        self, *, since: datetime, window: timedelta, route: str | None = None
    ) -> list[SuspectedDuplicate]:
        """Requests claimed at or after ``since`` by one caller, to one route, with one
        fingerprint, under different keys, each within ``window`` of the one before
        (:func:`.duplicates.group_sightings`); only ``route``'s when given. An admin
        query: it reads the claims' scope digests through an index (SQL) or a
        secondary structure kept for the records' retention (Redis)."""
        ...


@runtime_checkable
class PreparedStore(Protocol):
    """A store with something to do, or to check, before it can serve (optional).

    The middleware calls :meth:`prepare` at lifespan startup, and on the first
    guarded request when there was no lifespan, until it succeeds once; after that
    it costs nothing per request. A store without this method is ready as built.
    """

    async def prepare(self) -> None:
        """Make the store ready to serve, or say what the operator must do.

        Idempotent and safe to run from several processes at once.

        Raises:
            SchemaMissing: the schema is the operator's and is missing; its message
                names the fix.
            StoreError: the store could not be reached.
        """
        ...

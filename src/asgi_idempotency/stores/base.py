"""The store base: what every store declares beyond the protocol, and the protocol's
names where stores have always imported them.

:class:`StoreBase` is what our stores are built on: the capabilities they declare,
the error boundary their driver declares, and the connections they hold per event
loop, bound in one place.

The protocol itself (:class:`Store`, :class:`Record`, :class:`NewClaim` ...) is the
core's (:mod:`asgi_idempotency.core.store`): the core runs on it and imports nothing
above it. It is re-exported here, so ``asgi_idempotency.stores.base.X`` keeps working.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Protocol, runtime_checkable

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.store import BUSY as BUSY
from asgi_idempotency.core.store import STATUS_OF as STATUS_OF
from asgi_idempotency.core.store import (
    Bucket,
    Capabilities,
    NewClaim,
    Record,
    RecordStatus,
    Store,
    StoredResponse,
    StoreTransaction,
    TransactionalStore,
    capabilities,
    utcnow,
)
from asgi_idempotency.core.store import Busy as Busy
from asgi_idempotency.stores.duplicates import SuspectedDuplicate
from asgi_idempotency.stores.errors import ErrorBoundary
from asgi_idempotency.stores.loops import LoopTenure

# Re-exported too, not public: BUSY, Busy and STATUS_OF, where the stores find them.
# StoreBase is the package's stores' base, not a public name.
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


def _never(exc: BaseException) -> bool:
    return False


class StoreBase:
    """The base of a store that holds a driver's connections: what it declares and how it
    follows the event loop, written once.

    - :attr:`capabilities`: what it offers beyond the primitives (the registry line
      declares the same; :func:`capabilities` reads it).
    - :attr:`errors`: its driver's :class:`~.errors.ErrorBoundary`, declared in the
      store's own module (no store imports another's driver).
    - Event-loop binding: a driver's connections belong to the loop that opened them
      (:mod:`.loops`). Every entry point calls :meth:`_bound` (one identity check on
      the hot path); on a loop other than the connections', :meth:`_connect` opens
      this loop's and says what closes them, which a :class:`~.loops.LoopTenure`
      runs on this loop as it shuts down. :meth:`_end_loop` is the store's ``close``.

    The primitives themselves are the :class:`Store` protocol's, and the rules over
    them the lifecycle's (:mod:`asgi_idempotency.core.lifecycle`), the same for
    every store; a store of one process with nothing per loop (``MemoryStore``, the
    documented ``DictStore``) needs no base at all.
    """

    capabilities: Capabilities = Capabilities()
    errors: ErrorBoundary = ErrorBoundary((), _never)  # nothing is a driver's failure
    # The loop this store's connections belong to, and what closes them on it; None
    # until the store first serves (an instance's own, once bound).
    _loop: asyncio.AbstractEventLoop | None = None
    _tenure: LoopTenure | None = None

    def _bound(self) -> None:
        """Serve from the running loop: on a loop other than the one the connections
        belong to, open this loop's (:meth:`_connect`)."""
        if asyncio.get_running_loop() is not self._loop:
            self._enter()

    def _enter(self) -> None:
        close = self._connect(moved=self._tenure is not None)
        self._tenure = LoopTenure(close)
        self._loop = self._tenure.loop

    def _connect(self, *, moved: bool) -> Callable[[], Awaitable[None]]:
        """Make this loop's connections ready, and return what closes them on this loop.

        ``moved``: the store served on another loop before; those connections can be
        neither used nor closed from here, and are left to that loop's tenure.
        """
        raise NotImplementedError

    async def _end_loop(self) -> bool | None:
        """End this store's tenure (its ``close``): ``True`` if its connections were this
        loop's and are closed now; ``False`` if they are another loop's (closed as that
        loop shuts down: nothing here may touch them); ``None`` if it never served."""
        tenure, self._tenure, self._loop = self._tenure, None, None
        if tenure is None:
            return None
        if tenure.loop is not asyncio.get_running_loop():
            return False
        await tenure.end()
        return True

"""What the store contract's tests claim with and keep time by (:mod:`.store_contract`).

:class:`Claimant` claims as the middleware does, on the store or in a transaction of it;
:class:`StoreClock` is the clock the tests let leases run out on: the caller's, or real
time on a store with a clock of its own. The constants and :func:`claim` are the tests'
shorthand.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

from asgi_idempotency import StoredResponse
from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.lifecycle import Claim
from asgi_idempotency.stores.base import (
    Store,
    StoreTransaction,
    TransactionalStore,
    capabilities,
    utcnow,
)

__all__ = ["LEASE", "RESPONSE", "T0", "TTL", "Claimant", "StoreClock", "claim", "tok"]


class Claimant:
    """Claims made as the middleware makes them: on the store, or in a transaction of it.

    In the transactional mode an owned claim keeps its transaction (and the key's
    lock) open until :meth:`complete` commits it or :meth:`release` rolls it back.
    """

    def __init__(self, store: Store, *, transactional: bool) -> None:
        self.store = store
        self.transactional = transactional
        self._held: dict[str, tuple[AsyncExitStack, StoreTransaction]] = {}

    async def claim(
        self, key: str, request_hash: str, token: str, *, now: datetime,
        lease: timedelta, ttl: timedelta,
    ) -> Claim:  # fmt: skip
        times: dict[str, Any] = {"now": now, "lease": lease, "ttl": ttl}
        if not self.transactional:
            return await lifecycle.claim(self.store, key, request_hash, token, **times)
        assert isinstance(self.store, TransactionalStore)
        stack = AsyncExitStack()
        tx = await stack.enter_async_context(self.store.transaction())
        try:
            claim = await lifecycle.claim(tx, key, request_hash, token, **times)
        except BaseException:
            await stack.aclose()
            raise
        if claim.owned:
            self._held[token] = (stack, tx)
        else:
            await stack.aclose()
        return claim

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        if not self.transactional:
            return await self.store.complete(key, token, response, now=now, ttl=ttl)
        stack, tx = self._held.pop(token)
        async with stack:
            await tx.commit(key, token, response, now=now, ttl=ttl)
        return True

    async def release(self, key: str, token: str) -> bool:
        if not self.transactional:
            return await self.store.release(key, token)
        stack, _ = self._held.pop(token)
        await stack.aclose()  # leaving without commit rolls the claim back
        return True

    async def close(self) -> None:
        for stack, _ in self._held.values():
            await stack.aclose()
        self._held.clear()


class StoreClock:
    """The clock a store decides leases with, for a test that lets a lease or a ttl run out.

    On a store of one host (memory, SQLite, one's own dict) the store takes the caller's
    ``now``: this clock, moved at will, with leases of ``unit`` = 30 s. A store that
    declares a clock of its own (``Capabilities.own_clock``: Postgres, MariaDB, Redis)
    decides on its own time, which only real time moves: ``unit`` is then
    ``StoreClock.shared_unit`` (one second), and moving the clock is sleeping. Pass it as
    a middleware's or ``Once``'s ``clock``.

    A suite whose stores answer within milliseconds (a loopback server) may set
    ``StoreClock.shared_unit`` shorter, before its tests run: every lease, ttl and wait
    of the contract on a shared store is a multiple of it, so the contract's sleeps
    shrink with it. Too short for the store's round trips, and live leases run out
    between two steps of a test: the tests fail, they never pass wrongly.
    """

    shared_unit: ClassVar[timedelta] = timedelta(seconds=1)

    def __init__(self, store: Store) -> None:
        self.shared = capabilities(store).own_clock
        self.unit = self.shared_unit if self.shared else timedelta(seconds=30)
        self.now = utcnow() if self.shared else datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return utcnow() if self.shared else self.now

    @property
    def cutoff(self) -> datetime | None:
        """An admin query's ``now``: ``None`` (the store's own time) where it has one."""
        return None if self.shared else self.now

    async def advance(self, by: timedelta) -> datetime:
        if self.shared:
            await asyncio.sleep(by.total_seconds())
            self.now = utcnow()
        else:
            self.now += by
        return self.now

    async def past(self, span: timedelta) -> datetime:
        """Move past the end of a ``span`` that began now (by a fifth of a unit)."""
        return await self.advance(span + self.unit / 5)


T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)
TTL = timedelta(hours=24)
RESPONSE = StoredResponse(
    201, ((b"content-type", b"application/json"), (b"x-a", b"\xff\x00bytes")), b'{"id":1}\x00\xff'
)


def tok() -> str:
    return uuid.uuid4().hex


async def claim(
    store: Store,
    key: str = "k" * 64,
    h: str = "h1",
    token: str | None = None,
    now: datetime = T0,
    lease: timedelta = LEASE,
    ttl: timedelta = TTL,
) -> lifecycle.Claim:
    return await lifecycle.claim(store, key, h, token or tok(), now=now, lease=lease, ttl=ttl)

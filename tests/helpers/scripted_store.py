"""The fake store: the reference semantics of every primitive, with a script of faults.

:class:`ScriptedStore` answers as :class:`MemoryStore` does (the contract suite runs on
it beside the real stores, so each real store is held to what this one does), and
lets a test say, per primitive, what happens before it runs (``before``: a rival's
write slipped in between two statements, a statement left hanging) and which calls
fail (``fail``). ``calls`` records every primitive called, in order: the lifecycle's
round trips, counted.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from asgi_idempotency.stores.base import NewClaim, Record, StoredResponse
from asgi_idempotency.stores.duplicates import SuspectedDuplicate
from asgi_idempotency.stores.memory import MemoryStore

# What runs before a primitive: given the store, it may write (as a rival would) or wait.
Hook = Callable[["ScriptedStore"], Awaitable[None]]


class ScriptedStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.before: dict[str, deque[Hook]] = defaultdict(deque)
        self.fail: dict[str, deque[BaseException]] = defaultdict(deque)

    async def _enter(self, name: str) -> None:
        self.calls.append(name)
        if self.before[name]:
            await self.before[name].popleft()(self)
        if self.fail[name]:
            raise self.fail[name].popleft()

    async def insert(self, new: NewClaim) -> Record | None:
        await self._enter("insert")
        return await super().insert(new)

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        await self._enter("replace")
        return await super().replace(expected, new)

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        await self._enter("complete")
        return await super().complete(key, token, response, now=now, ttl=ttl)

    async def release(self, key: str, token: str) -> bool:
        await self._enter("release")
        return await super().release(key, token)

    async def renew(self, key: str, token: str, *, now: datetime, lease: timedelta) -> bool:
        await self._enter("renew")
        return await super().renew(key, token, now=now, lease=lease)

    async def suspected_duplicates(
        self, *, since: datetime, window: timedelta, route: str | None = None
    ) -> list[SuspectedDuplicate]:
        await self._enter("suspected_duplicates")
        return await super().suspected_duplicates(since=since, window=window, route=route)

    def put(self, record: Record) -> None:
        """Write ``record`` as it is (a row another process left)."""
        response = record.response
        self._rows[record.key] = (
            record.request_hash,
            record.status.value,
            record.token,
            record.created_at,
            record.locked_until,
            record.expires_at,
            None if response is None else (response.status, response.headers, response.body),
            None,  # no scope digest or route: a row of no HTTP request's, to the audit
            None,
        )

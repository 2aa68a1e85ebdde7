"""A complete store in one file: records in a dict, one asyncio lock around each primitive.

It passes the store contract (asgi_idempotency.testing.StoreContract) and registers
itself for ``dict://`` URLs in one line. One process only: use it to learn the
primitives, then put them on a database every worker shares.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from asgi_idempotency.stores.base import (
    Bucket,
    Capabilities,
    NewClaim,
    Record,
    RecordStatus,
    StoredResponse,
    utcnow,
)
from asgi_idempotency.stores.registry import StoreKind, register

IN_PROGRESS, COMPLETED = RecordStatus.IN_PROGRESS, RecordStatus.COMPLETED


class DictStore:
    """Each method is atomic: it holds the lock from its read to its write."""

    # No transactions, no batching, no clock of its own (the caller's now decides its
    # leases: one process); stats and prune.
    capabilities = Capabilities()

    # Built by the registry as factory(url, **options); the CLI passes command_timeout.
    def __init__(self, url: str = "dict://", *, command_timeout: float = 5.0) -> None:
        self.rows: dict[str, Record] = {}
        self.lock = asyncio.Lock()

    async def insert(self, new: NewClaim) -> Record | None:
        """Write a fresh claim; or return the row in the way, whatever its state."""
        async with self.lock:
            if new.key in self.rows:
                return self.rows[new.key]
            self.rows[new.key] = Record(
                new.key, new.request_hash, IN_PROGRESS, new.token,
                new.now, new.now + new.lease, new.now + new.ttl,
            )  # fmt: skip
            return None

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        """Compare-and-swap: only if the row is still exactly as the caller read it."""
        async with self.lock:
            if self.rows.get(expected.key) != expected:
                return False
            self.rows[new.key] = Record(
                new.key, new.request_hash, IN_PROGRESS, new.token,
                new.now, new.now + new.lease, new.now + new.ttl,
            )  # fmt: skip
            return True

    def _owned(self, key: str, token: str) -> Record | None:
        row = self.rows.get(key)
        return row if row and row.token == token and row.status is IN_PROGRESS else None

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        async with self.lock:
            row = self._owned(key, token)  # a completed row is never completed again
            if row is None:
                return False
            self.rows[key] = row._replace(status=COMPLETED, response=response, expires_at=now + ttl)
            return True

    async def release(self, key: str, token: str) -> bool:
        async with self.lock:
            if self._owned(key, token) is None:
                return False
            del self.rows[key]
            return True

    async def renew(self, key: str, token: str, *, now: datetime, lease: timedelta) -> bool:
        async with self.lock:
            row = self._owned(key, token)
            if row is None:
                return False
            locked_until = now + lease
            # Retention never ends before the lease: a live claim is never expired.
            expires_at = max(row.expires_at, locked_until)
            self.rows[key] = row._replace(locked_until=locked_until, expires_at=expires_at)
            return True

    async def get(self, key: str) -> Record | None:
        return self.rows.get(key)

    async def find(self, prefix: str, *, limit: int = 2) -> list[Record]:
        return sorted((r for k, r in self.rows.items() if k.startswith(prefix)))[:limit]

    async def buckets(self, *, now: datetime | None = None) -> list[Bucket]:
        now = utcnow() if now is None else now
        groups: dict[tuple[RecordStatus, bool, bool], list[Record]] = {}
        for row in self.rows.values():
            group = (row.status, row.expires_at <= now, row.locked_until <= now)
            groups.setdefault(group, []).append(row)
        return [
            Bucket(status, expired, lease_over, len(rows), min(r.created_at for r in rows))
            for (status, expired, lease_over), rows in groups.items()
        ]

    async def count_expired(self, *, now: datetime | None = None) -> int:
        now = utcnow() if now is None else now
        return sum(1 for row in self.rows.values() if row.expires_at <= now)

    async def prune(self, *, now: datetime | None = None, batch_size: int = 1000) -> int:
        now = utcnow() if now is None else now
        async with self.lock:
            expired = [k for k, r in self.rows.items() if r.expires_at <= now][:batch_size]
            for key in expired:
                del self.rows[key]
            return len(expired)

    async def close(self) -> None:
        self.rows.clear()


# The one line that makes dict:// URLs open a DictStore (open_store, the CLI).
register(StoreKind("dict", ("dict",), DictStore, DictStore.capabilities))

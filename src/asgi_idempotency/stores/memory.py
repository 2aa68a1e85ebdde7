"""In-process store: the same primitives as SQL, for tests and single-process demos.

One process, one clock: leases and expiry are decided on the caller's ``now``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from asgi_idempotency.stores.base import (
    STATUS_OF,
    Bucket,
    Capabilities,
    NewClaim,
    Record,
    RecordStatus,
    StoredResponse,
    utcnow,
)
from asgi_idempotency.stores.duplicates import Sighting, SuspectedDuplicate, group_sightings

__all__ = ["MemoryStore"]

# A row is a plain tuple of strings, times, ints and bytes: the garbage collector stops
# tracking such tuples, so a store of many rows adds nothing to every collection.
# (request_hash, status, token, created_at, locked_until, expires_at, response,
#  scope_digest, route)
_Row = tuple[str, str, str, datetime, datetime, datetime, Any, str | None, str | None]
_IN_PROGRESS = RecordStatus.IN_PROGRESS.value
_COMPLETED = RecordStatus.COMPLETED.value


def _record(key: str, row: _Row) -> Record:
    response = None if row[6] is None else StoredResponse(*row[6])
    return Record(key, row[0], STATUS_OF[row[1]], row[2], row[3], row[4], row[5], response)


def _claimed(new: NewClaim) -> _Row:
    now = new.now
    return (new.request_hash, _IN_PROGRESS, new.token, now, now + new.lease, now + new.ttl,
            None, new.scope_digest, new.route)  # fmt: skip


class MemoryStore:
    """A dict of records. Atomic because no method awaits between read and write.

    Not shared between processes: with several workers use :class:`SQLStore`.
    """

    capabilities = Capabilities(audit=True)

    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}

    async def insert(self, new: NewClaim) -> Record | None:
        key = new.key
        row = self._rows.get(key)
        if row is not None:
            return _record(key, row)
        # _claimed(new), inlined: every fresh request comes here.
        now = new.now
        self._rows[key] = (new.request_hash, _IN_PROGRESS, new.token, now, now + new.lease,
                           now + new.ttl, None, new.scope_digest, new.route)  # fmt: skip
        return None

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        key = expected.key
        row = self._rows.get(key)
        if (
            row is None
            or row[2] != expected.token
            or row[1] != expected.status.value
            or row[4] != expected.locked_until
        ):
            return False
        self._rows[key] = _claimed(new)
        return True

    def _owned(self, key: str, token: str) -> _Row | None:
        row = self._rows.get(key)
        if row is None or row[2] != token or row[1] != _IN_PROGRESS:
            return None
        return row

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        row = self._rows.get(key)  # _owned(key, token), inlined: every completion comes here
        if row is None or row[2] != token or row[1] != _IN_PROGRESS:
            return False
        stored = (response.status, response.headers, response.body)
        self._rows[key] = (row[0], _COMPLETED, row[2], row[3], row[4], now + ttl, stored,
                           row[7], row[8])  # fmt: skip
        return True

    async def release(self, key: str, token: str) -> bool:
        if self._owned(key, token) is None:
            return False
        del self._rows[key]
        return True

    async def renew(self, key: str, token: str, *, now: datetime, lease: timedelta) -> bool:
        row = self._owned(key, token)
        if row is None:
            return False
        locked_until = now + lease
        # Retention never ends before the lease: a live claim is never expired.
        expires_at = max(row[5], locked_until)
        self._rows[key] = (row[0], row[1], row[2], row[3], locked_until, expires_at, row[6],
                           row[7], row[8])  # fmt: skip
        return True

    async def get(self, key: str) -> Record | None:
        row = self._rows.get(key)
        return None if row is None else _record(key, row)

    async def find(self, prefix: str, *, limit: int = 2) -> list[Record]:
        found = [_record(k, r) for k, r in self._rows.items() if k.startswith(prefix)]
        return sorted(found, key=lambda r: r.key)[:limit]

    async def buckets(self, *, now: datetime | None = None) -> list[Bucket]:
        now = utcnow() if now is None else now
        groups: dict[tuple[str, bool, bool], tuple[int, datetime | None]] = {}
        for row in self._rows.values():
            group = (row[1], row[5] <= now, row[4] <= now)
            count, oldest = groups.get(group, (0, None))
            groups[group] = (count + 1, row[3] if oldest is None else min(oldest, row[3]))
        return [
            Bucket(STATUS_OF[status], expired, lease_over, count, oldest)
            for (status, expired, lease_over), (count, oldest) in groups.items()
        ]

    async def count_expired(self, *, now: datetime | None = None) -> int:
        now = utcnow() if now is None else now
        return sum(1 for r in self._rows.values() if r[5] <= now)

    async def suspected_duplicates(
        self, *, since: datetime, window: timedelta, route: str | None = None
    ) -> list[SuspectedDuplicate]:
        sightings = [
            Sighting(r[7], r[8] or "", r[0], k, r[3])
            for k, r in self._rows.items()
            if r[7] is not None and r[3] >= since and (route is None or r[8] == route)
        ]
        return group_sightings(sightings, window)

    async def prune(self, *, now: datetime | None = None, batch_size: int = 1000) -> int:
        now = utcnow() if now is None else now
        expired = [k for k, r in self._rows.items() if r[5] <= now][:batch_size]
        for k in expired:
            del self._rows[k]
        return len(expired)

    async def close(self) -> None:
        self._rows.clear()

"""In-process store: the same semantics as SQL, for tests and single-process demos."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .base import (
    CLAIMED,
    STATUS_OF,
    TAKEN_OVER,
    Claim,
    ClaimOutcome,
    Record,
    RecordStatus,
    StoredResponse,
    decide,
)

__all__ = ["MemoryStore"]

# A row is a plain tuple of strings, times, ints and bytes: the garbage collector stops
# tracking such tuples, so a store of many rows adds nothing to every collection.
# (request_hash, status, token, created_at, locked_until, expires_at, response)
_Row = tuple[str, str, str, datetime, datetime, datetime, Any]
_IN_PROGRESS = RecordStatus.IN_PROGRESS.value
_COMPLETED = RecordStatus.COMPLETED.value


def _record(key: str, row: _Row) -> Record:
    response = None if row[6] is None else StoredResponse(*row[6])
    return Record(key, row[0], STATUS_OF[row[1]], row[2], row[3], row[4], row[5], response)


class MemoryStore:
    """A dict of records. Atomic because no method awaits between read and write.

    Not shared between processes: with several workers use :class:`SQLStore`.
    """

    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}

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
        row = self._rows.get(key)
        claimed = CLAIMED
        if row is not None and row[5] > now:
            existing = _record(key, row)
            outcome = decide(existing, request_hash, now)
            if outcome is not ClaimOutcome.TAKEN_OVER:
                return Claim(outcome, existing)
            claimed = TAKEN_OVER
        self._rows[key] = (request_hash, _IN_PROGRESS, token, now, locked_until, expires_at, None)
        return claimed

    def _owned(self, key: str, token: str) -> _Row | None:
        row = self._rows.get(key)
        if row is None or row[2] != token or row[1] != _IN_PROGRESS:
            return None
        return row

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, expires_at: datetime
    ) -> bool:
        row = self._owned(key, token)
        if row is None:
            return False
        stored = (response.status, response.headers, response.body)
        self._rows[key] = (row[0], _COMPLETED, row[2], row[3], row[4], expires_at, stored)
        return True

    async def release(self, key: str, token: str) -> bool:
        if self._owned(key, token) is None:
            return False
        del self._rows[key]
        return True

    async def renew(self, key: str, token: str, *, locked_until: datetime) -> bool:
        row = self._owned(key, token)
        if row is None:
            return False
        self._rows[key] = (row[0], row[1], row[2], row[3], locked_until, row[5], row[6])
        return True

    async def get(self, key: str) -> Record | None:
        row = self._rows.get(key)
        return None if row is None else _record(key, row)

    def count_expired(self, *, now: datetime) -> int:
        """How many rows have expired at ``now`` and await pruning."""
        return sum(1 for r in self._rows.values() if r[5] <= now)

    async def prune(self, *, now: datetime, batch_size: int = 1000) -> int:
        expired = [k for k, r in self._rows.items() if r[5] <= now][:batch_size]
        for k in expired:
            del self._rows[k]
        return len(expired)

    async def close(self) -> None:
        self._rows.clear()

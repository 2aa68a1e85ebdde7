"""In-process store: the same semantics as SQL, for tests and single-process demos."""

from __future__ import annotations

import dataclasses
from datetime import datetime

from .base import Claim, ClaimOutcome, Record, RecordStatus, StoredResponse, decide

__all__ = ["MemoryStore"]


class MemoryStore:
    """A dict of records. Atomic because no method awaits between read and write.

    Not shared between processes: with several workers use :class:`SQLStore`.
    """

    def __init__(self) -> None:
        self._rows: dict[str, Record] = {}

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
        existing = self._rows.get(key)
        outcome = ClaimOutcome.CLAIMED
        if existing is not None and existing.expires_at > now:
            outcome = decide(existing, request_hash, now)
            if outcome is not ClaimOutcome.TAKEN_OVER:
                return Claim(outcome, existing)
        self._rows[key] = Record(
            key=key,
            request_hash=request_hash,
            status=RecordStatus.IN_PROGRESS,
            token=token,
            created_at=now,
            locked_until=locked_until,
            expires_at=expires_at,
        )
        return Claim(outcome)

    def _owned(self, key: str, token: str) -> Record | None:
        row = self._rows.get(key)
        if row is None or row.token != token or row.status is not RecordStatus.IN_PROGRESS:
            return None
        return row

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, expires_at: datetime
    ) -> bool:
        row = self._owned(key, token)
        if row is None:
            return False
        self._rows[key] = dataclasses.replace(
            row, status=RecordStatus.COMPLETED, response=response, expires_at=expires_at
        )
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
        self._rows[key] = dataclasses.replace(row, locked_until=locked_until)
        return True

    async def get(self, key: str) -> Record | None:
        return self._rows.get(key)

    async def prune(self, *, now: datetime, batch_size: int = 1000) -> int:
        expired = [k for k, r in self._rows.items() if r.expires_at <= now][:batch_size]
        for k in expired:
            del self._rows[k]
        return len(expired)

    async def close(self) -> None:
        self._rows.clear()

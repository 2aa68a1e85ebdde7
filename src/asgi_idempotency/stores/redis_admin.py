"""The Redis store off the hot path: reads, statistics, the audit and prune by SCAN
over every primary (admin tools and tests).

Part of :mod:`asgi_idempotency.stores.redis`.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timedelta
from typing import Any, cast

from asgi_idempotency.stores.base import STATUS_OF, Bucket, Record
from asgi_idempotency.stores.duplicates import Sighting, SuspectedDuplicate, group_sightings
from asgi_idempotency.stores.redis_client import REDIS_ERRORS, AsyncScript, _call, _escape_glob
from asgi_idempotency.stores.redis_pipeline import RedisPipelines
from asgi_idempotency.stores.redis_scripts import _EPOCH, _FIELDS, _record, _time, _us

__all__ = ["RedisAdmin"]

_SCAN_COUNT = 1000
_BATCH = 500


class RedisAdmin(RedisPipelines):
    """What the store reads off the hot path; the primitives are
    :class:`~asgi_idempotency.stores.redis.RedisStore`'s."""

    _match: str
    _audit_prefix: str
    _prune: AsyncScript

    async def get(self, key: str) -> Record | None:
        self._bound()
        if self._cold:
            await self._warm()
        row = await _call(self.client.hmget(self._key(key), _FIELDS), self._timeout)
        return None if row[0] is None else _record(key, row)

    async def _scan(self, match: str) -> AsyncIterator[bytes]:
        # On a cluster redis-py's scan_iter walks every primary.
        self._bound()
        if self._cold:
            await self._warm()
        names = aiter(self.client.scan_iter(match=match, count=_SCAN_COUNT))
        while True:
            try:  # each step within the deadline and the boundary, as in _call
                with REDIS_ERRORS:
                    async with asyncio.timeout(self._timeout):
                        name = await anext(names)
            except StopAsyncIteration:
                return
            yield name

    async def _batches(self, match: str) -> AsyncIterator[list[bytes]]:
        batch: list[bytes] = []
        async for name in self._scan(match):
            batch.append(name)
            if len(batch) >= _BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    async def _fields(self, names: Sequence[bytes], *fields: str) -> list[list[Any]]:
        """HMGET ``fields`` of each key in one pipeline (per node, on a cluster)."""
        self._bound()
        pipe: Any = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, fields)
        return cast(list[list[Any]], await _call(pipe.execute(), self._timeout))

    async def find(self, prefix: str, *, limit: int = 2) -> list[Record]:
        names: list[bytes] = []
        async for name in self._scan(f"{self._match}{_escape_glob(prefix)}*"):
            names.append(name)
        chosen = heapq.nsmallest(limit, names)
        rows = await self._fields(chosen, *_FIELDS) if chosen else []
        return [
            _record(self._scoped(name), row)
            for name, row in zip(chosen, rows, strict=True)
            if row[0] is not None
        ]

    async def _server_us(self, now: datetime | None) -> int:
        """``now`` in microseconds, or the server's time (one server's, on a cluster)."""
        if now is not None:
            return _us(now)
        self._bound()
        seconds, micros = await _call(self.client.time(), self._timeout)
        return int(seconds) * 1_000_000 + int(micros)

    async def buckets(self, *, now: datetime | None = None) -> list[Bucket]:
        at = await self._server_us(now)
        groups: dict[tuple[str, bool, bool], tuple[int, int | None]] = {}
        async for batch in self._batches(f"{self._match}*"):
            for status, created, locked, expires in await self._fields(batch, "s", "c", "l", "e"):
                if status is None:
                    continue  # expired or deleted since the scan
                group = (status.decode(), int(expires) <= at, int(locked) <= at)
                count, oldest = groups.get(group, (0, None))
                c = int(created)
                groups[group] = (count + 1, c if oldest is None else min(oldest, c))
        return [
            Bucket(
                STATUS_OF[status],
                expired,
                lease_over,
                count,
                None if oldest is None else _EPOCH + timedelta(microseconds=oldest),
            )
            for (status, expired, lease_over), (count, oldest) in groups.items()
        ]

    async def count_expired(self, *, now: datetime | None = None) -> int:
        at, total = await self._server_us(now), 0
        async for batch in self._batches(f"{self._match}*"):
            rows = await self._fields(batch, "e")
            total += sum(1 for (e,) in rows if e is not None and int(e) <= at)
        return total

    async def suspected_duplicates(
        self, *, since: datetime, window: timedelta, route: str | None = None
    ) -> list[SuspectedDuplicate]:
        """From the audit's sorted sets (every primary's, by SCAN): the entries of one
        scope and fingerprint under several keys, each checked against its record (a
        released record, or one claimed again for another request, is not a sighting)."""
        names = [name async for name in self._scan(f"{_escape_glob(self._audit_prefix)}*")]
        groups: dict[tuple[str, str], dict[str, str]] = {}
        for start in range(0, len(names), _BATCH):
            pipe: Any = self.client.pipeline(transaction=False)
            for name in names[start : start + _BATCH]:
                pipe.zrange(name, 0, -1)
            for members in await _call(pipe.execute(), self._timeout):
                for member in members:
                    key, scope, h, path = member.decode().split(" ", 3)
                    if route is None or path == route:
                        groups.setdefault((scope, h), {})[key] = path
        candidates = [(scope, h, key, path) for (scope, h), keys in groups.items()
                      if len(keys) > 1 for key, path in keys.items()]  # fmt: skip
        sightings: list[Sighting] = []
        at = _us(since)
        for start in range(0, len(candidates), _BATCH):
            chunk = candidates[start : start + _BATCH]
            rows = await self._fields([self._key(c[2]).encode() for c in chunk], "h", "c")
            for (scope, h, key, path), (stored_h, created) in zip(chunk, rows, strict=True):
                if stored_h is not None and stored_h.decode() == h and int(created) >= at:
                    sightings.append(Sighting(scope, path, h, key, _time(created)))
        return group_sightings(sightings, window)

    async def prune(self, *, now: datetime | None = None, batch_size: int = 1000) -> int:
        """Delete up to ``batch_size`` records whose ``expires_at <= now`` that remain.

        Redis deletes every record itself when its TTL runs out, so production needs
        no prune job; this removes records whose ``expires_at`` has passed before their
        TTL (``now`` ``None``: at each server's own time, checked in the script).
        """
        at, deleted = await self._server_us(now), 0
        cutoff = "" if now is None else at
        self._bound()
        # Pipelined EVALSHA does not reload a missing script: load it first (every
        # primary, on a cluster).
        script = self._prune
        script.sha = await _call(self.client.script_load(script.script), self._timeout)
        async for batch in self._batches(f"{self._match}*"):
            rows = await self._fields(batch, "e")
            due = [n for n, (e,) in zip(batch, rows, strict=True) if e is not None and int(e) <= at]
            due = due[: batch_size - deleted]
            if due:
                pipe: Any = self.client.pipeline(transaction=False)
                for name in due:
                    pipe.execute_command("EVALSHA", script.sha, 1, name, cutoff)
                deleted += sum(await _call(pipe.execute(), self._timeout))
            if deleted >= batch_size:
                break
        return deleted

"""Postgres with natural batching: claims, completions, releases and renewals, many per statement.

``SQLStore(url, batching=True)``. Each operation kind has a :class:`~.batching.Batcher`
of its own, with at most one statement in flight, so a kind never waits behind
another's batch; the statements run on the hot path's connections
(:class:`~.postgres.PostgresDriver`: broken connections, timeouts and the wait for a
connection are handled there, as for one-request statements). The statements are
:data:`~.statements.PG_BATCHED`, built from the one ``Table``.

The take-over's compare-and-swap (``replace``) stays one statement per request: it is
rare, and it must compare each row as its caller read it.

A batch of one request runs the one-row statement of :data:`~.statements.PG`, so a
request that arrives alone costs exactly what it costs without batching. This is
not only tidiness: Postgres keeps planning an ``unnest`` statement afresh for each
execution (a custom plan, ~0.3 ms here) where the one-row statement runs its cached
generic plan; in a batch that planning is shared by every request in it.

What this changes against one statement per request:

- **Round trips** per request go down under load, never up: a claim answers a fresh
  key, a replay, a 409 or a 422 from one statement, shared with whatever else was
  queued; a completion or a release is one more, shared too. Claims of one key in a
  batch take one row of the statement (a replay storm of one key is one statement);
  completions, releases and renewals of one key go one per statement, in order.
- **A claim whose waiter was cancelled** after its row was inserted is released at
  once (token-fenced), so the key is free for a retry; the request never ran its
  handler. If the statement's answer itself was lost (the connection broke), the row
  stays in progress until its lease ends, as without batching.
- **A statement that waits on a row lock holds up its whole batch**, and the requests
  queued behind it, up to ``command_timeout``; then the batch fails together (503)
  and the queue goes on. Row locks outlive a statement only in a transaction: a
  transactional request's uncommitted claim of the same scoped key, or the
  application's own transaction on the table. This is why batching is a switch.
- **Deadlocks** between batches of claims cannot happen: rows are inserted in key
  order, in every process alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from .base import RecordStatus
from .batching import Batcher, BatchStats
from .postgres import PostgresDriver
from .statements import PG_BATCHED, Compiled

__all__ = ["BatchingPostgresDriver"]

# (inserted, the row in the way as RECORD_COLUMNS, or None if not visible)
ClaimAnswer = tuple[bool, Sequence[Any] | None]
_NOT_VISIBLE: ClaimAnswer = (False, None)
_INSERTED: ClaimAnswer = (True, None)

# The parameters of each batched statement, from the one-request values dict SQLStore
# builds, in the order of the arrays (PG_BATCHED[name].names is "<alias>_<column>").
_FIELDS = {
    "claim": ("key", "request_hash", "token", "now", "locked_until", "expires_at"),
    "complete": (
        "where_key",
        "where_token",
        "expires_at",
        "response_status",
        "response_headers",
        "response_body",
    ),
    "release": ("where_key", "where_token"),
    "renew": ("where_key", "where_token", "locked_until"),
}


def _columns(values: list[dict[str, Any]], fields: tuple[str, ...]) -> list[list[Any]]:
    return [[v[f] for v in values] for f in fields]


class BatchingPostgresDriver:
    """The ``_Driver`` of :class:`~.sql.SQLStore` on Postgres, batching its hot path.

    Args:
        engine: the store's engine; its hot-path connections come from a
            :class:`PostgresDriver` (``limit`` connections, waits up to ``timeout``).
        max_batch: requests per statement, at most (default 256).
    """

    def __init__(
        self, engine: AsyncEngine, *, limit: int, timeout: float, max_batch: int = 256
    ) -> None:
        self.inner = PostgresDriver(engine, limit=limit, timeout=timeout)
        self._releasing: set[asyncio.Task[int]] = set()
        # Claims of one key share a statement: see _claim_many.
        self._claims: Batcher[dict[str, Any], ClaimAnswer] = Batcher(
            self._claim_many,
            key=_claim_key,
            distinct=False,
            max_size=max_batch,
            orphan=self._orphaned,
        )
        self._fenced: dict[str, Batcher[dict[str, Any], int]] = {
            name: Batcher(
                self._fenced_runner(name),
                key=_fenced_key,
                max_size=max_batch,
                size=_body_size if name == "complete" else None,
            )
            for name in ("complete", "release", "renew")
        }

    @property
    def stats(self) -> dict[str, BatchStats]:
        """Statements sent and operations carried, per kind (``claim``, ``complete``...)."""
        return {"claim": self._claims.stats, **{n: b.stats for n, b in self._fenced.items()}}

    async def claim(self, values: dict[str, Any]) -> ClaimAnswer:
        """(inserted, the row in the way as ``RECORD_COLUMNS``, or None if not visible)."""
        return await self._claims.submit(values)

    async def rowcount(self, name: str, values: dict[str, Any]) -> int:
        batcher = self._fenced.get(name)
        if batcher is None:  # replace: one compare-and-swap per request
            return await self.inner.rowcount(name, values)
        return await batcher.submit(values)

    async def _claim_many(self, batch: list[dict[str, Any]]) -> list[ClaimAnswer]:
        """One statement for the batch; claims of one key are answered from its first.

        Only the first claim of a key goes into the statement. If it inserted, every
        later claim of that key in the batch gets the first one's fresh row as the row
        in the way: what it would read in a statement of its own sent just after (so a
        duplicate is a 409, or a 422 for another body). If it did not, they all get
        the same row in the way, read in the same snapshot, as they would have side by
        side. So a storm of one key (replays, duplicates) costs one statement, not one
        each.
        """
        first: dict[str, dict[str, Any]] = {}
        for values in batch:
            first.setdefault(values["key"], values)
        unique = list(first.values())
        by_key: dict[str, ClaimAnswer] = {}
        if len(unique) == 1:  # alone: the one-row statement (see the module docstring)
            by_key[unique[0]["key"]] = await self.inner.claim(unique[0])
        else:
            stmt = PG_BATCHED["claim"]
            args = _columns(unique, _FIELDS["claim"])
            for row in await self.inner._run(lambda c: c.fetch(stmt.sql, *args)):
                if row[1]:
                    by_key[row[0]] = _INSERTED
                elif row[2] is not None:
                    by_key[row[0]] = (False, tuple(row)[2:])
        answers = []
        for values in batch:
            key = values["key"]
            answer = by_key.get(key, _NOT_VISIBLE)
            if answer[0] and first[key] is not values:
                answer = (False, _claimed_row(first[key]))
            answers.append(answer)
        return answers

    def _fenced_runner(self, name: str) -> Any:
        stmt: Compiled = PG_BATCHED[name]
        fields = _FIELDS[name]

        async def run(batch: list[dict[str, Any]]) -> list[int]:
            if len(batch) == 1:
                return [await self.inner.rowcount(name, batch[0])]
            args = _columns(batch, fields)
            rows = await self.inner._run(lambda c: c.fetch(stmt.sql, *args))
            done = {(row[0], row[1]) for row in rows}
            return [int((v["where_key"], v["where_token"]) in done) for v in batch]

        return run

    def _orphaned(self, values: dict[str, Any], answer: ClaimAnswer) -> None:
        """A claim inserted for a waiter that was cancelled: release it (token-fenced)."""
        if not answer[0]:
            return
        release = {"where_key": values["key"], "where_token": values["token"]}
        task = asyncio.ensure_future(self._fenced["release"].submit(release))
        self._releasing.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task[int]) -> None:
        self._releasing.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a failed release leaves the row to its lease

    async def close(self) -> None:
        await self._claims.close()
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
        for batcher in self._fenced.values():
            await batcher.close()
        await self.inner.close()


def _claimed_row(values: dict[str, Any]) -> tuple[Any, ...]:
    """The row a claim inserted, as ``RECORD_COLUMNS``: in progress, no response."""
    return (
        values["request_hash"], RecordStatus.IN_PROGRESS.value, values["token"],
        values["now"], values["locked_until"], values["expires_at"], None, None, None,
    )  # fmt: skip


def _claim_key(values: dict[str, Any]) -> Any:
    return values["key"]


def _fenced_key(values: dict[str, Any]) -> Any:
    return values["where_key"]


def _body_size(values: dict[str, Any]) -> int:
    return len(values["response_body"]) + len(values["response_headers"])

"""Postgres with natural batching: claims, completions, releases and renewals, many per statement.

On by default on Postgres (``SQLStore(url)``; ``batching=False`` sends one statement
per request). Each operation kind has a :class:`~.batching.Batcher` of its own, with
at most one statement in flight, so a kind never waits behind another's batch; the
statements run on the hot path's connections (:class:`~.postgres.PostgresDriver`:
timeouts and the wait for a connection are handled there, as for one-request
statements). The statements are :data:`~.statements.PG_BATCHED`, built from the one
``Table``.

The take-over's compare-and-swap (``replace``) stays one statement per request: it is
rare, and it must compare each row as its caller read it.

A batch of one request runs the one-row statement (:data:`~.statements.PG_LONE`: that
of :data:`~.statements.PG` with the lock wait below), so a request that arrives alone
costs what it costs without batching; a request that finds its kind idle (nothing
queued, nothing in flight) runs it in its own task, sparing the two loop passes of the
hop to the batcher's task and back, and whoever arrives meanwhile goes to the batcher.
The one-row statement is not only tidiness: Postgres keeps planning an ``unnest``
statement afresh for each execution (a custom plan) where the one-row statement runs
its cached generic plan; in a batch that planning is shared by every request in it.

What this changes against one statement per request, and what keeps it safe:

- **Round trips** per request go down under load, never up: a claim answers a fresh
  key, a replay, a 409 or a 422 from one statement, shared with whatever else was
  queued; a completion or a release is one more, shared too. Claims of one key in a
  batch take one row of the statement (a replay storm of one key is one statement);
  completions, releases and renewals of one key go one per statement, in order.
- **A row held by an open transaction stalls nobody else.** Row locks outlive a
  statement only in a transaction: a transactional request's uncommitted claim of the
  same scoped key, or the application's own transaction on the table. Every statement
  sent for a batch waits at most :data:`LOCK_WAIT` for a row lock (``SET LOCAL
  lock_timeout``, inside the statement); past it the statement rolls back and each of
  its requests asks again alone, in its own task, outside the batcher: a claim then
  meets the held row alone and answers :data:`~.base.BUSY` (409: that key is being
  decided right now, as a transactional claim answers), a completion, release or
  renewal waits for its row alone, as it would without batching.
- **No deadlocks between batches**: every batched statement locks its rows in one
  global order, by key (claims insert in key order; the fenced statements lock with
  ``ORDER BY key FOR UPDATE`` before they change anything), in every process alike.
- **A broken connection costs no batch**: connections the server closed while idle are
  skipped at checkout, and a statement whose connection breaks under it is sent once
  more on another. That is safe because every statement may run twice: completions,
  releases and renewals are fenced by their claim's token, and a claim that meets a
  row with its own token (its first attempt committed, the answer was lost) is
  answered as inserted, never as a 409 for its own request.
- **A statement the store gave up on does not commit later**: the server's
  ``statement_timeout`` (:func:`~.postgres.statement_timeout_ms`) ends it before
  ``command_timeout`` answers 503.
- **A claim whose requester was cancelled** is released by the lifecycle's one path
  (``lifecycle.claim(orphaned=...)`` → :func:`~..lifecycle.release_orphan`, wired by
  the responder and ``Once``). A release of a claim whose statement is still in flight
  waits here until that statement has ended, so its first attempt finds the row if it
  landed: a batch's statement outlives its waiters' cancellation; a lone claim's,
  cut off by its request's cancellation, is watched on the server (its backend in
  ``pg_stat_activity``) until it is done. A waiter cancelled before its batch was
  sent is never sent.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Literal, TypeVar

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.base import BUSY, Busy
from asgi_idempotency.stores.batching import Batcher, BatchStats
from asgi_idempotency.stores.sql.dialect import HotPath, HotPathOptions
from asgi_idempotency.stores.sql.pool import own_claim
from asgi_idempotency.stores.sql.postgres import (
    ONE_STATEMENT,
    PostgresDriver,
    claimed_row,
)
from asgi_idempotency.stores.sql.statements import PG, PG_BATCHED, PG_LONE, Compiled

__all__ = ["DIALECT", "LOCK_WAIT", "BatchingPostgresDriver"]

T = TypeVar("T")

# (inserted, the row in the way as RECORD_COLUMNS, BUSY if a transaction holds it, or
# None if not visible)
ClaimAnswer = tuple[bool, Sequence[Any] | Literal[Busy.BUSY] | None]
_NOT_VISIBLE: ClaimAnswer = (False, None)
_INSERTED: ClaimAnswer = (True, None)
_HELD: ClaimAnswer = (False, BUSY)

# How long a statement carrying other requests may wait for a row lock (seconds). Row
# locks outlive a statement only in an open transaction (a transactional request's
# uncommitted claim, the application's own transaction on the table); such a wait
# would hold up everyone in the batch and queued behind it. A moment, not a timeout:
# long enough for a rival's one-statement commit, short against command_timeout.
LOCK_WAIT = 0.1


class _Again(enum.Enum):
    """A batch's answer for each of its requests when a row lock stopped it: ask again,
    alone, in the request's own task, where a wait is its own."""

    ALONE = "alone"


_ALONE = _Again.ALONE

# Row locks that stopped a statement: held past LOCK_WAIT, or a cycle with another
# transaction (which LOCK_WAIT, below deadlock_timeout, normally ends first).
_LOCKED_OUT = (asyncpg.exceptions.LockNotAvailableError, asyncpg.exceptions.DeadlockDetectedError)

# Whether a server backend is running a statement right now (None: it is gone), and how
# often a claim cut off mid-statement asks it.
_BACKEND_ACTIVE = "SELECT state = 'active' FROM pg_stat_activity WHERE pid = $1"
_WATCH_EVERY = 0.01

# The parameters of each batched statement, from the one-request values dict SQLStore
# builds, in the order of the arrays (PG_BATCHED[name].names is "<alias>_<column>").
_FIELDS = {
    "claim": ("key", "request_hash", "token", "lease_us", "ttl_us", "scope_digest", "route"),
    "complete": (
        "where_key",
        "where_token",
        "ttl_us",
        "response_status",
        "response_headers",
        "response_body",
    ),
    "release": ("where_key", "where_token"),
    "renew": ("where_key", "where_token", "lease_us"),
}


def _lock_wait_ms(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


class BatchingPostgresDriver:
    """The ``_Driver`` of :class:`~.sql.SQLStore` on Postgres, batching its hot path.

    Args:
        engine: the store's engine; its hot-path connections come from a
            :class:`PostgresDriver` (``limit`` connections, waits up to ``timeout``).
        max_batch: requests per statement, at most (default 256).
        lock_wait: seconds a batched statement waits for a row lock before its
            requests are asked again one by one (default :data:`LOCK_WAIT`).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        limit: int,
        timeout: float,
        max_batch: int = 256,
        lock_wait: float = LOCK_WAIT,
    ) -> None:
        self.inner = PostgresDriver(engine, limit=limit, timeout=timeout)
        self.lock_wait = lock_wait
        # A request that finds its kind idle runs its statement in its own task (see
        # claim, rowcount); False sends every request through the batcher (tests of
        # batches).
        self.alone_inline = True
        # Kinds whose lone request runs its statement in its own task right now: who
        # arrives meanwhile goes to the batcher.
        self._inline: set[str] = set()
        # Claims in a statement now, by (key, token): a release of one of them (an
        # orphaned claim's, lifecycle.release_orphan) waits until its statement ended.
        self._landing: dict[tuple[str, str], asyncio.Future[None]] = {}
        # Watches of server backends still running a claim cut off from us (_after_cut).
        self._watching: set[asyncio.Task[None]] = set()
        # Claims of one key share a statement: see _claim_many.
        self._claims: Batcher[dict[str, Any], ClaimAnswer | _Again] = Batcher(
            self._claim_many, key=_claim_key, distinct=False, max_size=max_batch
        )
        self._fenced: dict[str, Batcher[dict[str, Any], int | _Again]] = {
            name: Batcher(
                self._fenced_runner(name),
                key=_fenced_key,
                max_size=max_batch,
                size=_body_size if name == "complete" else None,
            )
            for name in ("complete", "release", "renew")
        }

    @property
    def lock_wait(self) -> float:
        """Seconds a statement sent for a batch waits for a row lock."""
        return self._lock_wait

    @lock_wait.setter
    def lock_wait(self, seconds: float) -> None:
        self._lock_wait = seconds
        self._lock_timeout = _lock_wait_ms(seconds)  # as the statements take it

    @property
    def stats(self) -> dict[str, BatchStats]:
        """Statements sent and operations carried, per kind (``claim``, ``complete``...)."""
        return {"claim": self._claims.stats, **{n: b.stats for n, b in self._fenced.items()}}

    async def claim(self, values: dict[str, Any]) -> ClaimAnswer:
        """(inserted, the row in the way as ``RECORD_COLUMNS``, :data:`~.base.BUSY` if an
        open transaction holds it, or None if not visible)."""
        claims = self._claims
        if claims.idle and "claim" not in self._inline and self.alone_inline:
            # Alone, as a completion is (see rowcount): in this request's own task.
            # Cancelled mid-statement, the statement is cut off from us but may still
            # run on the server and insert; the lifecycle's release of it then waits
            # until the server is done with it (_after_cut).
            self._inline.add("claim")
            _sent_alone(claims.stats)
            backend: list[int] = []
            try:
                return await self._claim_alone(values, backend)
            except asyncio.CancelledError:
                if backend:
                    self._after_cut(values, backend[-1])
                raise
            finally:
                self._inline.discard("claim")
        answer = await claims.submit(values)
        if answer is _ALONE:
            answer = await self._claim_alone(values)
        return answer

    async def rowcount(self, name: str, values: dict[str, Any]) -> int:
        batcher = self._fenced.get(name)
        if batcher is None:  # replace: one compare-and-swap per request
            return await self.inner.rowcount(name, values)
        if name == "release" and self._landing:
            landing = self._landing.get((values["where_key"], values["where_token"]))
            if landing is not None:
                # The claim it releases is in a statement now: releasing before that
                # ends would change nothing, and the claim would land after it.
                await asyncio.wait((landing,))
        if batcher.idle and name not in self._inline and self.alone_inline:
            # Alone: nothing queued, nothing in flight. The one-row statement runs in
            # this request's own task, as without batching, rather than hop to the
            # batcher's task and back (two loop passes, paid one request at a time).
            # Cancelled, it is cancelled as without batching: the statement is fenced
            # by its token, and the responder runs a cancelled completion again. It
            # waits for a held row without a lock wait: only this request waits; who
            # arrives meanwhile goes to the batcher.
            self._inline.add(name)
            _sent_alone(batcher.stats)
            try:
                return await self._send(*_fenced_ops(name, PG[name], [values]))
            finally:
                self._inline.discard(name)
        answer = await batcher.submit(values)
        if answer is _ALONE:
            # Its row is held by an open transaction: this request waits for it alone,
            # as it would without batching (up to the statement timeout).
            answer = await self._send(*_fenced_ops(name, PG[name], [values]))
        return answer

    async def _send(
        self,
        op: Callable[[asyncpg.Connection], Awaitable[T]],
        again: Callable[[asyncpg.Connection], Awaitable[T]] | None = None,
    ) -> T:
        """Run ``op`` on a hot-path connection; once more (``again``, if given) on another
        if that one broke (:meth:`~.pool.KeptConnections._send`). A completion batch's
        second run also asks which rows its first completed (:func:`_completing`)."""
        return await self.inner._send(op, again)

    async def _locked_out(
        self,
        op: Callable[[asyncpg.Connection], Awaitable[T]],
        again: Callable[[asyncpg.Connection], Awaitable[T]] | None = None,
    ) -> T | _Again:
        """``op``'s answer, or :data:`_ALONE` if a row lock held past the lock wait stopped it."""
        try:
            return await self._send(op, again)
        except StoreError as exc:
            if isinstance(exc.__cause__, _LOCKED_OUT):
                return _ALONE
            raise

    def _after_cut(self, values: dict[str, Any], backend: int) -> None:
        """A claim's statement was cut off mid-flight (its waiter was cancelled): until
        the server backend that ran it is done with it, a release of the claim waits."""
        landed = asyncio.get_running_loop().create_future()
        registered = (values["key"], values["token"])
        self._landing[registered] = landed

        def done(task: asyncio.Task[None]) -> None:
            self._watching.discard(task)
            if self._landing.get(registered) is landed:
                del self._landing[registered]
            landed.set_result(None)

        task = asyncio.ensure_future(self._statement_over(backend))
        self._watching.add(task)
        task.add_done_callback(done)

    async def _statement_over(self, backend: int) -> None:
        """Until ``backend`` runs no statement (or is gone), or the statement timeout has
        surely ended it. A failure to ask ends the wait: release_orphan's own retries
        then cover what remains."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.inner._timeout
        while loop.time() < deadline:
            try:
                active = await self.inner._run(lambda c: c.fetchval(_BACKEND_ACTIVE, backend))
            except StoreError:
                return
            if not active:
                return
            await asyncio.sleep(_WATCH_EVERY)

    async def _claim_alone(
        self,
        values: dict[str, Any],
        backend: list[int] | None = None,
        inserted_at: dict[str, Any] | None = None,
    ) -> ClaimAnswer:
        """The one-row claim, waiting a moment at most for a row lock: :data:`_HELD` past it.

        ``backend`` gets the server pid of each connection the statement is sent on.
        """
        stmt = PG_LONE["claim"]
        values["lock_timeout"] = self._lock_timeout
        args = stmt.args(values)

        async def fetch(c: asyncpg.Connection) -> Any:
            if backend is not None:
                backend.append(c.get_server_pid())
            return await c.fetchrow(stmt.sql, *args)

        try:
            row = await self._send(fetch)
        except StoreError as exc:
            if isinstance(exc.__cause__, _LOCKED_OUT):
                # An open transaction holds the key's row: deciding it right now, by
                # definition in progress (409), as a transactional claim answers BUSY.
                return _HELD
            raise
        assert row is not None  # the LEFT JOIN always yields one row
        if row[1]:
            if inserted_at is not None:
                inserted_at[values["key"]] = row[-1]  # the statement's time: the row's
            return _INSERTED
        return _own(values, None if row[2] is None else tuple(row)[2:])

    async def _claim_many(self, batch: list[dict[str, Any]]) -> list[ClaimAnswer | _Again]:
        """One statement for the batch; claims of one key are answered from its first.

        Only the first claim of a key goes into the statement. If it inserted, every
        later claim of that key in the batch gets the first one's fresh row as the row
        in the way: what it would read in a statement of its own sent just after (so a
        duplicate is a 409, or a 422 for another body). If it did not, they all get
        the same row in the way, read in the same snapshot, as they would have side by
        side. So a storm of one key (replays, duplicates) costs one statement, not one
        each. A statement that a held row lock stopped answers every claim it carried
        :data:`_ALONE`: each asks again by itself, so that only the held key waits.
        """
        if len(batch) == 1:  # alone: the one-row statement (see the module docstring)
            values = batch[0]
            registered = (values["key"], values["token"])
            self._landing[registered] = landed = asyncio.get_running_loop().create_future()
            try:
                return [await self._claim_alone(values)]
            finally:
                del self._landing[registered]
                landed.set_result(None)
        first: dict[str, dict[str, Any]] = {}
        for values in batch:
            first.setdefault(values["key"], values)
        unique = list(first.values())
        by_key: dict[str, ClaimAnswer] = {}
        inserted_at: dict[str, Any] = {}  # key -> the database's time that inserted it
        landed = asyncio.get_running_loop().create_future()
        landing = self._landing
        for values in unique:
            landing[(values["key"], values["token"])] = landed
        try:
            if len(unique) == 1:  # alone: the one-row statement (see the module docstring)
                by_key[unique[0]["key"]] = await self._claim_alone(
                    unique[0], inserted_at=inserted_at
                )
            else:
                stmt = PG_BATCHED["claim"]
                args = _arrays(stmt, unique, "claim", self._lock_timeout)
                rows = await self._locked_out(lambda c: c.fetch(stmt.sql, *args))
                if rows is _ALONE:
                    return [_ALONE] * len(batch)
                for row in rows:
                    if row[1]:
                        by_key[row[0]] = _INSERTED
                        inserted_at[row[0]] = row[-1]
                    elif row[2] is not None:
                        by_key[row[0]] = _own(first[row[0]], tuple(row)[2:])
        finally:
            for values in unique:
                del landing[(values["key"], values["token"])]
            landed.set_result(None)
        answers: list[ClaimAnswer | _Again] = []
        for values in batch:
            key = values["key"]
            answer = by_key.get(key, _NOT_VISIBLE)
            if answer[0] and first[key] is not values:
                answer = (False, claimed_row(first[key], inserted_at[key]))
            answers.append(answer)
        return answers

    def _fenced_runner(
        self, name: str
    ) -> Callable[[list[dict[str, Any]]], Awaitable[list[int | _Again]]]:
        stmt: Compiled = PG_BATCHED[name]
        lone: Compiled = PG_LONE[name]

        async def run(batch: list[dict[str, Any]]) -> list[int | _Again]:
            if len(batch) == 1:
                batch[0]["lock_timeout"] = self._lock_timeout
                count = await self._locked_out(*_fenced_ops(name, lone, batch))
                return [count]
            args = _arrays(stmt, batch, name, self._lock_timeout)

            async def fetch(c: asyncpg.Connection) -> list[Any]:
                return list(await c.fetch(stmt.sql, *args))

            again = _completing(batch, fetch) if name == "complete" else None
            rows = await self._locked_out(fetch, again)
            if rows is _ALONE:
                return [_ALONE] * len(batch)
            done = {(row[0], row[1]) for row in rows}
            return [int((v["where_key"], v["where_token"]) in done) for v in batch]

        return run

    async def close(self) -> None:
        if self._watching:
            await asyncio.gather(*self._watching, return_exceptions=True)
        await self._claims.close()
        for batcher in self._fenced.values():
            await batcher.close()
        await self.inner.close()


def _arrays(stmt: Compiled, batch: list[dict[str, Any]], name: str, lock_timeout: str) -> Any:
    """The batched statement's arguments: one array per field, then the lock wait."""
    alias = "v" if name == "claim" else "u"
    params: dict[str, Any] = {
        f"{alias}_{field.removeprefix('where_').replace('now', 'created_at')}": [
            v[field] for v in batch
        ]
        for field in _FIELDS[name]
    }
    params["lock_timeout"] = lock_timeout
    return stmt.args(params)


async def _execute(conn: asyncpg.Connection, stmt: Compiled, values: dict[str, Any]) -> int:
    return _count(await conn.execute(stmt.sql, *stmt.args(values)))


Op = Callable[[asyncpg.Connection], Awaitable[T]]


def _fenced_ops(name: str, stmt: Compiled, one: list[dict[str, Any]]) -> tuple[Op[int], Op[int]]:
    """The one-row fenced statement of ``one[0]``, and what to send again if its
    connection broke: the same, and for a completion that changed nothing, whether its
    first attempt had completed the row (answered 1, as that attempt would have)."""
    values = one[0]

    async def op(c: asyncpg.Connection) -> int:
        return await _execute(c, stmt, values)

    if name != "complete":
        return op, op

    async def fetch(c: asyncpg.Connection) -> list[Any]:
        return [(values["where_key"], values["where_token"])] if await op(c) else []

    completing = _completing(one, fetch)

    async def again(c: asyncpg.Connection) -> int:
        return len(await completing(c))

    return op, again


def _completing(
    batch: list[dict[str, Any]], fetch: Callable[[asyncpg.Connection], Awaitable[list[Any]]]
) -> Callable[[asyncpg.Connection], Awaitable[list[Any]]]:
    """A completion batch sent again: its statement, then, for the rows it did not
    change, which are completed with their own token already: the first attempt landed
    them (no one else holds the token), so they are answered as completed, not lost."""

    async def again(c: asyncpg.Connection) -> list[Any]:
        rows = list(await fetch(c))
        changed = {(row[0], row[1]) for row in rows}
        rest = [v for v in batch if (v["where_key"], v["where_token"]) not in changed]
        if rest:
            check = PG_BATCHED["completed_by"]
            keys = [v["where_key"] for v in rest]
            tokens = [v["where_token"] for v in rest]
            rows += await c.fetch(check.sql, *check.args({"c_key": keys, "c_token": tokens}))
        return rows

    return again


def _sent_alone(stats: BatchStats) -> None:
    """Count a lone request's statement, sent in its own task, as a batch of one."""
    stats.statements += 1
    stats.operations += 1
    stats.largest = max(stats.largest, 1)


def _count(status: str) -> int:
    return int(status.rpartition(" ")[2])  # "UPDATE 1", "DELETE 0"


def _own(values: dict[str, Any], row: Sequence[Any] | None) -> ClaimAnswer:
    """The answer for a claim that met ``row``: inserted if it is this claim's own
    (:func:`~.postgres.own_claim`)."""
    if row is None:
        return _NOT_VISIBLE
    inserted, _ = own_claim(values, row)
    return _INSERTED if inserted else (False, row)


def _claim_key(values: dict[str, Any]) -> Any:
    return values["key"]


def _fenced_key(values: dict[str, Any]) -> Any:
    return values["where_key"]


def _body_size(values: dict[str, Any]) -> int:
    return len(values["response_body"]) + len(values["response_headers"])


def _hot_path(engine: AsyncEngine, options: HotPathOptions) -> HotPath:
    if options.batching:
        return BatchingPostgresDriver(
            engine, limit=options.limit, timeout=options.timeout, max_batch=options.max_batch
        )
    return PostgresDriver(engine, limit=options.limit, timeout=options.timeout)


# The Postgres backend SQLStore reads (dialect.BACKENDS): batching by default.
DIALECT = replace(ONE_STATEMENT, hot_path=_hot_path)

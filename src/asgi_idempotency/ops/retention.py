"""Retention: pruning expired records in bounded batches, once or in the background.

Expired records are already invisible to claims (an expired key behaves as new);
pruning only reclaims the space. Each batch is one short statement that deletes at
most ``batch_size`` rows found through the ``expires_at`` index, so it never holds
a long lock and never runs an unbounded ``DELETE``; claims keep answering meanwhile.

Three ways to run it:

- the command line, e.g. from cron: ``asgi-idempotency prune --batch-size 1000``;
- in process, once: ``await prune_all(store)``;
- in the app's lifespan, periodically: ``async with Pruner(store, interval=300): ...``,
  or wrap the ASGI app in :class:`PruningMiddleware`.

Several processes may prune at once: on Postgres a batch skips rows another is
deleting or taking over.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.lifecycle import RecordState, state
from asgi_idempotency.http.asgi import ASGIApp, Message, Receive, Scope, Send
from asgi_idempotency.ops.periodic import PeriodicTask
from asgi_idempotency.stores.base import RecordStatus, Store, utcnow

__all__ = [
    "ProgressFunc",
    "Pruner",
    "PruningMiddleware",
    "TableStats",
    "count_expired",
    "prune_all",
    "table_stats",
]

logger = logging.getLogger("asgi_idempotency")

# Called after each batch with the number of rows deleted so far and in that batch.
ProgressFunc = Callable[[int, int], None]


async def prune_all(
    store: Store,
    *,
    batch_size: int = 1000,
    now: datetime | None = None,
    dry_run: bool = False,
    progress: ProgressFunc | None = None,
    pause: float = 0.0,
    max_batches: int = 1_000_000,
) -> int:
    """Delete every record expired at ``now``, ``batch_size`` rows per statement.

    Args:
        store: any :class:`~asgi_idempotency.Store`.
        batch_size: rows per delete statement (default 1000). Larger batches finish
            sooner; smaller ones hold row locks and WAL bursts for less time.
        now: the cut-off, an aware datetime. Default: the store's own time at each
            batch (Postgres, MariaDB/MySQL, Redis; the local clock for memory and
            SQLite), so that a host whose clock is ahead prunes nothing early.
        dry_run: count what would go, delete nothing.
        progress: ``progress(done, batch)`` after each batch.
        pause: seconds to sleep between batches (default 0), to leave the database
            and its replicas room under heavy load; never after the last one. A full
            batch may be followed by one more (after a pause) that finds nothing: only
            a batch can tell that no expired rows are left.
        max_batches: a hard stop (default one million batches); what remains is
            pruned by the next run.

    Returns:
        How many records were deleted (or, with ``dry_run``, would be).

    Raises:
        StoreError: the store failed; batches already done stay done.
        ValueError: ``batch_size`` or ``max_batches`` below 1.
    """
    if batch_size < 1 or max_batches < 1:
        raise ValueError("batch_size and max_batches must be at least 1")
    cutoff = now
    if dry_run:
        return await count_expired(store, now=cutoff)
    done = 0
    for batch in range(max_batches):
        # The pause comes before a batch, not after one: the run that stops at
        # max_batches (or a short batch) returns at once instead of sleeping for nothing.
        if batch and pause > 0:
            await asyncio.sleep(pause)
        deleted = await store.prune(now=cutoff, batch_size=batch_size)
        done += deleted
        if progress is not None:
            progress(done, deleted)
        # A short batch means nothing expired is left (bar rows a concurrent claim
        # is taking over right now, which will not be expired when it is done).
        if deleted < batch_size:
            break
    return done


async def count_expired(store: Store, *, now: datetime | None = None) -> int:
    """How many records have expired at ``now`` (default: the store's time) and await pruning.

    Raises:
        StoreError: the store failed.
    """
    return await store.count_expired(now=now)


@dataclass(frozen=True, slots=True)
class TableStats:
    """What ``asgi-idempotency stats`` reports, at ``now``.

    ``live`` counts unexpired rows by status; ``expired`` counts rows past their
    retention (of any status) that a prune would delete. ``abandoned`` counts live
    in-progress rows whose lease ended: their worker died or hangs, and the next
    retry with the same key takes them over. ``oldest_in_progress`` is the
    ``created_at`` of the oldest live in-progress row.
    """

    now: datetime
    live: Mapping[str, int] = field(default_factory=dict)
    expired: int = 0
    abandoned: int = 0
    oldest_in_progress: datetime | None = None

    @property
    def total(self) -> int:
        return sum(self.live.values()) + self.expired


async def table_stats(store: Store, *, now: datetime | None = None) -> TableStats:
    """Row counts for operators: one pass over the table (an admin query, not for the hot path).

    Raises:
        StoreError: the store failed (unreachable, or the table is missing).
    """
    cutoff = utcnow() if now is None else now  # reported; the store counts at its own time
    live: dict[str, int] = {}
    expired = abandoned = 0
    oldest: datetime | None = None
    for bucket in await store.buckets(now=now):
        current = state(bucket.status, expired=bucket.expired, lease_over=bucket.lease_over)
        if current is RecordState.EXPIRED:
            expired += bucket.count
            continue
        live[bucket.status.value] = live.get(bucket.status.value, 0) + bucket.count
        if current is RecordState.ABANDONED:
            abandoned += bucket.count
        if bucket.status is RecordStatus.IN_PROGRESS and bucket.oldest_created_at is not None:
            oldest = min(oldest or bucket.oldest_created_at, bucket.oldest_created_at)
    return TableStats(
        now=cutoff, live=live, expired=expired, abandoned=abandoned, oldest_in_progress=oldest
    )


class Pruner(PeriodicTask):
    """Prunes expired records every ``interval`` seconds in a background task.

    Use as an async context manager around the app's lifespan::

        @asynccontextmanager
        async def lifespan(app):
            async with Pruner(store, interval=300):
                yield
            await store.close()

    The loop is :class:`~asgi_idempotency.ops.periodic.PeriodicTask`'s (``start``,
    ``stop``, ``wake``, ``runs``). The first run starts at once (deploys more frequent
    than ``interval`` still prune); each later one after ``interval`` seconds,
    ±``jitter`` of it, so that many workers spread out. A failed run is logged
    (``idempotency.prune_failed``) and retried at the next interval; it never stops the
    loop or the app. The loop ends when the context exits.

    Args:
        store: the store to prune; the pruner neither opens nor closes it.
        interval: seconds between runs (default 300).
        batch_size, pause, max_batches: as for :func:`prune_all`.
        jitter: fraction of ``interval`` to randomise each wait by (default 0.1).
        clock: returns the cut-off, an aware UTC time; default ``None``: the store's
            own time (see :func:`prune_all`).
    """

    def __init__(
        self,
        store: Store,
        *,
        interval: float = 300.0,
        batch_size: int = 1000,
        pause: float = 0.0,
        max_batches: int = 1_000_000,
        jitter: float = 0.1,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        super().__init__(store)
        self.store: Store = store
        self.interval = interval
        self.batch_size = batch_size
        self.pause = pause
        self.max_batches = max_batches
        self.jitter = jitter
        self.clock = clock
        self.pruned = 0  # rows deleted since start

    async def run_once(self) -> int:
        """One complete prune at the current time; returns how many rows went."""
        started = time.perf_counter()
        deleted = await prune_all(
            self.store,
            batch_size=self.batch_size,
            now=None if self.clock is None else self.clock(),
            pause=self.pause,
            max_batches=self.max_batches,
        )
        self.pruned += deleted
        if deleted:
            elapsed = round(time.perf_counter() - started, 3)
            logger.info(
                "idempotency.pruned pruned=%d elapsed_s=%s",
                deleted,
                elapsed,
                extra={"event": "idempotency.pruned", "pruned": deleted, "elapsed_s": elapsed},
            )
        return deleted

    def failed(self, exc: Exception) -> None:
        # The reason on the line itself: with plain logging, the fields in ``extra`` are
        # not printed. Store messages name no key or body.
        logger.warning(
            "idempotency.prune_failed error=%s detail=%s -- the next run retries; "
            "check that the store is reachable",
            type(exc).__name__,
            str(exc).replace("\n", " "),
            extra={"event": "idempotency.prune_failed", "error": type(exc).__name__},
            exc_info=not isinstance(exc, StoreError),
        )

    def next_wait(self) -> float:
        return self.interval * random.uniform(1 - self.jitter, 1 + self.jitter)


class PruningMiddleware:
    """Runs a :class:`Pruner` for the app's lifespan; every other scope passes straight through.

    ``Middleware(PruningMiddleware, store=store, interval=300)`` in Starlette or
    ``app.add_middleware(...)`` in FastAPI. The pruner starts once the app reports
    startup complete and stops before the app sees shutdown, so an app that closes
    its store on shutdown never closes it under a running batch. Servers without
    lifespan support never start it.

    The keyword arguments are :class:`Pruner`'s.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        interval: float = 300.0,
        batch_size: int = 1000,
        pause: float = 0.0,
        max_batches: int = 1_000_000,
        jitter: float = 0.1,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.pruner_kwargs: dict[str, Any] = {
            "interval": interval,
            "batch_size": batch_size,
            "pause": pause,
            "max_batches": max_batches,
            "jitter": jitter,
            "clock": clock,
        }
        Pruner(store, **self.pruner_kwargs)  # validate now, not at startup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        pruner = Pruner(self.store, **self.pruner_kwargs)

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await pruner.start()
            await send(message)

        async def lifespan_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await pruner.stop()
            return message

        try:
            await self.app(scope, lifespan_receive, lifespan_send)
        finally:
            await pruner.stop()

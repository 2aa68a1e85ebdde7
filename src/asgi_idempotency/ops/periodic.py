"""One background task that runs a job every so often, for the app's lifespan.

:class:`~asgi_idempotency.ops.retention.Pruner` and
:class:`~asgi_idempotency.ops.audit.AuditExporter` are both "prepare the store, then run
once, log a failure and go on, wait, again, until stopped": that loop, its task and
its async context live here once. Each says only what one run does
(:meth:`PeriodicTask.run_once`), how a failed run is logged and how long to wait.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from types import TracebackType
from typing import Self

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.base import PreparedStore

__all__ = ["PeriodicTask"]


class PeriodicTask:
    """Runs :meth:`run_once` at once and then after each :meth:`next_wait` seconds, in one
    task, from :meth:`start` (or entering the async context) to :meth:`stop` (or leaving
    it). A failed run goes to :meth:`failed` and never ends the loop.

    ``runs`` counts completed runs, failed or not (for tests and health checks).
    """

    #: The task's name (asyncio's, shown in task dumps).
    task_name = "asgi-idempotency-periodic"

    def __init__(self, store: object) -> None:
        self.store = store
        self.runs = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def run_once(self) -> object:
        """One run (what the subclass does)."""
        raise NotImplementedError

    def failed(self, exc: Exception) -> None:
        """A run raised ``exc``: log it (the next run retries)."""
        raise NotImplementedError

    def next_wait(self) -> float:
        """Seconds until the next run."""
        raise NotImplementedError

    async def _loop(self) -> None:
        if isinstance(self.store, PreparedStore):
            # In the app's own lifespan this starts before the middleware prepares the
            # store: on the SQLite default the table may not exist yet. Preparing is
            # idempotent and safe beside the middleware's; a failure shows in the run.
            with suppress(StoreError):
                await self.store.prepare()
        while True:  # bounded by the context: stop() cancels it
            try:
                await self.run_once()
            except Exception as exc:
                self.failed(exc)
            self.runs += 1
            self._wake.clear()
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.next_wait())

    def wake(self) -> None:
        """Start the next run now instead of at the end of the wait."""
        self._wake.set()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=self.task_name)

    async def stop(self) -> None:
        """Cancel the loop (an in-flight run is abandoned)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

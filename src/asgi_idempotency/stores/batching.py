"""Natural batching: a queue of requests, one statement for all of them, an answer for each.

While a statement is in flight, arriving operations queue; when it returns, everything
queued (up to ``max_size``, and ``max_bytes`` of payload) goes as the next statement.
There is no timer: a request that arrives while nothing is in flight is sent at once,
so one request at a time pays what it paid without batching, and under load a
statement's round trip and its commit (its WAL flush) are shared by every request it
carries. Every request is answered only after the statement carrying it returned, so
what was committed for it is committed before it hears so.

Rules, each with a test in ``tests/stores/test_batching.py``:

- **One operation per key per statement.** A second operation on a key already in the
  batch being formed waits for the next statement, in arrival order, so it sees what
  the first committed. A batcher made with ``distinct=False`` takes every request and
  leaves duplicates to its ``run``, which must answer each as if it came after the
  first (the Postgres claims do: ``postgres_batched.py``).
- **A statement that fails fails every request it carried**, each with its own
  :class:`StoreError`. A statement is atomic, so nothing of it stays behind.
- **A waiter's cancellation never cancels the statement.** The statement runs in the
  batcher's task; a cancelled waiter's answer is dropped (and handed to ``orphan``, so
  that a claim inserted for a request that is gone can be released at once rather than
  wait for its lease). A waiter cancelled before its batch was sent is never sent.
  The one exception is opt-in, ``inline=``: a request that arrives while nothing is
  queued or in flight is sent by that callable in its own waiter's task (without the
  batcher's task, future and the loop pass its answer would take), so cancelling that
  waiter cancels its statement, exactly as without batching; what arrives meanwhile
  queues and goes in the batcher's task as always (``tests/stores/test_batching_inline.py``).
"""

from __future__ import annotations

import asyncio
import copy
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from asgi_idempotency.core.errors import StoreError

__all__ = ["BatchStats", "Batcher"]

Req = TypeVar("Req")
Res = TypeVar("Res")

# A request and the future its waiter awaits.
_Entry = tuple[Req, "asyncio.Future[Res]"]


@dataclass(slots=True)
class BatchStats:
    """What a batcher sent: statements, the operations they carried, the largest one."""

    statements: int = 0
    operations: int = 0
    largest: int = 0

    @property
    def per_statement(self) -> float:
        """Operations per statement, on average (0 before the first statement)."""
        return self.operations / self.statements if self.statements else 0.0


class Batcher(Generic[Req, Res]):
    """Send queued requests as one statement: ``await batcher.submit(request)``.

    Args:
        run: sends one statement for a batch; returns one answer per request, in
            order. Raises :class:`StoreError` when the statement fails.
        key: what makes two requests the same row.
        distinct: at most one request per key per batch (default); ``False`` lets
            ``run`` have them all and answer the repeats itself.
        max_size: requests per statement, at most (default 256).
        size: the payload of a request in bytes, for ``max_bytes`` (default: 0).
        max_bytes: payload per statement, at most; a single larger request still
            goes, alone (default 8 MiB).
        orphan: called with a request and its answer when its waiter was cancelled
            while the statement ran (it must not raise).
        inline: sends one request alone, in the caller's task, when it finds the
            batcher idle (default ``None``: every request goes by ``run``, in the
            batcher's task; see the module docstring). Raises as ``run`` does.
    """

    def __init__(
        self,
        run: Callable[[list[Req]], Awaitable[Sequence[Res]]],
        *,
        key: Callable[[Req], Hashable],
        distinct: bool = True,
        max_size: int = 256,
        size: Callable[[Req], int] | None = None,
        max_bytes: int = 8 << 20,
        orphan: Callable[[Req, Res], None] | None = None,
        inline: Callable[[Req], Awaitable[Res]] | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self._run = run
        self._key = key
        self._distinct = distinct
        self._max_size = max_size
        self._size = size
        self._max_bytes = max_bytes
        self._orphan = orphan
        self._inline = inline
        self._inline_busy = False  # a request runs inline now: what arrives queues
        self._queue: deque[_Entry[Req, Res]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.stats = BatchStats()

    async def submit(self, request: Req) -> Res:
        """Queue ``request``; return its answer once the statement carrying it returned.

        Raises:
            StoreError: the statement failed, or the batcher is closed.
        """
        if self._closed:
            raise StoreError("the store is closed")
        inline = self._inline
        if inline is not None and not self._inline_busy and self._task is None:
            # Alone, in the caller's task (here, not in a coroutine of its own: this is
            # every lone request's path); arrivals meanwhile queue behind it.
            self._inline_busy = True
            stats = self.stats
            stats.statements += 1
            stats.operations += 1
            if not stats.largest:
                stats.largest = 1
            try:
                return await inline(request)
            except StoreError:
                raise
            except Exception as exc:
                raise _bug(exc) from exc
            finally:
                self._inline_busy = False
                if self._queue and self._task is None:
                    self._task = asyncio.get_running_loop().create_task(self._drain())
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Res] = loop.create_future()
        self._queue.append((request, future))
        if self._task is None and not self._inline_busy:
            self._task = loop.create_task(self._drain())
        # Cancelling the waiter cancels only this future; the statement goes on.
        return await future

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing in flight: a request submitted now would go alone."""
        return self._task is None and not self._queue and not self._inline_busy

    async def close(self) -> None:
        """Refuse new requests; wait for what is queued and in flight to be answered."""
        self._closed = True
        if self._task is not None:
            await asyncio.shield(self._task)

    def _take(self) -> list[_Entry[Req, Res]]:
        """The next batch: queued requests in order, one per key, within the bounds."""
        queue = self._queue
        batch: list[_Entry[Req, Res]] = []
        seen: set[Hashable] = set()
        held: list[_Entry[Req, Res]] = []
        weight = 0
        while queue and len(batch) < self._max_size:
            entry = queue.popleft()
            request, future = entry
            if future.done():  # its waiter was cancelled before it was sent: drop it
                continue
            key = self._key(request)
            if key in seen and self._distinct:
                held.append(entry)  # the same key again: next statement, after this one
                continue
            if self._size is not None:
                weight += self._size(request)
                if batch and weight > self._max_bytes:
                    queue.appendleft(entry)
                    break
            seen.add(key)
            batch.append(entry)
        queue.extendleft(reversed(held))
        return batch

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._take()
                if not batch:
                    continue
                stats = self.stats
                stats.statements += 1
                stats.operations += len(batch)
                stats.largest = max(stats.largest, len(batch))
                try:
                    answers = await self._run([request for request, _ in batch])
                except StoreError as exc:
                    _fail(batch, exc)
                    continue
                except Exception as exc:
                    # A bug, not the store: each waiter raises it (a logged 500), never
                    # a StoreError that would pass for an outage (503).
                    for _request, future in batch:
                        if not future.done():
                            future.set_exception(_bug(exc))
                    continue
                except BaseException:
                    # The batcher's own task was cancelled (the loop is shutting down):
                    # nobody queued here will be answered otherwise.
                    _fail(batch, StoreError("the batch was cancelled"))
                    _fail(list(self._queue), StoreError("the batch was cancelled"))
                    self._queue.clear()
                    raise
                if len(answers) != len(batch):
                    _fail(batch, StoreError(f"{len(answers)} answers for {len(batch)} requests"))
                    continue
                for (request, future), answer in zip(batch, answers, strict=True):
                    if not future.done():
                        future.set_result(answer)
                    elif self._orphan is not None:
                        self._orphan(request, answer)
        finally:
            self._task = None


def _fail(
    batch: Sequence[_Entry[Req, Res]], exc: StoreError, *, cause: BaseException | None = None
) -> None:
    # Each waiter raises its own exception object: one shared instance would collect
    # every waiter's traceback. A copy keeps the failure's type and detail (a missing
    # table stays SchemaMissing, whose fix is a migration, not a retry).
    for _request, future in batch:
        if not future.done():
            error = copy.copy(exc)
            error.__cause__ = cause if cause is not None else (exc.__cause__ or exc)
            future.set_exception(error)


def _bug(exc: Exception) -> RuntimeError:
    """What a waiter raises when a statement failed in a way that is not the store's:
    a bug, which must surface as a logged 500, never as a StoreError (a 503 that would
    pass for an outage)."""
    error = RuntimeError(f"batched statement failed: {exc!r}")
    error.__cause__ = exc
    return error

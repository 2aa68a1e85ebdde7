"""The hot path's kept connections, and what a statement sent twice means.

SQLAlchemy owns the pool; the hot path keeps some of its connections checked out
between statements (:class:`KeptConnections`), for any driver: Postgres's asyncpg
(:mod:`.postgres`) and MariaDB/MySQL's asyncmy (:mod:`.mysql`) each subclass it, and
neither subclasses the other. A statement whose connection broke under it is sent
once more on another (:meth:`KeptConnections._send`); :func:`own_claim` and
:data:`LANDED` say what its second answer means when the first had landed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import PoolProxiedConnection

# greenlet_spawn: the same bridge AsyncEngine.raw_connection() uses. Returning a
# connection to the pool may do I/O (closing an overflow connection), which the
# async pool runs through it; without it there is no public async check-in.
from sqlalchemy.util import greenlet_spawn

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.base import RecordStatus
from asgi_idempotency.stores.errors import ErrorBoundary

__all__ = ["LANDED", "KeptConnections", "own_claim"]

T = TypeVar("T")


class _NoConnection(Exception):
    """A hot-path statement waited ``command_timeout`` for a connection in vain."""


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(_NoConnection())


class KeptConnections:
    """Driver connections from SQLAlchemy's pool, kept by the hot path between statements.

    Up to ``limit`` connections stay checked out of SQLAlchemy's pool, idle in a
    stack of our own between statements: taking one back costs no greenlet hop and
    no pool wait, which was most of what a one-statement request paid for its
    checkout (and the driver's prepared statements stay warm). Past ``limit`` a
    statement waits, first come first served, for one to be handed back, up to
    ``timeout`` seconds. The rest of SQLAlchemy's pool stays free for transactional
    requests, ``get``, ``prune`` and the application's Core work. A connection that
    breaks takes every idle one with it, as SQLAlchemy's pool does on a disconnect:
    they share the cause, and each would otherwise fail one more request.

    Driver-neutral: a driver's hot path (:class:`~.postgres.PostgresDriver` for
    asyncpg, :class:`~.mysql.MySQLDriver` for asyncmy) subclasses it, names its error
    boundary (:attr:`errors`), and says how to run one operation on a connection
    (:meth:`_run`) and whether the driver knows a connection closed (:meth:`_gone`).
    """

    # The driver's error boundary, named by each driver's hot path.
    errors: ErrorBoundary

    def __init__(self, engine: AsyncEngine, *, limit: int, timeout: float) -> None:
        self._engine = engine
        self._limit = max(1, limit)
        self._timeout = timeout
        self._held = 0  # checked out of SQLAlchemy's pool by us: idle or in use
        self._idle: list[PoolProxiedConnection] = []
        # FIFO waiters; a waiter is handed a connection, or None: "open a new one".
        self._waiters: deque[asyncio.Future[PoolProxiedConnection | None]] = deque()
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()

    async def _open(self) -> PoolProxiedConnection:
        self._held += 1
        try:
            return await self._engine.raw_connection()
        except BaseException as exc:
            self._release_slot()
            if isinstance(exc, self.errors.errors):
                raise self.errors.translate(exc) from exc
            raise

    def _release_slot(self) -> None:
        """One connection fewer is held: the longest waiter may open a new one."""
        self._held -= 1
        self._wake(None)

    async def _checkout(self) -> PoolProxiedConnection:
        while self._idle:
            idle = self._idle.pop()
            if not self._gone(idle):
                return idle
            # The server closed it while it was idle (idle_session_timeout, a restart,
            # pg_terminate_backend, a pooler): asyncpg has read its end, so it would only
            # fail the statement given to it. Drop it and take the next.
            idle.invalidate()
            self._close_soon(idle)
            self._held -= 1  # no waiter to wake: they are handed connections before idle
        if self._held < self._limit:
            return await self._open()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[PoolProxiedConnection | None] = loop.create_future()
        self._waiters.append(waiter)
        # A timer on the future rather than asyncio.timeout(): no cancellation of this
        # task to set up and undo, on a path every request takes when the pool is busy.
        timer = loop.call_later(self._timeout, _expire, waiter)
        try:
            fairy = await waiter
        except BaseException as exc:
            # Timed out or cancelled: pass on what was handed over in the same moment
            # (a connection or a free slot), or it would be lost to every later waiter.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()
                if handed is None:
                    self._wake(None)
                else:
                    self._checkin(handed)
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            if isinstance(exc, _NoConnection):
                raise StoreError(f"no connection free within {self._timeout}s") from None
            raise
        finally:
            timer.cancel()
        return fairy if fairy is not None else await self._open()

    def _gone(self, fairy: PoolProxiedConnection) -> bool:
        """Whether the driver knows the connection closed (it read the server's end): no I/O."""
        raise NotImplementedError

    def _wake(self, fairy: PoolProxiedConnection | None) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(fairy)
                return True
        return False

    def _checkin(self, fairy: PoolProxiedConnection) -> None:
        if self._closed:
            self._held -= 1
            self._close_soon(fairy)
        elif not self._wake(fairy):
            self._idle.append(fairy)

    def _close_soon(self, fairy: PoolProxiedConnection) -> None:
        # Returning a connection to SQLAlchemy's pool needs an await; where the caller
        # cannot wait (cancelled, or a sync path) it happens in a task of its own.
        task = asyncio.ensure_future(greenlet_spawn(fairy.close))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _discard(self, fairy: PoolProxiedConnection, broken: BaseException) -> None:
        victims = [fairy, *self._idle]
        self._idle.clear()
        for victim in victims:
            # Invalidate outside the greenlet: asyncpg is then terminated at once rather
            # than closed gracefully, which could keep a 503 waiting on a dead socket.
            victim.invalidate(broken)
            await greenlet_spawn(victim.close)
            self._release_slot()  # each freed slot lets one waiter connect afresh

    async def _run(self, op: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``op`` on a kept connection, dropping the connection if it broke; the
        driver's failure comes out as :class:`StoreError` (:attr:`errors`)."""
        raise NotImplementedError

    async def _send(
        self, op: Callable[[Any], Awaitable[T]], again: Callable[[Any], Awaitable[T]] | None = None
    ) -> T:
        """Run ``op`` on a hot-path connection; once more (``again``, if given) on another
        if that one broke.

        A connection the server closed while it was idle is skipped at checkout when
        the driver has read its end, but one can break under a statement (ended a
        moment before, read out of turn, or cut on the way): then the statement's fate
        is unknown, and every hot-path statement may run twice. Completions, releases
        and renewals are fenced by their claim's token (a second run changes nothing a
        first that landed had not; ``again`` asks whether the first landed where the
        second's answer would not say so), and a claim that meets its own row is
        answered as inserted (:func:`own_claim`). A timeout is not sent again: the
        server was slow, not gone, and a second wait would double the client's.
        """
        try:
            return await self._run(op)
        except StoreError as exc:
            cause = exc.__cause__
            if cause is None or isinstance(cause, TimeoutError) or not self.errors.breaks(cause):
                raise
        return await self._run(op if again is None else again)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for fairy in idle:
            self._held -= 1
            await greenlet_spawn(fairy.close)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


_US = timedelta(microseconds=1)
_IN_PROGRESS = RecordStatus.IN_PROGRESS.value


def _is_own(values: dict[str, Any], row: Sequence[Any]) -> bool:
    # Exactly what this claim writes: its token, its fingerprint, its lease and its
    # retention (measured from its created_at: the database's clock wrote them), in
    # progress with no response (a token alone would not do: the regenerated-key
    # detector's markers all share one).
    return bool(
        row[2] == values["token"]
        and row[0] == values["request_hash"]
        and row[1] == _IN_PROGRESS
        and row[6] is None
        and (row[4] - row[3]) // _US == values["lease_us"]
        and (row[5] - row[3]) // _US == values["ttl_us"]
    )


def own_claim(
    values: dict[str, Any], row: Sequence[Any] | None
) -> tuple[bool, Sequence[Any] | None]:
    """The answer for a claim that met ``row``: inserted if it is this claim's own.

    A claim sent twice (its connection broke under the first, which had committed:
    :meth:`PostgresDriver._send`) meets the row it inserted; anything else is a row in
    the way (None: not visible).
    """
    if row is not None and _is_own(values, row):
        return True, None
    return False, row


def _completed_by_us(values: dict[str, Any], row: Sequence[Any]) -> bool:
    # Completed under this claim's token: only its owner completes with it, so the
    # first attempt landed. Not a lost claim.
    return bool(row[2] == values["where_token"] and row[1] == RecordStatus.COMPLETED.value)


def _replaced_by_us(values: dict[str, Any], row: Sequence[Any]) -> bool:
    # The take-over's first attempt swapped the row for exactly this claim's.
    return _is_own(values, row)


# For a fenced statement sent again that changed nothing: whether the row (read by key)
# shows that its first attempt landed. A release or renewal sent again answers as its
# first would have (a renewal matches again, a release finds nothing: its claim is gone
# either way).
LANDED: dict[str, Callable[[dict[str, Any], Sequence[Any]], bool]] = {
    "complete": _completed_by_us,
    "replace": _replaced_by_us,
}

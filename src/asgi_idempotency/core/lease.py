"""Lease renewal while a claimed handler runs: the live owner never loses its claim.

A timer, not a task, until the first renewal is due, so a handler that finishes
within a third of its lease costs no renewal statement and no task. The timer is
shared: :class:`LeaseRenewals` keeps a middleware's running claims in order of
their first due renewal, under one timer per renewal interval, so a request adds
and removes a dict entry instead of arming and cancelling a timer of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Protocol

from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.observing import Observing
from asgi_idempotency.core.store import RecordStatus, Store, StoredResponse

__all__ = ["LeaseRenewal", "LeaseRenewals", "Renewal", "complete_later"]


class Renewal(Protocol):
    """What :meth:`LeaseRenewals.start` returns: stopped with the claim's token."""

    def stop(self, token: str) -> None: ...


class LeaseRenewal:
    """Renews one claim's lease every ``every`` seconds until :meth:`stop`."""

    __slots__ = ("_clock", "_every", "_handle", "_key", "_lease", "_observer", "_route",
                 "_store", "_token")  # fmt: skip

    def __init__(
        self,
        store: Store,
        key: str,
        token: str,
        *,
        lease: timedelta,
        every: float,
        clock: Callable[[], datetime],
        observer: Observing,
        route: str,
    ) -> None:
        self._store, self._key, self._token = store, key, token
        self._lease, self._every, self._clock = lease, every, clock
        self._observer, self._route = observer, route
        self._handle: asyncio.TimerHandle | asyncio.Task[None] | None = (
            asyncio.get_running_loop().call_later(every, self._start)
        )

    def _start(self) -> None:
        self._handle = asyncio.ensure_future(self._renew())

    async def _renew(self) -> None:
        while True:
            try:
                owned = await self._store.renew(
                    self._key, self._token, now=self._clock(), lease=self._lease
                )
            except StoreError as exc:
                owned = True  # transient; the next tick tries again before the lease ends
                self._observer.log(
                    logging.WARNING, "idempotency.renew_failed", self._route, self._key,
                    error=type(exc).__name__,
                )  # fmt: skip
            if not owned:
                self._observer.log(
                    logging.ERROR, "idempotency.claim_lost", self._route, self._key, phase="renew"
                )
                return
            await asyncio.sleep(self._every)

    def stop(self, token: str | None = None) -> None:
        """Stop renewing (``token`` is this renewal's own; accepted as LeaseRenewals' is)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


# A claim waiting for its first renewal: (loop time it is due, key, lease, route).
_Pending = tuple[float, str, timedelta, str]


class _Queue:
    """The waiting claims with one renewal interval, in the order they started.

    They share one interval and the loop's clock only moves forward, so that order is
    also the order of their due times: the timer only ever needs the first one.
    """

    __slots__ = ("every", "handle", "loop", "owner", "pending")

    def __init__(self, owner: LeaseRenewals, loop: asyncio.AbstractEventLoop, every: float) -> None:
        self.owner, self.loop, self.every = owner, loop, every
        self.pending: dict[str, _Pending] = {}  # by token
        self.handle: asyncio.TimerHandle | None = None

    def stop(self, token: str) -> None:
        """Stop renewing the claim ``token`` (a dict entry, or its renewal task)."""
        if self.pending.pop(token, None) is None:
            task = self.owner.running.pop(token, None)
            if task is not None:
                task.cancel()

    def fire(self) -> None:
        """Start a renewal task for every claim now due; re-arm for the next one."""
        self.handle = None
        pending = self.pending
        now = self.loop.time()
        while pending:
            token = next(iter(pending))
            due, key, lease, route = pending[token]
            if due > now:
                # Usually the claim the timer was armed for has finished since: the
                # timer moves on to the oldest claim still running.
                self.handle = self.loop.call_at(due, self.fire)
                return
            del pending[token]
            renewal = self.owner.renew(key, token, lease, self.every, route)
            self.owner.running[token] = self.loop.create_task(renewal)


class LeaseRenewals:
    """Renews the leases of one middleware's running claims.

    :meth:`start` when a claimed handler starts, ``stop(token)`` on what it returns
    when the handler ends. A claim still running ``every`` seconds after it started
    gets a renewal task of its own, which renews the lease every ``every`` seconds
    until it is stopped or the claim is found lost, as :class:`LeaseRenewal` does.

    The timers belong to one event loop at a time. A claim started on another loop
    while this one still has claims running gets a :class:`LeaseRenewal` of its own
    (correct, only not shared); once the old loop is closed or idle, the next claim
    moves the schedule over.
    """

    __slots__ = ("_clock", "_loop", "_observer", "_queues", "_store", "running")

    def __init__(self, store: Store, *, clock: Callable[[], datetime], observer: Observing) -> None:
        self._store, self._clock, self._observer = store, clock, observer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[float, _Queue] = {}  # by renewal interval
        self.running: dict[str, asyncio.Task[None]] = {}  # renewal tasks, by token

    def start(self, key: str, token: str, lease: timedelta, every: float, route: str) -> Renewal:
        """Renew claim ``token`` on ``key`` every ``every`` seconds from now until stopped."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop and not self._move_to(loop):
            return LeaseRenewal(
                self._store, key, token, lease=lease, every=every, clock=self._clock,
                observer=self._observer, route=route,
            )  # fmt: skip
        queue = self._queues.get(every)
        if queue is None:
            queue = self._queues[every] = _Queue(self, loop, every)
        due = loop.time() + every
        queue.pending[token] = (due, key, lease, route)
        if queue.handle is None:
            queue.handle = loop.call_at(due, queue.fire)
        return queue

    def _move_to(self, loop: asyncio.AbstractEventLoop) -> bool:
        old = self._loop
        if old is not None and not old.is_closed() and self._busy():
            return False
        # Whatever the old loop still held can never run again, or there is nothing.
        self._loop, self._queues, self.running = loop, {}, {}
        return True

    def _busy(self) -> bool:
        return bool(self.running) or any(q.pending for q in self._queues.values())

    async def renew(self, key: str, token: str, lease: timedelta, every: float, route: str) -> None:
        """Renew the lease now and every ``every`` seconds, until cancelled or lost."""
        try:
            while True:
                try:
                    owned = await self._store.renew(key, token, now=self._clock(), lease=lease)
                except StoreError as exc:
                    owned = True  # transient; the next tick tries again before the lease ends
                    self._observer.log(
                        logging.WARNING, "idempotency.renew_failed", route, key,
                        error=type(exc).__name__,
                    )  # fmt: skip
                if not owned:
                    self._observer.log(
                        logging.ERROR, "idempotency.claim_lost", route, key, phase="renew"
                    )
                    return
                await asyncio.sleep(every)
        finally:
            if self.running.get(token) is asyncio.current_task():
                del self.running[token]


async def complete_later(
    store: Store, renewals: LeaseRenewals, observer: Observing, key: str, token: str,
    stored: StoredResponse, now: datetime, *, ttl: timedelta, lease: timedelta, every: float,
    route: str,
) -> None:  # fmt: skip
    """Try again, for the lease's life, a completion that the store failed.

    The one retry of a failed completion, for HTTP requests and ``Once`` calls alike.
    The attempts follow :func:`.lifecycle.completion_backoff` (backoff from 0.1 s to
    2 s apart, within one ``lease`` of the failure); meanwhile the claim's lease is
    renewed every ``every`` seconds, so that while the store answers nobody takes the
    claim over. A store that is down takes the renewals too: the lease then ends one
    ``lease`` after its last renewal, so no attempt starts past one ``lease`` from now.
    Each failure is logged (WARNING), and giving up (ERROR); the claim then stays in
    progress until its lease ends, as after a crash. Store errors never escape.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + lease.total_seconds()
    renewal = renewals.start(key, token, lease, every, route)
    attempts = 1  # the one that failed
    try:
        for delay in lifecycle.completion_backoff(lease):
            if loop.time() + delay >= deadline:
                break  # the claim may be taken over by then
            await asyncio.sleep(delay)
            attempts += 1
            try:
                owned = await store.complete(key, token, stored, now=now, ttl=ttl)
            except StoreError as exc:
                observer.log(
                    logging.WARNING, "idempotency.complete_retry_failed", route, key,
                    attempt=attempts, error=type(exc).__name__,
                )  # fmt: skip
                continue
            if owned or await _landed(store, key, token):
                observer.log(
                    logging.WARNING, "idempotency.complete_recovered", route, key,
                    attempt=attempts,
                )  # fmt: skip
            else:
                observer.log(logging.ERROR, "idempotency.claim_lost", route, key, phase="complete")
            return
        observer.log(logging.ERROR, "idempotency.complete_gave_up", route, key, attempts=attempts)
    finally:
        renewal.stop(token)


async def _landed(store: Store, key: str, token: str) -> bool:
    """Whether our claim is completed already: a failure whose write had landed (the
    answer was lost) leaves nothing for a retry to complete, and is no lost claim."""
    try:
        record = await store.get(key)
    except StoreError:
        return False
    return record is not None and record.token == token and record.status is RecordStatus.COMPLETED

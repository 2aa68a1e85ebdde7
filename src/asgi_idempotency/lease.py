"""Lease renewal while a claimed handler runs: the live owner never loses its claim.

A timer, not a task, until the first renewal is due, so a handler that finishes
within a third of its lease costs no renewal statement and no task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from .errors import StoreError
from .observer import Observer
from .stores.base import Store

__all__ = ["LeaseRenewal"]


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
        observer: Observer,
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
                    self._key, self._token, locked_until=self._clock() + self._lease
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

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

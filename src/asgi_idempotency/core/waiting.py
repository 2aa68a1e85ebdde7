"""Duplicates that wait for the first's answer (``Policy(wait=...)``, ``Once(wait=...)``).

One watch per process and key serves every waiter, holding no store connection: told
by a holder in this process when it ends, else reading the row with backoff. What it
reads is judged by :func:`.lifecycle.judge`; a key found free is claimed by one waiter
here at a time. The rules and their reasons: docs/design.md, "A duplicate that waits".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import datetime

from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.lifecycle import Claim, ClaimOutcome
from asgi_idempotency.core.store import Record

__all__ = ["POLL_FIRST", "POLL_MAX", "Waiters"]

# Seconds before the first read of a key held elsewhere, doubling after each read (or
# to the read's own round trip, if longer) up to the cap: a first that ends quickly is
# seen quickly, a long one costs a read every POLL_MAX seconds at most.
POLL_FIRST = 0.01
POLL_MAX = 0.5

_ANSWERED = frozenset({ClaimOutcome.COMPLETED, ClaimOutcome.MISMATCH})


class _Watch:
    """The waiters of one key on one event loop, and what the latest read found."""

    __slots__ = ("claiming", "failed", "loop", "news", "nudge", "record", "waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiters = 0
        self.record: Record | None = None
        # Why the latest read failed (its message: an exception kept here would hold
        # its traceback's frames, this watch among them, in a cycle), or None.
        self.failed: str | None = None
        self.claiming = False  # a waiter of this watch is claiming the key right now
        self.news = asyncio.Event()  # set (and replaced) when a read lands
        self.nudge = asyncio.Event()  # read now: the holder here is done, or nobody waits

    def publish(self, record: Record | None) -> None:
        self.record = record
        news, self.news = self.news, asyncio.Event()
        news.set()


class Waiters:
    """This process's waiting duplicates and the keys its own requests hold.

    Args:
        get: the store's ``get`` (a read of one row).
        poll_max: the longest pause between two reads of a key held elsewhere, in
            seconds (default :data:`POLL_MAX`).
    """

    __slots__ = ("_get", "_held", "_tasks", "_watches", "poll_max")

    def __init__(
        self, get: Callable[[str], Awaitable[Record | None]], *, poll_max: float = POLL_MAX
    ) -> None:
        self._get = get
        self.poll_max = max(poll_max, POLL_FIRST)
        self._held: set[str] = set()
        self._watches: dict[str, _Watch] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def waiting(self, key: str | None = None) -> int:
        """How many duplicates of ``key`` (of any key: ``None``) wait here."""
        if key is None:
            return sum(watch.waiters for watch in self._watches.values())
        watch = self._watches.get(key)
        return 0 if watch is None else watch.waiters

    def hold(self, key: str) -> None:
        """A request of this process claimed ``key``: watchers wait for :meth:`settled`."""
        self._held.add(key)

    def settled(self, key: str) -> None:
        """The holder of ``key`` here completed, released or abandoned it: read it now.

        Once per claim is enough: a second call (or one for a key not held) does nothing.
        """
        if key not in self._held:
            return  # not held here: its watchers, if any, read the store anyway
        self._held.discard(key)
        watch = self._watches.get(key)
        if watch is None:
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is watch.loop:
            watch.nudge.set()
        else:
            # A holder on another loop or thread: the watch's own loop sets it (a loop
            # closed meanwhile has no waiter left to tell).
            with contextlib.suppress(RuntimeError):
                watch.loop.call_soon_threadsafe(watch.nudge.set)

    async def wait(
        self,
        key: str,
        request_hash: str,
        running: Claim,
        within: float,
        clock: Callable[[], datetime],
        reclaim: Callable[[], Awaitable[Claim]],
    ) -> Claim:
        """Wait up to ``within`` seconds for the claim on ``key`` to end.

        ``running`` is the in-progress claim the caller met; ``reclaim`` claims the key
        for the caller (its own token, lease and orphan handling).

        Returns:
            COMPLETED or MISMATCH with the row to answer from; an owned claim (the
            caller runs); or, when the time ran out, IN_PROGRESS with the latest row
            seen (or ``running``'s).

        Raises:
            StoreError: ``reclaim`` failed, or the time ran out while the store was
                failing the reads.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        watch = self._join(key, loop)
        latest = running
        try:
            while True:
                news = watch.news
                try:
                    async with asyncio.timeout_at(deadline):
                        await news.wait()
                except TimeoutError:
                    if watch.failed is not None:
                        # The store stopped answering: whether the first ended is not
                        # known, and the answer for an unreachable store is 503.
                        raise StoreError(watch.failed) from None
                    return latest
                record = watch.record
                # At the store's time of the read where it keeps one, as a claim judges.
                now = clock()
                at = now if record is None or record.read_at is None else record.read_at
                outcome = lifecycle.judge(record, request_hash, at)
                if outcome in _ANSWERED:
                    return Claim(outcome, record)
                if outcome is ClaimOutcome.IN_PROGRESS:
                    latest = Claim(outcome, record)
                    continue
                if watch.claiming:
                    continue  # another waiter here claims it; wait for what that becomes
                watch.claiming = True
                try:
                    claim = await reclaim()
                finally:
                    watch.claiming = False
                if claim.outcome is not ClaimOutcome.IN_PROGRESS:
                    return claim
                latest = claim  # claimed elsewhere first: wait for that one's answer
        finally:
            self._leave(key, watch)

    def _join(self, key: str, loop: asyncio.AbstractEventLoop) -> _Watch:
        watch = self._watches.get(key)
        if watch is None or watch.loop is not loop:
            watch = _Watch(loop)
            if key not in self._watches:
                self._watches[key] = watch
            # else: a watch of another event loop (a second loop driving this guard) has
            # the key; this one watches on its own, unregistered, by reading.
            task = loop.create_task(self._watch(key, watch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        watch.waiters += 1
        return watch

    def _leave(self, key: str, watch: _Watch) -> None:
        watch.waiters -= 1
        if watch.waiters == 0:
            if self._watches.get(key) is watch:
                del self._watches[key]
            watch.nudge.set()  # the watch ends

    async def _watch(self, key: str, watch: _Watch) -> None:
        """Read ``key`` for its waiters until none is left (a task per watched key)."""
        loop = watch.loop
        delay = POLL_FIRST
        nudge = watch.nudge
        while watch.waiters:
            if key in self._held:
                await nudge.wait()  # the holder is here and says when it is done
            elif not nudge.is_set():
                try:
                    async with asyncio.timeout(delay):
                        await nudge.wait()
                except TimeoutError:
                    pass
            nudge.clear()
            if not watch.waiters:
                return
            began = loop.time()
            try:
                record = await self._get(key)
            except StoreError as exc:
                watch.failed = str(exc)  # no news; a waiter whose bound ends now gets it
            else:
                watch.failed = None
                watch.publish(record)
            delay = min(max(delay * 2, loop.time() - began), self.poll_max)

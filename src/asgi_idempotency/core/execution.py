"""The execution core: one guarded operation's claim, completion and release.

The HTTP responder and :class:`~.once.Once` are adapters over :class:`Executor`; it
is the one caller that drives :mod:`.lifecycle`, so both meet every lifecycle event
(a take-over, a failed completion, a cancellation, an orphaned claim) the same way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Coroutine
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.keys import MAX_ROUTE_LENGTH
from asgi_idempotency.core.lease import LeaseRenewals, Renewal, complete_later
from asgi_idempotency.core.lifecycle import Claim, ClaimOutcome
from asgi_idempotency.core.observing import Observing
from asgi_idempotency.core.policy import ExecutionPolicy as Policy
from asgi_idempotency.core.store import NewClaim, Store, StoredResponse
from asgi_idempotency.core.waiting import POLL_MAX, Waiters

__all__ = ["Execution", "Executor"]

T = TypeVar("T")


class Execution(NamedTuple):
    """One claim as :meth:`Executor.claim` made it; the handle of its completion or release."""

    claim: Claim
    now: datetime  # the claim's clock reading
    key: str
    token: str  # "" unless the claim is this execution's
    route: str  # a route template, or a function's namespace: logs and metrics
    policy: Policy
    renewal: Renewal | None  # None in a transaction (its claim rolls back with it)
    wait: timedelta | None  # duplicates may wait for it: they hear when it ends

    @property
    def owned(self) -> bool:
        return self.claim.owned


class Executor:
    """What every execution of one guard shares: the store, the clock and the settings."""

    __slots__ = ("background", "clock", "fail_open", "observer", "renewals", "retry_after",
                 "store", "waiters")  # fmt: skip

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], datetime],
        fail_open: bool,
        retry_after: float,
        observer: Observing,
    ) -> None:
        self.store, self.clock = store, clock
        self.fail_open, self.retry_after, self.observer = fail_open, retry_after, observer
        # Completions, releases and transaction closes that outlive a cancelled caller.
        self.background: set[asyncio.Task[Any]] = set()
        self.renewals = LeaseRenewals(store, clock=clock, observer=observer)
        # Duplicates waiting for a running first (Policy(wait=...), Once(wait=...)), and
        # the keys this process's own executions hold for them.
        self.waiters = Waiters(store.get, poll_max=min(POLL_MAX, retry_after))

    async def claim(
        self,
        claimant: lifecycle.Claimant,
        key: str,
        fingerprint: str,
        route: str,
        policy: Policy,
        *,
        span: Any = None,
        transaction: bool = False,
        wait: timedelta | None = None,
        scope: str | None = None,
    ) -> Execution:
        """Claim ``key`` (:func:`.lifecycle.claim`); an owned claim's lease is renewed
        from now until :meth:`complete`, :meth:`release` or :meth:`abandon`.

        ``claimant`` is the store, or (``transaction``) a transaction of it, whose claim
        needs no orphan release and no renewal: it rolls back with the transaction.
        With ``wait``, a key in progress is waited for up to that long (:mod:`.waiting`):
        the execution is then its answer, or a claim of the key found free.
        ``scope`` (a digest of who the caller is) and ``route`` ride in the claim's own
        statement for the audit (:mod:`.stores.duplicates`) when ``scope`` is given.

        Raises:
            StoreError: the store failed; nothing is claimed.
        """
        now = self.clock()
        token = os.urandom(16).hex()  # the fencing token: 128 random bits
        claim = await self._claim_as(claimant, key, fingerprint, token, route, policy,
                                     transaction, scope, span, now)  # fmt: skip
        if wait is not None and claim.outcome is ClaimOutcome.IN_PROGRESS:
            # The waiter's claim, if it comes to one, is fenced by the same token.
            again = functools.partial(self._claim_as, self.store, key, fingerprint, token,
                                      route, policy, False, scope, span)  # fmt: skip
            began = now
            claim = await self.waiters.wait(
                key, fingerprint, claim, wait.total_seconds(), self.clock, again
            )
            now = self.clock()
            self.observer.log(
                logging.INFO, "idempotency.waited", route, key, outcome=claim.outcome.value,
                waited_s=round((now - began).total_seconds(), 3),
            )  # fmt: skip
            if span is not None:
                self.observer.annotate(span, waited=True)
        if not claim.owned:
            return Execution(claim, now, key, "", route, policy, None, None)
        if claim.outcome is ClaimOutcome.TAKEN_OVER:
            self.observer.log(logging.WARNING, "idempotency.takeover", route, key,
                              outcome="taken_over")  # fmt: skip
            if span is not None:
                self.observer.annotate(span, taken_over=True)
            self.observer.takeover(route)
        if transaction:
            return Execution(claim, now, key, token, route, policy, None, None)
        renewal = self.renewals.start(key, token, policy.lease, policy.renew_every, route)
        if wait is not None:
            self.waiters.hold(key)  # duplicates here wait to hear of its end, not the store
        return Execution(claim, now, key, token, route, policy, renewal, wait)

    async def _claim_as(
        self,
        claimant: lifecycle.Claimant,
        key: str,
        fingerprint: str,
        token: str,
        route: str,
        policy: Policy,
        transaction: bool,
        scope: str | None,
        span: Any,
        now: datetime | None = None,
    ) -> Claim:
        """One claim of ``key`` for ``token``: a round trip (two to take over)."""
        if now is None:
            now = self.clock()
        claiming = lifecycle.claim(
            claimant,
            key,
            fingerprint,
            token,
            now=now,
            lease=policy.lease,
            ttl=policy.ttl,
            # A transaction's claim rolls back with it; the store's stays unless released.
            orphaned=None if transaction else functools.partial(self.orphaned, route),
            scope_digest=scope,
            route=None if scope is None else route[:MAX_ROUTE_LENGTH],
        )
        if span is None and not self.observer.timing:
            return await claiming  # the common case: no span, no timing, no context
        with self.observer.store_call("claim", span):
            return await claiming

    def in_progress_wait(self, execution: Execution) -> float:
        """Seconds until a claim held by another is worth asking about again."""
        return lifecycle.in_progress_wait(execution.claim.record, execution.now, self.retry_after)

    def stop(self, execution: Execution) -> None:
        """Stop renewing the claim's lease (idempotent)."""
        if execution.renewal is not None:
            execution.renewal.stop(execution.token)

    def settled(self, execution: Execution) -> None:
        """The claim ended here (completed, released, or left to lapse): duplicates of
        this process that wait for it read the key now (idempotent)."""
        if execution.wait is not None:
            self.waiters.settled(execution.key)

    async def complete(
        self, execution: Execution, stored: StoredResponse, *, span: Any = None
    ) -> None:
        """Store the outcome and end the claim.

        A failure of the store is logged and the completion tried again in the
        background, under a renewed lease, for the lease's life (:func:`.lease.complete_later`):
        the effect happened and the caller gets its true outcome now. A cancellation
        hands the same statement to :meth:`rerun`. Store errors never escape.
        """
        self.stop(execution)
        store, key, token = self.store, execution.key, execution.token
        now, ttl = self.clock(), execution.policy.ttl
        try:
            completing = store.complete(key, token, stored, now=now, ttl=ttl)
            if span is None and not self.observer.timing:
                owned = await completing
            else:
                with self.observer.store_call("complete", span):
                    owned = await completing
        except asyncio.CancelledError:
            self.settled(execution)
            # A partial, built only now: a lambda would give this function cells
            # that every request pays for.
            again = functools.partial(store.complete, key, token, stored, now=now, ttl=ttl)
            self.rerun(again, execution.route, key, "complete")
            raise
        except StoreError as exc:
            route, policy = execution.route, execution.policy
            self.observer.store_error(route, key, "complete", exc)
            self.complete_later(
                key, token, stored, now, ttl=ttl, lease=policy.lease, every=policy.renew_every,
                route=route,
            )  # fmt: skip
            self.settled(execution)
            return
        self.settled(execution)
        if not owned:
            self.observer.log(logging.ERROR, "idempotency.claim_lost", execution.route, key,
                              phase="complete")  # fmt: skip

    async def release(self, execution: Execution, *, span: Any = None) -> None:
        """Release the claim so that a retry runs again; a store failure is logged (the
        claim then lapses after its lease), a cancellation hands it to :meth:`rerun`."""
        self.stop(execution)
        store, key, token = self.store, execution.key, execution.token
        try:
            releasing = store.release(key, token)
            if span is None and not self.observer.timing:
                await releasing
            else:
                with self.observer.store_call("release", span):
                    await releasing
        except asyncio.CancelledError:
            self.rerun(functools.partial(store.release, key, token), execution.route, key,
                       "release")  # fmt: skip
            raise
        except StoreError as exc:
            self.observer.store_error(execution.route, key, "release", exc)
        finally:
            self.settled(execution)

    def release_later(self, execution: Execution) -> None:
        """Release, in the background, a claim for which nothing ran (its caller was
        cancelled before it could run anything)."""
        self.stop(execution)
        again = functools.partial(self.store.release, execution.key, execution.token)
        self.rerun(again, execution.route, execution.key, "release")
        self.settled(execution)

    def abandon(self, execution: Execution) -> None:
        """The caller was cancelled part-way: the effect may or may not have happened.
        The claim stays in progress until its lease ends rather than inviting a rerun."""
        self.stop(execution)
        self.settled(execution)
        self.observer.log(logging.WARNING, "idempotency.cancelled", execution.route, execution.key)

    def orphaned(self, route: str, new: NewClaim) -> None:
        """A claim whose caller was cancelled while it was in flight: release it
        (:func:`.lifecycle.release_orphan`) in the background."""
        release = functools.partial(lifecycle.release_orphan, self.store, new)
        self.rerun(release, route, new.key, "release")

    def rerun(
        self, make: Callable[[], Coroutine[Any, Any, object]], route: str, key: str, phase: str
    ) -> None:
        """Run a completion or release again to the end, after a cancellation cut it short.

        A completion or release is awaited directly: no task and no extra loop turns
        on the common path. If a cancellation interrupts it, the caller hands the same
        statement here, to run in a task of its own whose failure is logged under the
        route and key digest; both are fenced by the claim's token, so a second run
        changes nothing a first one that did land had not already done.
        """
        task = asyncio.ensure_future(make())
        self._keep(task)
        task.add_done_callback(functools.partial(self._log_failure, route, key, phase))

    def complete_later(
        self, key: str, token: str, stored: StoredResponse, now: datetime, *,
        ttl: timedelta, lease: timedelta, every: float, route: str,
    ) -> None:  # fmt: skip
        """Try again, in the background, a completion that the store failed
        (:func:`.lease.complete_later`: for the lease's life, under a renewed lease)."""
        task = asyncio.ensure_future(
            complete_later(
                self.store, self.renewals, self.observer, key, token, stored, now,
                ttl=ttl, lease=lease, every=every, route=route,
            )
        )  # fmt: skip
        self._keep(task)
        task.add_done_callback(
            functools.partial(self._log_failure, route, key, "complete", after="retrying")
        )

    async def shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` to the end even if the caller is cancelled (it cannot run twice)."""
        task = asyncio.ensure_future(coro)
        self._keep(task)
        return await asyncio.shield(task)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _log_failure(
        self, route: str, key: str, phase: str, task: asyncio.Task[Any], after: str = "cancelled"
    ) -> None:
        # Nobody awaits the task any more: its failure would otherwise go unseen.
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.observer.store_error(route, key, phase, exc, after=after)

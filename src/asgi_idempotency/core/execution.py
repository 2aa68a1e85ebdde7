"""The runner: one guarded operation's claim, completion and release, in either mode.

Every adapter (the HTTP responder and the FastAPI dependency claim, :class:`~.once.Once`
and the broker presets and MCP tools over it) runs its operation through a
:class:`Runner`; none calls the store's lifecycle primitives itself, so every adapter
meets every lifecycle event (a take-over, a failed completion, a cancellation, an
orphaned claim) the same way, and every mode composes with every adapter::

    claim ─┬─ not owned ─► the adapter answers from the claim (replay, in progress,
           │               mismatch), or waits for the holder (``wait``)
           └─ owned ─► the adapter runs its body, then one of
                       complete(stored)  the outcome is recorded
                       release()         a retry may run it again
                       abandon()         cancelled part-way: the claim lapses with its lease

In the default mode the claim and the completion are separate statements and the
claim's lease is renewed meanwhile. In transactional mode (``transactional=True``,
a store with transactions) the claim opens one store transaction that the body writes
through (:attr:`Execution.tx`): completing is committing the body's writes with the
record, releasing and abandoning are rolling both back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.keys import MAX_ROUTE_LENGTH
from asgi_idempotency.core.lease import LeaseRenewals, Renewal, complete_later
from asgi_idempotency.core.lifecycle import Claim, ClaimOutcome
from asgi_idempotency.core.observing import Observing
from asgi_idempotency.core.store import (
    NewClaim,
    Store,
    StoredResponse,
    StoreTransaction,
    TransactionalStore,
    capabilities,
)
from asgi_idempotency.core.terms import Terms
from asgi_idempotency.core.waiting import POLL_MAX, Waiters

__all__ = ["Execution", "Executor", "Runner"]

T = TypeVar("T")
# The observer the adapter passes in: the core calls only what Observing says; the adapter
# keeps its own type (the HTTP one counts outcomes too).
_Observer = TypeVar("_Observer", bound=Observing)


class Execution:
    """One claim as :meth:`Runner.claim` made it; the handle of its completion or release.

    ``tx`` is the store transaction of a transactional claim (what its body writes
    through), open until the runner commits or rolls it back; ``None`` otherwise.
    """

    __slots__ = ("_opened", "claim", "key", "now", "renewal", "route", "terms", "token", "tx",
                 "wait")  # fmt: skip

    def __init__(
        self,
        claim: Claim | None,
        now: datetime,
        key: str,
        token: str,
        route: str,
        terms: Terms,
        renewal: Renewal | None = None,
        wait: timedelta | None = None,
        tx: StoreTransaction | None = None,
        opened: AbstractAsyncContextManager[StoreTransaction] | None = None,
    ) -> None:
        self.claim = claim  # None: a transaction that holds no claim (report-only mode)
        self.now = now  # the claim's clock reading
        self.key = key
        self.token = token  # "" unless the claim is this execution's
        self.route = route  # a route template, or a function's namespace: logs and metrics
        self.terms = terms
        self.renewal = renewal  # None in a transaction (its claim rolls back with it)
        self.wait = wait  # duplicates may wait for it: they hear when it ends
        self.tx = tx
        self._opened = opened

    @property
    def owned(self) -> bool:
        return self.claim is not None and self.claim.owned


class Runner(Generic[_Observer]):
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
        observer: _Observer,
    ) -> None:
        self.store, self.clock = store, clock
        self.fail_open, self.retry_after, self.observer = fail_open, retry_after, observer
        # Completions, releases and transaction closes that outlive a cancelled caller.
        self.background: set[asyncio.Task[Any]] = set()
        self.renewals = LeaseRenewals(store, clock=clock, observer=observer)
        # Duplicates waiting for a running first (Policy(wait=...), Once(wait=...)), and
        # the keys this process's own executions hold for them.
        self.waiters = Waiters(store.get, poll_max=min(POLL_MAX, retry_after))

    def transactions_unavailable(self) -> str | None:
        """Why this runner's store cannot run transactional operations, or ``None``."""
        store = self.store
        if capabilities(store).transactions:
            return None
        why = getattr(store, "transactions_unavailable", None)
        return why if isinstance(why, str) else f"{type(store).__name__} has no transactions"

    async def claim(
        self,
        key: str,
        fingerprint: str,
        route: str,
        terms: Terms,
        *,
        span: Any = None,
        transactional: bool = False,
        wait: timedelta | None = None,
        scope: str | None = None,
    ) -> Execution:
        """Claim ``key`` (:func:`.lifecycle.claim`); an owned claim's lease is renewed
        from now until :meth:`complete`, :meth:`release` or :meth:`abandon`.

        ``transactional`` claims in a store transaction of its own, which the body
        writes through (:attr:`Execution.tx`); such a claim needs no orphan release and
        no renewal: it rolls back with the transaction. The transaction stays open
        until :meth:`complete`, :meth:`release`, :meth:`abandon` or :meth:`close`, even
        when the claim is not owned (report-only mode writes through it alone).
        With ``wait``, a key in progress is waited for up to that long (:mod:`.waiting`):
        the execution is then its answer, or a claim of the key found free.
        ``scope`` (a digest of who the caller is) and ``route`` ride in the claim's own
        statement for the audit (:mod:`.stores.duplicates`) when ``scope`` is given.

        Raises:
            StoreError: the store failed; nothing is claimed.
        """
        now = self.clock()
        token = os.urandom(16).hex()  # the fencing token: 128 random bits
        if transactional:
            return await self._claim_in_transaction(key, fingerprint, token, route, terms,
                                                    scope, span, now)  # fmt: skip
        claim = await self._claim_as(self.store, key, fingerprint, token, route, terms,
                                     False, scope, span, now)  # fmt: skip
        if wait is not None and claim.outcome is ClaimOutcome.IN_PROGRESS:
            # The waiter's claim, if it comes to one, is fenced by the same token.
            again = functools.partial(self._claim_as, self.store, key, fingerprint, token,
                                      route, terms, False, scope, span)  # fmt: skip
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
            return Execution(claim, now, key, "", route, terms)
        if claim.outcome is ClaimOutcome.TAKEN_OVER:
            self._taken_over(claim, route, key, span)
        renewal = self.renewals.start(key, token, terms.lease, terms.renew_every, route)
        if wait is not None:
            self.waiters.hold(key)  # duplicates here wait to hear of its end, not the store
        return Execution(claim, now, key, token, route, terms, renewal, wait)

    async def _claim_in_transaction(
        self, key: str, fingerprint: str, token: str, route: str, terms: Terms,
        scope: str | None, span: Any, now: datetime,
    ) -> Execution:  # fmt: skip
        opened = self.open_transaction()
        tx = await opened.__aenter__()
        try:
            claim = await self._claim_as(tx, key, fingerprint, token, route, terms, True,
                                         scope, span, now)  # fmt: skip
        except BaseException:
            await self._close(opened)
            raise
        if claim.owned:
            self._taken_over(claim, route, key, span)
        else:
            token = ""
        return Execution(claim, now, key, token, route, terms, None, None, tx, opened)

    async def unclaimed(self, route: str, terms: Terms) -> Execution:
        """A store transaction that holds no claim: a body that runs as it would
        unguarded (report-only mode) writes through it, and its writes commit alone
        (:meth:`commit_writes`).

        Raises:
            StoreError: the store could not open one.
        """
        opened = self.open_transaction()
        tx = await opened.__aenter__()
        return Execution(None, self.clock(), "", "", route, terms, None, None, tx, opened)

    def open_transaction(self) -> AbstractAsyncContextManager[StoreTransaction]:
        store = self.store
        if not isinstance(store, TransactionalStore):
            raise TypeError(f"{type(store).__name__} has no transactions")
        return store.transaction()

    def _taken_over(self, claim: Claim, route: str, key: str, span: Any) -> None:
        if claim.outcome is ClaimOutcome.TAKEN_OVER:
            self.observer.log(logging.WARNING, "idempotency.takeover", route, key,
                              outcome="taken_over")  # fmt: skip
            if span is not None:
                self.observer.annotate(span, taken_over=True)
            self.observer.takeover(route)

    def _claim_as(
        self,
        claimant: lifecycle.Claimant,
        key: str,
        fingerprint: str,
        token: str,
        route: str,
        terms: Terms,
        transaction: bool,
        scope: str | None,
        span: Any,
        now: datetime | None = None,
    ) -> Coroutine[Any, Any, Claim]:
        """One claim of ``key`` for ``token``: a round trip (two to take over), to await.

        A plain function: the common case hands back :func:`.lifecycle.claim`'s own
        coroutine, one frame less per request than awaiting it here.
        """
        if now is None:
            now = self.clock()
        claiming = lifecycle.claim(
            claimant,
            key,
            fingerprint,
            token,
            now=now,
            lease=terms.lease,
            ttl=terms.ttl,
            # A transaction's claim rolls back with it; the store's stays unless released.
            orphaned=None if transaction else functools.partial(self.orphaned, route),
            scope_digest=scope,
            route=None if scope is None else route[:MAX_ROUTE_LENGTH],
        )
        if span is None and not self.observer.timing:
            return claiming  # the common case: no span, no timing, no context
        return self._timed(claiming, span)

    async def _timed(self, claiming: Coroutine[Any, Any, Claim], span: Any) -> Claim:
        with self.observer.store_call("claim", span):
            return await claiming

    async def sighting(self, execution: Execution, marker: NewClaim) -> str | None:
        """The regenerated-key detector's marker (:func:`.lifecycle.sighting`), written
        where the claim was (its transaction, or the store).

        Raises:
            StoreError: the store failed.
        """
        claimant: lifecycle.Claimant = self.store if execution.tx is None else execution.tx
        return await lifecycle.sighting(claimant, marker, execution.now)

    def in_progress_wait(self, execution: Execution) -> float:
        """Seconds until a claim held by another is worth asking about again."""
        record = None if execution.claim is None else execution.claim.record
        return lifecycle.in_progress_wait(record, execution.now, self.retry_after)

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

        In a transaction: commit the body's writes with the record; a failure rolls
        both back and raises :class:`StoreError` (nothing happened: the caller says so).

        Otherwise a failure of the store is logged and the completion tried again in
        the background, under a renewed lease, for the lease's life
        (:func:`.lease.complete_later`): the effect happened and the caller gets its
        true outcome now. A cancellation hands the same statement to :meth:`rerun`.
        Store errors never escape.
        """
        if execution.tx is not None:
            await self._commit(execution, stored)
            return
        self.stop(execution)
        store, key, token = self.store, execution.key, execution.token
        now, ttl = self.clock(), execution.terms.ttl
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
            route, terms = execution.route, execution.terms
            self.observer.store_error(route, key, "complete", exc)
            self.complete_later(
                key, token, stored, now, ttl=ttl, lease=terms.lease, every=terms.renew_every,
                route=route,
            )  # fmt: skip
            self.settled(execution)
            return
        if execution.wait is not None:  # settled(), inlined: no one waits on most keys
            self.waiters.settled(key)
        if not owned:
            self.observer.log(logging.ERROR, "idempotency.claim_lost", execution.route, key,
                              phase="complete")  # fmt: skip

    async def commit_writes(self, execution: Execution) -> None:
        """Commit a transaction that holds no claim of this execution's: its writes alone.

        Raises:
            StoreError: the commit failed; the writes rolled back.
        """
        assert execution.tx is not None
        tx = execution.tx
        try:
            await self.shielded(tx.commit_writes())
        finally:
            await self.close(execution)

    async def _commit(self, execution: Execution, stored: StoredResponse) -> None:
        tx = execution.tx
        assert tx is not None
        try:
            key, token, ttl = execution.key, execution.token, execution.terms.ttl
            await self.shielded(tx.commit(key, token, stored, now=self.clock(), ttl=ttl))
        finally:
            await self.close(execution)

    async def release(self, execution: Execution, *, span: Any = None) -> None:
        """Release the claim so that a retry runs again; a store failure is logged (the
        claim then lapses after its lease), a cancellation hands it to :meth:`rerun`.
        In a transaction: roll back the claim with the body's writes."""
        if execution.tx is not None:
            await self.close(execution)
            return
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
        if execution.tx is not None:
            self._close_later(execution)
            return
        self.stop(execution)
        again = functools.partial(self.store.release, execution.key, execution.token)
        self.rerun(again, execution.route, execution.key, "release")
        self.settled(execution)

    def abandon(self, execution: Execution) -> None:
        """The caller was cancelled part-way: the effect may or may not have happened.
        The claim stays in progress until its lease ends rather than inviting a rerun;
        in a transaction, the claim and the body's writes roll back."""
        if execution.tx is not None:
            self._close_later(execution)
            return
        self.stop(execution)
        self.settled(execution)
        self.observer.log(logging.WARNING, "idempotency.cancelled", execution.route, execution.key)

    async def close(self, execution: Execution) -> None:
        """End the execution's transaction, rolling back what was not committed
        (idempotent; nothing to do outside a transaction)."""
        opened = execution._opened
        if opened is not None:
            execution._opened = None
            await self._close(opened)

    def _close_later(self, execution: Execution) -> None:
        opened = execution._opened
        if opened is not None:
            execution._opened = None
            task = asyncio.ensure_future(opened.__aexit__(None, None, None))
            self._keep(task)
            task.add_done_callback(
                functools.partial(self._log_failure, execution.route, execution.key, "rollback")
            )

    async def _close(self, opened: AbstractAsyncContextManager[StoreTransaction]) -> None:
        # Closing rolls back what was not committed, even when the caller is cancelled.
        await self.shielded(opened.__aexit__(None, None, None))

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


# The name the execution core had before transactions became one of its modes.
Executor = Runner

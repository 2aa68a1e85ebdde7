"""One guarded request, from its claim to its answer.

The middleware hands a :class:`Responder` a frozen :class:`GuardedRequest` (key,
principal, fingerprint, policy, route, body) and the :class:`Runtime` it shares with
every request; the responder holds nothing else. One path runs both modes:

    claim (lifecycle) ─┬─ not ours ─► replay / 409 / 422
                       └─ ours ─► run the handler, captured ─► complete or release ─► send

In the default mode the claim and the completion are separate statements on the
store and :class:`~.lease.LeaseRenewals` keeps the claim alive meanwhile. In
transactional mode they are statements of one store transaction, which the handler
writes through too: releasing is rolling back, completing is committing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

from . import lifecycle
from .asgi import ASGIApp, Receive, Scope, Send
from .capture import Captured, send_replay, storable_headers
from .errors import KeyMismatch, RequestInProgress, StoreError, StoreUnavailable
from .lease import LeaseRenewals
from .lifecycle import Claim, ClaimOutcome
from .metrics import Outcome
from .observer import Observer, logger
from .policy import Policy
from .request import replay_body
from .stores.base import Store, StoredResponse, StoreTransaction, TransactionalStore

__all__ = ["GuardedRequest", "Responder", "Runtime"]

T = TypeVar("T")


class GuardedRequest(NamedTuple):
    """What the guard knows of one request once it has been read (frozen)."""

    key: str  # the scoped key: sha256 hex of (principal, client key)
    principal: str
    fingerprint: str
    policy: Policy
    route: str
    body: bytes


class Runtime:
    """What every request of one middleware shares: the app, the store and the settings."""

    __slots__ = ("app", "background", "clock", "fail_open", "observer", "renewals", "retry_after",
                 "store")  # fmt: skip

    def __init__(
        self,
        app: ASGIApp,
        store: Store,
        *,
        clock: Callable[[], datetime],
        fail_open: bool,
        retry_after: float,
        observer: Observer,
    ) -> None:
        self.app, self.store, self.clock = app, store, clock
        self.fail_open, self.retry_after, self.observer = fail_open, retry_after, observer
        # Completions, releases and transaction closes that outlive a cancelled request.
        self.background: set[asyncio.Task[Any]] = set()
        self.renewals = LeaseRenewals(store, clock=clock, observer=observer)

    def rerun(
        self, make: Callable[[], Coroutine[Any, Any, object]], route: str, key: str, phase: str
    ) -> None:
        """Run a completion or release again to the end, after a cancellation cut it short.

        A completion or release is awaited directly: no task and no extra loop turns
        on the common path. If a cancellation interrupts it, the caller hands the same
        statement here, to run in a task of its own whose failure is logged under the
        request's route and key digest; both are fenced by the claim's token, so a
        second run changes nothing a first one that did land had not already done.
        """
        task = asyncio.ensure_future(make())
        self._keep(task)
        task.add_done_callback(functools.partial(self._log_failure, route, key, phase))

    async def shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` to the end even if this request is cancelled (it cannot run twice)."""
        task = asyncio.ensure_future(coro)
        self._keep(task)
        return await asyncio.shield(task)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _log_failure(self, route: str, key: str, phase: str, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.observer.store_error(route, key, phase, exc, after="cancelled")


_MISMATCH_DETAIL = (
    "This Idempotency-Key was already used with a different request "
    "(method, path, query or body). Use a new key for a new operation."
)
_IN_PROGRESS_DETAIL = (
    "A request with this Idempotency-Key is still being processed; "
    "retry after the Retry-After interval to get its response."
)


class Responder:
    """The state of one guarded request."""

    __slots__ = ("receive", "req", "rt", "scope", "send")

    def __init__(
        self, rt: Runtime, req: GuardedRequest, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.rt, self.req = rt, req
        self.scope, self.receive, self.send = scope, receive, send

    async def run(self) -> None:
        if not self.req.policy.transactional:
            await self._execute(self.rt.store, None)
            return
        store = self.rt.store
        assert isinstance(store, TransactionalStore)  # checked when the middleware was built
        tx: StoreTransaction | None = None
        try:
            async with store.transaction() as tx:
                await self._execute(tx, tx)
        except StoreError as exc:
            if tx is not None:
                raise  # not from opening the transaction: _execute answered what was its
            await self._unavailable(exc, "claim")

    def _log(self, level: int, event: str, **fields: Any) -> None:
        self.rt.observer.log(level, event, self.req.route, self.req.key, **fields)

    async def _execute(self, claimant: lifecycle.Claimant, tx: StoreTransaction | None) -> None:
        rt, req = self.rt, self.req
        policy = req.policy
        now = rt.clock()
        token = os.urandom(16).hex()  # the fencing token: 128 random bits
        try:
            claim = await lifecycle.claim(
                claimant,
                req.key,
                req.fingerprint,
                token,
                now=now,
                locked_until=now + policy.lease,
                expires_at=now + policy.ttl,
            )
        except StoreError as exc:
            await self._unavailable(exc, "claim")
            return
        if not claim.owned:
            await self._answer_existing(claim, now)
            return
        if claim.outcome is ClaimOutcome.TAKEN_OVER:
            self._log(logging.WARNING, "idempotency.takeover", outcome="taken_over")

        renewal = None
        if tx is None:
            renewal = rt.renewals.start(req.key, token, policy.lease, policy.renew_every, req.route)
        else:
            self.scope.setdefault("state", {})["idempotency"] = tx.state
        captured = Captured(req.body, self.receive)
        try:
            await rt.app(self.scope, captured.receive, captured.send)
        except asyncio.CancelledError:
            # Cancelled part-way: the effect may or may not have happened. By default the
            # claim stays in progress until its lease ends rather than inviting a rerun;
            # in a transaction, closing it rolls back the claim and the writes together.
            if renewal is not None:
                renewal.stop(token)
                self._log(logging.WARNING, "idempotency.cancelled")
            raise
        except BaseException:
            if renewal is not None:
                renewal.stop(token)
            await self._release(token, tx)
            raise
        if renewal is not None:
            renewal.stop(token)
        start = captured.start
        if start is None:
            # As if the app had raised: a retry may run it again.
            await self._release(token, tx)
            raise RuntimeError("the application returned without sending a response")
        content = b"".join(captured.chunks)

        status: int = start["status"]
        if not lifecycle.completes(status):
            await self._release(token, tx)
        else:
            stored = StoredResponse(status, storable_headers(start.get("headers", [])), content)
            expires_at = rt.clock() + policy.ttl
            if tx is None:
                await self._complete(token, stored, expires_at)
            elif not await self._commit(tx, token, stored, expires_at):
                return
            rt.observer.outcome(req.route, Outcome.EXECUTED)
        send = self.send  # sent here rather than through a helper: one coroutine fewer
        await send(start)
        await send({"type": "http.response.body", "body": content, "more_body": False})

    async def _complete(self, token: str, stored: StoredResponse, expires_at: datetime) -> None:
        store, key = self.rt.store, self.req.key
        try:
            owned = await store.complete(key, token, stored, expires_at=expires_at)
        except asyncio.CancelledError:
            # A partial, built only now: a lambda would give this function cells
            # that every request pays for.
            again = functools.partial(store.complete, key, token, stored, expires_at=expires_at)
            self.rt.rerun(again, self.req.route, key, "complete")
            raise
        except StoreError as exc:
            # The effect happened but is not recorded: the client still gets the true
            # response; the row stays in progress until its lease ends (README: guarantees).
            self.rt.observer.store_error(self.req.route, key, "complete", exc)
            return
        if not owned:
            self._log(logging.ERROR, "idempotency.claim_lost", phase="complete")

    async def _commit(
        self, tx: StoreTransaction, token: str, stored: StoredResponse, expires_at: datetime
    ) -> bool:
        try:
            await self.rt.shielded(tx.commit(self.req.key, token, stored, expires_at=expires_at))
        except StoreError as exc:
            # Nothing is recorded and the writes rolled back, or the commit's answer was
            # lost; either way the same key retried replays or runs exactly once.
            unavailable = Outcome.STORE_UNAVAILABLE
            observer = self.rt.observer
            observer.store_error(
                self.req.route, self.req.key, "commit", exc, outcome=unavailable.value
            )
            observer.outcome(self.req.route, unavailable)
            await StoreUnavailable(
                "The request's changes could not be committed; retry with the same "
                "Idempotency-Key.",
                retry_after=self.rt.retry_after,
            ).send(self.send)
            return False
        return True

    async def _release(self, token: str, tx: StoreTransaction | None) -> None:
        self.rt.observer.outcome(self.req.route, Outcome.RELEASED)
        if tx is not None:
            return  # the transaction closes uncommitted: the claim rolls back with the writes
        store, key = self.rt.store, self.req.key
        try:
            await store.release(key, token)
        except asyncio.CancelledError:
            again = functools.partial(store.release, key, token)
            self.rt.rerun(again, self.req.route, key, "release")
            raise
        except StoreError as exc:
            self.rt.observer.store_error(self.req.route, key, "release", exc)

    async def _unavailable(self, exc: StoreError, phase: str) -> None:
        rt = self.rt
        unavailable = Outcome.STORE_UNAVAILABLE
        rt.observer.store_error(self.req.route, self.req.key, phase, exc, outcome=unavailable.value)
        rt.observer.outcome(self.req.route, unavailable)
        if rt.fail_open:
            await rt.app(self.scope, replay_body(self.req.body, self.receive), self.send)
            return
        await StoreUnavailable(
            "The idempotency store is unavailable and the request was not processed; "
            "retry with the same Idempotency-Key.",
            retry_after=rt.retry_after,
        ).send(self.send)

    async def _answer_existing(self, claim: Claim, now: datetime) -> None:
        record, route = claim.record, self.req.route
        observer = self.rt.observer
        if claim.outcome is ClaimOutcome.COMPLETED:
            assert record is not None
            assert record.response is not None
            # Checked here as well as in Observer.log: the keywords are not even built
            # when nobody listens at INFO, as is usual for every replay.
            if logger.isEnabledFor(logging.INFO):
                self._log(
                    logging.INFO, "idempotency.replay", status=record.response.status,
                    outcome=Outcome.REPLAYED.value,
                )  # fmt: skip
            observer.outcome(route, Outcome.REPLAYED)
            await send_replay(self.send, record.response)
        elif claim.outcome is ClaimOutcome.MISMATCH:
            if logger.isEnabledFor(logging.INFO):
                self._log(logging.INFO, "idempotency.mismatch", outcome=Outcome.MISMATCH.value)
            observer.outcome(route, Outcome.MISMATCH)
            await KeyMismatch(_MISMATCH_DETAIL).send(self.send)
        else:
            wait = lifecycle.in_progress_wait(record, now, self.rt.retry_after)
            observer.outcome(route, Outcome.IN_PROGRESS)
            await RequestInProgress(_IN_PROGRESS_DETAIL, retry_after=wait).send(self.send)

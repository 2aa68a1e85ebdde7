"""One guarded request, from its claim to its answer.

The middleware hands a :class:`Responder` a frozen :class:`GuardedRequest` (key,
principal, fingerprint, policy, route, body) and the :class:`Runtime` it shares with
every request. One path runs every mode:

    claim (lifecycle) ─┬─ not ours ─► replay / 409 / 422 (what the app sends is dropped)
                       └─ ours ─► run the app; at its final body message:
                                  complete or release, then send

The claim happens before the app runs when the principal is known from the request,
or, with :func:`~.principals.from_dependency`, when FastAPI has resolved the app's
auth dependency (:mod:`.fastapi_claim` calls :meth:`Responder.claim_deferred`); until
then the app's messages pass straight through (a 401 from auth, a validation 422:
nothing claimed, nothing stored).

The outcome is the response the app sent, the moment its final body message goes
out: the record is completed from it, then it is sent. What the app does after that
(BackgroundTasks run inside the same ASGI call) neither delays the answer nor, by
failing, releases the key. A streamed response (a body message with ``more_body``)
goes to the client as it is produced, kept on the side up to a limit and stored when
it ends.

In the default mode the claim and the completion are separate statements on the
store and :class:`~.lease.LeaseRenewals` keeps the claim alive meanwhile. In
transactional mode they are statements of one store transaction, which the handler
writes through too: releasing is rolling back, completing is committing.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import os
from collections.abc import Callable, Coroutine
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

from starlette.exceptions import HTTPException

from . import lifecycle, tracing
from .asgi import ASGIApp, Message, Receive, Scope, Send
from .capture import send_replay, storable_headers
from .errors import (
    IdempotencyError,
    KeyMismatch,
    RequestInProgress,
    ResponseNotKept,
    StoreError,
    StoreUnavailable,
)
from .keys import MAX_ROUTE_LENGTH, scope_digest, scoped_key
from .lease import LeaseRenewals, Renewal, complete_later
from .lifecycle import Claim, ClaimOutcome
from .metrics import Outcome
from .observer import Observer, logger
from .policy import Policy
from .regenerated import RegeneratedKeys
from .stores.base import (
    NewClaim,
    Store,
    StoredResponse,
    StoreTransaction,
    TransactionalStore,
)
from .waiting import POLL_MAX, Waiters

__all__ = ["GUARD_SCOPE_KEY", "GuardAnswered", "GuardedRequest", "Responder", "Runtime"]

# The scope entry naming the responder of a guarded request: an inner guard (a guarded
# sub-app mounted in a guarded app) lets such a request through, and the FastAPI claim
# dependency finds its responder there.
GUARD_SCOPE_KEY = "asgi_idempotency.responder"

# A streamed response is kept on the side up to this size, to be stored when it ends;
# past it, retries are told the request ran and its response was not kept.
STREAM_KEEP_LIMIT = 1024 * 1024
_PATHSEND = "http.response.pathsend"

T = TypeVar("T")


class GuardedRequest(NamedTuple):
    """What the guard knows of one request once it has been read (frozen)."""

    key: str  # the scoped key: sha256 hex of (host, principal, client key); "" until known
    principal: str | None  # None until FastAPI resolves it (from_dependency)
    fingerprint: str
    policy: Policy
    route: str
    body: bytes
    client_key: str  # as the client sent it, parsed; never logged
    host: str  # "" when records are not scoped by host


class Runtime:
    """What every request of one middleware shares: the app, the store and the settings."""

    __slots__ = ("app", "background", "clock", "fail_open", "observer", "regenerated", "renewals",
                 "retry_after", "store", "waiters")  # fmt: skip

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
        # The opt-in regenerated-key detector (regenerated.py); None costs one check.
        self.regenerated: RegeneratedKeys | None = None
        # Duplicates waiting for a running first (Policy(wait=...)), and the keys this
        # process's own requests hold for them.
        self.waiters = Waiters(store.get, poll_max=min(POLL_MAX, retry_after))

    def orphaned(self, new: NewClaim) -> None:
        """A claim whose request was cancelled while it was in flight: release it
        (:func:`.lifecycle.release_orphan`) in the background."""
        release = functools.partial(lifecycle.release_orphan, self.store, new)
        self.rerun(release, "", new.key, "release")

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
        """Await ``coro`` to the end even if this request is cancelled (it cannot run twice)."""
        task = asyncio.ensure_future(coro)
        self._keep(task)
        return await asyncio.shield(task)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _log_failure(
        self, route: str, key: str, phase: str, task: asyncio.Task[Any], after: str = "cancelled"
    ) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.observer.store_error(route, key, phase, exc, after=after)


_MISMATCH_DETAIL = (
    "This Idempotency-Key was already used with a different request "
    "(method, path, query or body). Use a new key for a new operation."
)
_IN_PROGRESS_DETAIL = (
    "A request with this Idempotency-Key is still being processed; "
    "retry after the Retry-After interval to get its response."
)
_NOT_KEPT_DETAIL = (
    "The request with this Idempotency-Key was processed once; its response was "
    "streamed and too large to keep, so it cannot be replayed."
)


class _State(enum.Enum):
    WAITING = "waiting"  # deferred claim not made yet: the app's messages pass through
    UNGUARDED = "unguarded"  # fail_open after a store error: pass through
    OWNED = "owned"  # ours: the app's response is held (or streamed) until it ends
    FINISHING = "finishing"  # completing or releasing: no release on a late exception
    DONE = "done"  # answered from the app's response
    ANSWERED = "answered"  # the guard answered itself: what the app sends is dropped


class Responder:
    """The state of one guarded request."""

    __slots__ = ("chunks", "kept", "receive", "renewal", "req", "rt", "scope", "send", "span",
                 "start", "state", "streaming", "token", "tx", "unread")  # fmt: skip

    def __init__(
        self, rt: Runtime, req: GuardedRequest, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.rt, self.req = rt, req
        self.scope, self.receive, self.send = scope, receive, send
        self.state = _State.WAITING
        self.token = ""
        self.tx: StoreTransaction | None = None
        self.renewal: Renewal | None = None
        self.start: Message | None = None
        self.chunks: list[bytes] = []
        self.kept = 0  # bytes of a streamed response kept so far
        self.streaming = False
        self.unread = True  # the buffered request body is still to be given to the app
        self.span: Any = None  # the request's recording trace span, if any

    async def run(self) -> None:
        """Claim (unless it waits for FastAPI), run the app, answer; the whole request."""
        scope = self.scope
        extensions = scope.get("extensions")
        if extensions and _PATHSEND in extensions:
            # A file sent by path would bypass the body we store: the app sends the bytes.
            scope["extensions"] = {k: v for k, v in extensions.items() if k != _PATHSEND}
        scope[GUARD_SCOPE_KEY] = self
        try:
            await self._run()
        finally:
            # The scope holds this responder and it the scope: a cycle only the
            # collector would free, paid for by every request's p99.
            scope.pop(GUARD_SCOPE_KEY, None)
            if self.req.policy.wait is not None:
                # However the claim ended (a no-op once _finish has said so).
                self.rt.waiters.settled(self.req.key)

    async def _run(self) -> None:
        if self.req.principal is None:
            await self._run_app()  # the claim comes from the FastAPI dependency
            return
        if not self.req.policy.transactional:
            if await self._claim(self.rt.store):
                await self._run_app()
            return
        await self._in_transaction(claim=True)

    async def run_unclaimed(self) -> None:
        """Report-only mode, a transactional route, a request the guard would have refused
        before claiming (no key, no caller, ...): the app runs as it would unguarded, so its
        handler gets the transaction it writes through, whose writes alone commit."""
        self.unread = False  # the middleware hands over ``receive`` as the app is to read it
        await self._in_transaction(claim=False)

    async def _in_transaction(self, *, claim: bool) -> None:
        store = self.rt.store
        assert isinstance(store, TransactionalStore)  # checked when the middleware was built
        tx: StoreTransaction | None = None
        try:
            async with store.transaction() as tx:
                self.tx = tx
                if not claim:
                    self._hand_transaction()
                    await self._run_app()
                elif await self._claim(tx) and self.state is not _State.UNGUARDED:
                    await self._run_app()
        except StoreError as exc:
            if tx is not None:
                raise  # not from opening the transaction: answered where it arose
            if claim:
                await self._unavailable(exc, "claim")
            else:
                self.rt.observer.store_error(self.req.route, "", "transaction", exc)
                self.state = _State.UNGUARDED
            if self.state is _State.UNGUARDED:  # fail_open, report mode
                await self._run_app()  # no transaction to hand the handler
            return
        if self.state is not _State.UNGUARDED:
            return
        # The claim failed and the request runs unguarded (fail_open, report mode), not
        # in the transaction the failure may have broken. In report mode the handler
        # gets a fresh one if the store gives it one, as it would have without a fault.
        self.tx = None
        if self.req.policy.mode == "report":
            await self._in_transaction(claim=False)
        else:
            await self._run_app()

    @property
    def waiting(self) -> bool:
        """Whether this request waits for FastAPI to name its caller before it claims."""
        return self.state is _State.WAITING and self.req.principal is None

    async def refuse(self, exc: IdempotencyError) -> bool:
        """Answer with ``exc`` instead of claiming (the caller could not be identified);
        whether the endpoint may run all the same (report-only mode: the app answers)."""
        observer, route = self.rt.observer, self.req.route
        observer.outcome(route, Outcome.UNIDENTIFIED)
        observer.refused(route, exc)
        if self.req.policy.mode == "report":
            observer.report(route, "", exc.status)
            self.state = _State.UNGUARDED
            return True
        self.state = _State.ANSWERED
        await exc.send(self.send)
        return False

    async def claim_deferred(self, principal: str) -> bool:
        """Claim now that FastAPI has named the caller: whether the endpoint may run.

        ``False`` once the guard has answered (replay, 409, 422, 503): the caller stops
        the endpoint, and whatever the app sends next is dropped.
        """
        if self.state is not _State.WAITING:
            return self.state is not _State.ANSWERED
        req = self.req
        self.req = req._replace(
            principal=principal, key=scoped_key(principal, req.client_key, req.host)
        )
        return await self._claim(self.rt.store)

    async def endpoint_skipped(self) -> None:
        """FastAPI refused the request after the claim (validation): release, store nothing."""
        if self.state is not _State.OWNED:
            return
        self.state = _State.WAITING  # its answer (the 422) passes through
        self._stop_renewal()
        self.rt.observer.outcome(self.req.route, Outcome.REJECTED)
        store, key, token = self.rt.store, self.req.key, self.token
        try:
            await store.release(key, token)
        except asyncio.CancelledError:
            self.rt.rerun(functools.partial(store.release, key, token), self.req.route, key,
                          "release")  # fmt: skip
            self._settled()
            raise
        except StoreError as exc:
            self.rt.observer.store_error(self.req.route, key, "release", exc)
        self._settled()

    def _log(self, level: int, event: str, **fields: Any) -> None:
        self.rt.observer.log(level, event, self.req.route, self.req.key, **fields)

    async def _claim(self, claimant: lifecycle.Claimant) -> bool:
        """Claim the key; ``True`` if the app is to run, else the request is answered."""
        rt, req = self.rt, self.req
        policy = req.policy
        now = rt.clock()
        token = os.urandom(16).hex()  # the fencing token: 128 random bits
        otel = tracing.trace  # inlined tracing.live(): a global read when no tracer is set
        span = self.span = (
            tracing.recording() if otel is not None and otel._TRACER_PROVIDER is not None else None
        )
        if span is not None:
            tracing.annotate(span, key_digest=req.key[:16], mode=policy.mode)
        claiming = lifecycle.claim(
            claimant,
            req.key,
            req.fingerprint,
            token,
            now=now,
            lease=policy.lease,
            ttl=policy.ttl,
            # A transaction's claim rolls back with it; the store's stays unless released.
            orphaned=rt.orphaned if self.tx is None else None,
            # For the audit, on every guarded request: digests and the template only.
            scope_digest=scope_digest(req.principal or "", req.host),
            route=req.route[:MAX_ROUTE_LENGTH],
        )
        try:
            if span is None and not rt.observer.timing:
                claim = await claiming  # the common case: no span, no timing, no context
            else:
                with rt.observer.store_call("claim", span):
                    claim = await claiming
        except StoreError as exc:
            await self._unavailable(exc, "claim")
            return self.state is _State.UNGUARDED
        if not claim.owned:
            if policy.mode == "report":
                self._report_existing(claim)
                if self.tx is None:
                    self.state = _State.UNGUARDED  # the app runs; its own answer goes out
                else:
                    # The handler writes through the transaction as when the claim is
                    # ours, and its writes commit alone: no token, so no record is ours.
                    self._hand_transaction()
                return True
            if policy.wait is not None and claim.outcome is ClaimOutcome.IN_PROGRESS:
                self.token = token  # the waiter's claim, if it comes to one, is fenced by it
                try:
                    claim = await rt.waiters.wait(
                        req.key, req.fingerprint, claim, policy.wait.total_seconds(), rt.clock,
                        self._reclaim,
                    )  # fmt: skip
                except StoreError as exc:
                    await self._unavailable(exc, "claim")
                    return self.state is _State.UNGUARDED
                waited = rt.clock() - now
                now += waited
                self._log(
                    logging.INFO, "idempotency.waited", outcome=claim.outcome.value,
                    waited_s=round(waited.total_seconds(), 3),
                )  # fmt: skip
                if span is not None:
                    tracing.annotate(span, waited=True)
            if not claim.owned:
                self.state = _State.ANSWERED
                await self._answer_existing(claim, now)
                return False
        if rt.regenerated is not None:
            try:
                await self._check_regenerated(claimant, now)
            except asyncio.CancelledError:
                # The claim is this request's and nothing ran for it: release it now
                # (token-fenced) rather than leave the key to answer 409 for a lease. A
                # transaction's claim rolls back with it.
                if self.tx is None:
                    release = functools.partial(rt.store.release, req.key, token)
                    rt.rerun(release, req.route, req.key, "release")
                raise
        if claim.outcome is ClaimOutcome.TAKEN_OVER:
            self._log(logging.WARNING, "idempotency.takeover", outcome="taken_over")
            if span is not None:
                tracing.annotate(span, taken_over=True)
            rt.observer.takeover(req.route)
        self.token, self.state = token, _State.OWNED
        if self.tx is None:
            self.renewal = rt.renewals.start(
                req.key, token, policy.lease, policy.renew_every, req.route
            )
            if policy.wait is not None:
                rt.waiters.hold(req.key)  # duplicates here wait for _settled, not the store
        else:
            self._hand_transaction()
        return True

    def _hand_transaction(self) -> None:
        """The app runs in the transaction (``request.state.idempotency``); its response
        is held until it ends, to commit or roll back first. ``token`` stays empty when
        the transaction holds no claim of this request's (report-only mode)."""
        assert self.tx is not None
        self.scope.setdefault("state", {})["idempotency"] = self.tx.state
        self.state = _State.OWNED

    async def _reclaim(self) -> Claim:
        """Claim the key again for a waiting duplicate that found it free (its first was
        released, or lapsed), with this request's token; one store round trip."""
        rt, req = self.rt, self.req
        policy = req.policy
        now = rt.clock()
        claiming = lifecycle.claim(
            rt.store, req.key, req.fingerprint, self.token, now=now,
            lease=policy.lease, ttl=policy.ttl, orphaned=rt.orphaned,
        )  # fmt: skip
        with rt.observer.store_call("claim", self.span):
            return await claiming

    def _settled(self) -> None:
        """This request's claim ended here (completed, released, or left to lapse):
        duplicates of this process that wait for it read the key now."""
        if self.req.policy.wait is not None:
            self.rt.waiters.settled(self.req.key)

    async def _check_regenerated(self, claimant: lifecycle.Claimant, now: datetime) -> None:
        """The regenerated-key detector's marker (:mod:`.regenerated`): one more insert,
        before the handler runs. Its failure is logged and the request goes on: a
        detector must never turn a request the guard would run into an error."""
        rt, req = self.rt, self.req
        assert rt.regenerated is not None
        assert req.principal is not None  # claimed: the caller is known
        checking = rt.regenerated.check(
            claimant, host=req.host, principal=req.principal, fingerprint=req.fingerprint,
            key=req.key, now=now,
        )  # fmt: skip
        try:
            with rt.observer.store_call("mark", self.span):
                other = await checking
        except StoreError as exc:
            self._log(logging.WARNING, "idempotency.regenerated_check_failed",
                      error=type(exc).__name__)  # fmt: skip
            return
        if other is not None:
            rt.observer.regenerated_key(req.route, req.key, other)

    def _stop_renewal(self) -> None:
        if self.renewal is not None:
            self.renewal.stop(self.token)
            self.renewal = None

    async def _run_app(self) -> None:
        try:
            await self.rt.app(self.scope, self.app_receive, self.app_send)
        except asyncio.CancelledError:
            if self.state is _State.OWNED:
                # Cancelled part-way: the effect may or may not have happened. By default
                # the claim stays in progress until its lease ends rather than inviting a
                # rerun; in a transaction, closing it rolls back the claim and the writes.
                self._stop_renewal()
                if self.tx is None:
                    self._log(logging.WARNING, "idempotency.cancelled")
            raise
        except GuardAnswered:
            if self.state is not _State.ANSWERED:
                raise
            return  # the guard answered; the app let the marker through its handlers
        except BaseException:
            if self.state is _State.OWNED:
                self._stop_renewal()
                await self._release()
            raise
        state = self.state
        if state is _State.OWNED:
            if self.start is None:
                # As if the app had raised: a retry may run it again.
                self._stop_renewal()
                await self._release()
                raise RuntimeError("the application returned without sending a response")
            # Returned without a final body message: end the response here.
            end = {"type": "http.response.body", "body": b"", "more_body": False}
            await self._finish(end if self.streaming else None)
        elif state is _State.WAITING and self.req.principal is None:
            self.rt.observer.outcome(self.req.route, Outcome.REJECTED)

    async def app_receive(self) -> Message:
        # The buffered body once, then the server's own messages (http.disconnect).
        if self.unread:
            self.unread = False
            return {"type": "http.request", "body": self.req.body, "more_body": False}
        return await self.receive()

    async def app_send(self, message: Message) -> None:
        state = self.state
        if state is not _State.OWNED:
            if state is _State.WAITING or state is _State.UNGUARDED:
                await self.send(message)
            return  # answered by the guard, or after the final body: dropped
        kind = message["type"]
        if kind == "http.response.start":
            self.start = message
            return
        if kind != "http.response.body":
            return  # trailers and extensions are not part of what is replayed
        body: bytes = message.get("body", b"")
        if message.get("more_body", False):
            if not self.streaming:
                # A stream: it goes to the client as it is produced, never held back.
                self.streaming = True
                assert self.start is not None
                await self.send(self.start)
            self._keep(body)
            await self.send(message)
            return
        self._keep(body)
        await self._finish(message if self.streaming else None)

    def _keep(self, body: bytes) -> None:
        if not body:
            return
        if self.streaming:
            self.kept += len(body)
            if self.kept > STREAM_KEEP_LIMIT:
                self.chunks.clear()  # too large to store: only its size is known now
                return
        self.chunks.append(body)

    async def _finish(self, last: Message | None) -> None:
        """Complete or release from the app's response, then send what is left of it.

        ``last`` is a stream's final body message (its start and earlier chunks were
        sent as they came); ``None`` when the whole response is still held here.
        """
        self.state = _State.FINISHING
        self._stop_renewal()
        start = self.start
        assert start is not None
        status: int = start["status"]
        content = b"".join(self.chunks)
        if not lifecycle.completes(status):
            await self._release()
        elif not self.token:
            # Report-only mode in a transaction holding no claim of ours: the handler's
            # writes commit alone, as they would have without the guard.
            assert self.tx is not None
            if not await self._commit(self.tx, None, None):
                self.state = _State.DONE
                return
        else:
            if self.kept > STREAM_KEEP_LIMIT:
                problem = ResponseNotKept(_NOT_KEPT_DETAIL)
                stored = StoredResponse(problem.status, tuple(problem.headers()), problem.body())
            else:
                stored = StoredResponse(status, storable_headers(start.get("headers", [])), content)
            now = self.rt.clock()
            if self.tx is None:
                try:
                    await self._complete(stored, now)
                finally:
                    if self.req.policy.wait is not None:
                        self.rt.waiters.settled(self.req.key)
            elif not await self._commit(self.tx, stored, now):
                self.state = _State.DONE
                return
            self.rt.observer.outcome(self.req.route, Outcome.EXECUTED)
        self.state = _State.DONE
        send = self.send
        if last is not None:
            await send(last)
            return
        await send(start)
        await send({"type": "http.response.body", "body": content, "more_body": False})

    async def _complete(self, stored: StoredResponse, now: datetime) -> None:
        store, key, token, ttl = self.rt.store, self.req.key, self.token, self.req.policy.ttl
        try:
            completing = store.complete(key, token, stored, now=now, ttl=ttl)
            if self.span is None and not self.rt.observer.timing:
                owned = await completing
            else:
                with self.rt.observer.store_call("complete", self.span):
                    owned = await completing
        except asyncio.CancelledError:
            # A partial, built only now: a lambda would give this function cells
            # that every request pays for.
            again = functools.partial(store.complete, key, token, stored, now=now, ttl=ttl)
            self.rt.rerun(again, self.req.route, key, "complete")
            raise
        except StoreError as exc:
            # The effect happened but is not recorded: the client still gets the true
            # response now, and the completion is tried again in the background under
            # a renewed lease, for the lease's life (lease.complete_later; README: guarantees).
            route, policy = self.req.route, self.req.policy
            self.rt.observer.store_error(route, key, "complete", exc)
            self.rt.complete_later(
                key, token, stored, now, ttl=ttl, lease=policy.lease, every=policy.renew_every,
                route=route,
            )  # fmt: skip
            return
        if not owned:
            self._log(logging.ERROR, "idempotency.claim_lost", phase="complete")

    async def _commit(
        self, tx: StoreTransaction, stored: StoredResponse | None, now: datetime | None
    ) -> bool:
        """Commit the handler's writes with the record (``stored``), or alone (``None``)."""
        key = self.req.key
        try:
            if stored is None:
                await self.rt.shielded(tx.commit_writes())
            else:
                assert now is not None
                ttl = self.req.policy.ttl
                await self.rt.shielded(tx.commit(key, self.token, stored, now=now, ttl=ttl))
        except StoreError as exc:
            # Nothing is recorded and the writes rolled back, or the commit's answer was
            # lost; either way the same key retried replays or runs exactly once.
            unavailable = Outcome.STORE_UNAVAILABLE
            observer = self.rt.observer
            observer.store_error(self.req.route, key, "commit", exc, outcome=unavailable.value)
            observer.outcome(self.req.route, unavailable)
            await StoreUnavailable(
                "The request's changes could not be committed; retry with the same "
                "Idempotency-Key.",
                retry_after=self.rt.retry_after,
            ).send(self.send)
            return False
        return True

    async def _release(self) -> None:
        if self.token:  # else report-only mode, no claim of ours: its outcome is counted
            self.rt.observer.outcome(self.req.route, Outcome.RELEASED)
        if self.tx is not None:
            return  # the transaction closes uncommitted: the claim rolls back with the writes
        store, key, token = self.rt.store, self.req.key, self.token
        try:
            releasing = store.release(key, token)
            if self.span is None and not self.rt.observer.timing:
                await releasing
            else:
                with self.rt.observer.store_call("release", self.span):
                    await releasing
        except asyncio.CancelledError:
            again = functools.partial(store.release, key, token)
            self.rt.rerun(again, self.req.route, key, "release")
            raise
        except StoreError as exc:
            self.rt.observer.store_error(self.req.route, key, "release", exc)
        finally:
            if self.req.policy.wait is not None:
                self.rt.waiters.settled(key)

    async def _unavailable(self, exc: StoreError, phase: str) -> None:
        rt = self.rt
        unavailable = Outcome.STORE_UNAVAILABLE
        rt.observer.store_error(self.req.route, self.req.key, phase, exc, outcome=unavailable.value)
        rt.observer.outcome(self.req.route, unavailable)
        if self.req.policy.mode == "report":
            rt.observer.report(self.req.route, self.req.key, StoreUnavailable.status)
        if rt.fail_open or self.req.policy.mode == "report":
            self.state = _State.UNGUARDED  # the app runs, its answer passes straight through
            return
        self.state = _State.ANSWERED
        await StoreUnavailable(
            "The idempotency store is unavailable and the request was not processed; "
            "retry with the same Idempotency-Key.",
            retry_after=rt.retry_after,
        ).send(self.send)

    def _report_existing(self, claim: Claim) -> None:
        """Report-only mode: count and log what :meth:`_answer_existing` would have sent."""
        record = claim.record
        if claim.outcome is ClaimOutcome.COMPLETED:
            assert record is not None
            assert record.response is not None
            outcome, status = Outcome.REPLAYED, record.response.status
        elif claim.outcome is ClaimOutcome.MISMATCH:
            outcome, status = Outcome.MISMATCH, KeyMismatch.status
        else:
            outcome, status = Outcome.IN_PROGRESS, RequestInProgress.status
        self.rt.observer.outcome(self.req.route, outcome)
        self.rt.observer.report(self.req.route, self.req.key, status, outcome=outcome.value)

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
            await send_replay(self.send, record.response, self.scope["headers"])
        elif claim.outcome is ClaimOutcome.MISMATCH:
            if logger.isEnabledFor(logging.INFO):
                self._log(logging.INFO, "idempotency.mismatch", outcome=Outcome.MISMATCH.value)
            observer.outcome(route, Outcome.MISMATCH)
            await KeyMismatch(_MISMATCH_DETAIL).send(self.send)
        else:
            wait = lifecycle.in_progress_wait(record, now, self.rt.retry_after)
            observer.outcome(route, Outcome.IN_PROGRESS)
            await RequestInProgress(_IN_PROGRESS_DETAIL, retry_after=wait).send(self.send)


class GuardAnswered(HTTPException):
    """Stops the endpoint once the guard has answered itself (replay, 409, 422, 503).

    An ``HTTPException``, so the app's own exception handling turns it into a response
    quietly (no 500, no traceback in the server log); that response is dropped.
    """

    def __init__(self) -> None:
        super().__init__(status_code=409, detail="answered by the idempotency guard")

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

The claim, completion and release, in either mode, are the runner's
(:mod:`.execution`, shared with :class:`~.once.Once`); this module captures and replays
ASGI messages around them. In transactional mode the runner's claim opens the store
transaction the handler writes through (``request.state.idempotency``), wherever the
claim is made: here, or at the FastAPI dependency.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any

from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.errors import (
    IdempotencyError,
    KeyMismatch,
    RequestInProgress,
    ResponseNotKept,
    StoreError,
    StoreUnavailable,
)
from asgi_idempotency.core.execution import Execution
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.core.lifecycle import Claim, ClaimOutcome
from asgi_idempotency.http.asgi import Message, Receive, Scope, Send
from asgi_idempotency.http.capture import send_replay, storable_headers, stored_headers
from asgi_idempotency.http.problems import (
    IN_PROGRESS_DETAIL,
    MISMATCH_DETAIL,
    NOT_KEPT_DETAIL,
    send_problem,
)
from asgi_idempotency.http.request import GuardedRequest
from asgi_idempotency.http.runtime import Runtime
from asgi_idempotency.observability import tracing
from asgi_idempotency.observability.metrics import Outcome
from asgi_idempotency.observability.observer import logger
from asgi_idempotency.stores.base import StoredResponse

__all__ = ["GUARD_SCOPE_KEY", "GuardAnswered", "GuardedRequest", "Responder", "Runtime"]

# The scope entry naming the responder of a guarded request: an inner guard (a guarded
# sub-app mounted in a guarded app) lets such a request through, and the FastAPI claim
# dependency finds its responder there.
GUARD_SCOPE_KEY = "asgi_idempotency.http.responder"

# A streamed response is kept on the side up to this size, to be stored when it ends;
# past it, retries are told the request ran and its response was not kept.
STREAM_KEEP_LIMIT = 1024 * 1024
_PATHSEND = "http.response.pathsend"
_TRAILERS = "http.response.trailers"


class _State(enum.Enum):
    WAITING = "waiting"  # deferred claim not made yet: the app's messages pass through
    UNGUARDED = "unguarded"  # fail_open after a store error: pass through
    OWNED = "owned"  # ours: the app's response is held (or streamed) until it ends
    FINISHING = "finishing"  # completing or releasing: no release on a late exception
    DONE = "done"  # answered from the app's response
    ANSWERED = "answered"  # the guard answered itself: what the app sends is dropped


class Responder:
    """The state of one guarded request."""

    __slots__ = ("chunks", "execution", "kept", "receive", "req", "rt", "runner", "scope",
                 "send", "span", "start", "state", "streaming", "trailers",
                 "unread")  # fmt: skip

    def __init__(
        self, rt: Runtime, req: GuardedRequest, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.rt, self.runner, self.req = rt, rt.runner, req
        self.scope, self.receive, self.send = scope, receive, send
        self.state = _State.WAITING
        # The runner's handle of this request's claim (or of its transaction alone).
        self.execution: Execution | None = None
        self.start: Message | None = None
        self.chunks: list[bytes] = []
        self.kept = 0  # bytes of a streamed response kept so far
        self.streaming = False
        # A response that announced trailers ends with them, not with its final body:
        # set to the trailer fields received so far once that body has come.
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.unread = True  # the buffered request body is still to be given to the app
        self.span: Any = None  # the request's recording trace span, if any

    @property
    def token(self) -> str:
        """The fencing token of a claim that is this request's, else ``""``."""
        execution = self.execution
        return "" if execution is None else execution.token

    async def run(self) -> None:
        """Claim (unless it waits for FastAPI), run the app, answer; the whole request."""
        scope = self.scope
        extensions = scope.get("extensions")
        if extensions and _PATHSEND in extensions:
            # A file sent by path would bypass the body we store: the app sends the bytes.
            scope["extensions"] = {k: v for k, v in extensions.items() if k != _PATHSEND}
        scope[GUARD_SCOPE_KEY] = self
        try:
            if self.req.principal is None:
                await self._run_app()  # the claim comes from the FastAPI dependency
            elif await self._claim():
                await self._run_app()
        finally:
            # The scope holds this responder and it the scope: a cycle only the
            # collector would free, paid for by every request's p99.
            scope.pop(GUARD_SCOPE_KEY, None)
            execution = self.execution
            if execution is not None:
                # However the claim ended (a no-op once it was completed or released):
                # waiters hear of it, and a transaction still open rolls back.
                if execution.wait is not None:
                    self.runner.settled(execution)
                if execution.tx is not None:
                    await self.runner.close(execution)

    async def run_unclaimed(self) -> None:
        """Report-only mode, a transactional route, a request the guard would have refused
        before claiming (no key, no caller, ...): the app runs as it would unguarded, so its
        handler gets the transaction it writes through, whose writes alone commit."""
        self.unread = False  # the middleware hands over ``receive`` as the app is to read it
        try:
            await self._unclaimed_transaction()
            await self._run_app()
        finally:
            if self.execution is not None:
                await self.runner.close(self.execution)

    async def _unclaimed_transaction(self) -> None:
        """Open the transaction a report-only request's handler writes through alone;
        a store that cannot open one leaves the handler without (logged)."""
        try:
            self.execution = await self.runner.unclaimed(self.req.route, self.req.policy)
        except StoreError as exc:
            self.runner.observer.store_error(self.req.route, "", "transaction", exc)
            self.state = _State.UNGUARDED
            return
        self._hand_transaction()

    @property
    def waiting(self) -> bool:
        """Whether this request waits for FastAPI to name its caller before it claims."""
        return self.state is _State.WAITING and self.req.principal is None

    async def refuse(self, exc: IdempotencyError) -> bool:
        """Answer with ``exc`` instead of claiming (the caller could not be identified);
        whether the endpoint may run all the same (report-only mode: the app answers)."""
        observer, route = self.runner.observer, self.req.route
        observer.outcome(route, Outcome.UNIDENTIFIED)
        observer.refused(route, exc)
        if self.req.policy.mode == "report":
            observer.report(route, "", exc.status)
            self.state = _State.UNGUARDED
            return True
        self.state = _State.ANSWERED
        await send_problem(self.send, exc)
        return False

    async def claim_deferred(self, principal: str) -> bool:
        """Claim now that FastAPI has named the caller: whether the endpoint may run.

        ``False`` once the guard has answered (replay, 409, 422, 503): the caller stops
        the endpoint, and whatever the app sends next is dropped. On a transactional
        route the claim opens the transaction the handler's session writes through.
        """
        if self.state is not _State.WAITING:
            return self.state is not _State.ANSWERED
        req = self.req
        self.req = req._replace(
            principal=principal,
            key=scoped_key(principal, req.client_key, req.host, self.rt.namespace),
        )
        return await self._claim()

    async def endpoint_skipped(self) -> None:
        """FastAPI refused the request after the claim (validation): release, store nothing."""
        if self.state is not _State.OWNED:
            return
        self.state = _State.WAITING  # its answer (the 422) passes through
        self.runner.observer.outcome(self.req.route, Outcome.REJECTED)
        assert self.execution is not None  # owned: claimed by claim_deferred
        await self.runner.release(self.execution)

    def _log(self, level: int, event: str, **fields: Any) -> None:
        self.runner.observer.log(level, event, self.req.route, self.req.key, **fields)

    async def _claim(self) -> bool:
        """Claim the key; ``True`` if the app is to run, else the request is answered."""
        runner, req = self.runner, self.req
        policy = req.policy
        otel = tracing.trace  # inlined tracing.live(): a global read when no tracer is set
        span = self.span = (
            tracing.recording() if otel is not None and otel._TRACER_PROVIDER is not None else None
        )
        if span is not None:
            tracing.annotate(span, key_digest=req.key[:16], mode=policy.mode)
        report = policy.mode == "report"
        try:
            execution = self.execution = await runner.claim(
                req.key, req.fingerprint, req.route, policy, span=span,
                transactional=policy.transactional,
                # Report-only mode answers what it finds at once, as without the guard.
                wait=None if report else policy.wait,
                # For the audit, on every guarded request: digests and the template only.
                scope=self.rt.scope_digest(req.principal or "", req.host),
            )  # fmt: skip
        except StoreError as exc:
            await self._unavailable(exc, "claim")
            if self.state is not _State.UNGUARDED:
                return False
            if report and policy.transactional:
                # The handler gets a fresh transaction if the store gives it one, as it
                # would have without the fault; its writes commit alone.
                await self._unclaimed_transaction()
            return True  # fail_open, report mode: the app runs, its answer goes out
        if not execution.owned:
            if report:
                assert execution.claim is not None
                self._report_existing(execution.claim)
                if execution.tx is None:
                    self.state = _State.UNGUARDED  # the app runs; its own answer goes out
                else:
                    # The handler writes through the transaction as when the claim is
                    # ours, and its writes commit alone: no token, so no record is ours.
                    self._hand_transaction()
                return True
            self.state = _State.ANSWERED
            await self._answer_existing(execution)
            return False
        if self.rt.regenerated is not None:
            try:
                await self._check_regenerated(execution)
            except asyncio.CancelledError:
                # The claim is this request's and nothing ran for it: release it now
                # (token-fenced) rather than leave the key to answer 409 for a lease. A
                # transaction's claim rolls back with it.
                runner.release_later(execution)
                raise
        self.state = _State.OWNED
        if execution.tx is not None:
            self._hand_transaction()
        return True

    def _hand_transaction(self) -> None:
        """The app runs in the transaction (``request.state.idempotency``); its response
        is held until it ends, to commit or roll back first. ``token`` stays empty when
        the transaction holds no claim of this request's (report-only mode)."""
        assert self.execution is not None
        assert self.execution.tx is not None
        self.scope.setdefault("state", {})["idempotency"] = self.execution.tx.state
        self.state = _State.OWNED

    async def _check_regenerated(self, execution: Execution) -> None:
        """The regenerated-key detector's marker (:mod:`.regenerated`): one more insert,
        before the handler runs. Its failure is logged and the request goes on: a
        detector must never turn a request the guard would run into an error."""
        rt, req = self.rt, self.req
        assert rt.regenerated is not None
        assert req.principal is not None  # claimed: the caller is known
        marker = rt.regenerated.marker(
            host=req.host, principal=req.principal, fingerprint=req.fingerprint,
            key=req.key, now=execution.now,
        )  # fmt: skip
        observer = self.runner.observer
        try:
            with observer.store_call("mark", self.span):
                other = await self.runner.sighting(execution, marker)
        except StoreError as exc:
            self._log(logging.WARNING, "idempotency.regenerated_check_failed",
                      error=type(exc).__name__)  # fmt: skip
            return
        if other is not None and other != req.key:
            observer.regenerated_key(req.route, req.key, other)

    def _stop_renewal(self) -> None:
        if self.execution is not None:
            self.runner.stop(self.execution)

    async def _run_app(self) -> None:
        try:
            await self.rt.app(self.scope, self.app_receive, self.app_send)
        except asyncio.CancelledError:
            # Cancelled part-way: the effect may or may not have happened. By default
            # the claim stays in progress until its lease ends rather than inviting a
            # rerun; in a transaction, the claim and the writes roll back.
            if self.state is _State.OWNED and self.execution is not None:
                self.runner.abandon(self.execution)
            raise
        except GuardAnswered:
            if self.state is not _State.ANSWERED:
                raise
            return  # the guard answered; the endpoint was stopped
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
            if self.trailers is not None:
                # Returned before its last trailers: end them here (with those it sent).
                await self._finish(None)
                return
            if self.start.get("trailers", False):
                self.trailers = []  # announced, never sent: the response still ends
            # Returned without a final body message: end the response here.
            end = {"type": "http.response.body", "body": b"", "more_body": False}
            await self._finish(end if self.streaming else None)
        elif state is _State.WAITING and self.req.principal is None:
            self.runner.observer.outcome(self.req.route, Outcome.REJECTED)

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
            trailers = self.trailers
            if kind == _TRAILERS and trailers is not None:
                trailers += message.get("headers", ())
                if not message.get("more_trailers", False):
                    await self._finish(None)  # the response's end: complete, then send
            return  # other extensions are not part of what is replayed
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
        if not self.streaming:
            if body:  # _keep(), inlined for the usual whole response: nothing to count
                self.chunks.append(body)
        else:
            self._keep(body)
        start = self.start
        if start is not None and start.get("trailers", False):
            # The response ends with its trailers (ASGI http.response.trailers): they
            # are part of the outcome, so it is stored, and its end sent, after them.
            self.trailers = []
            if self.streaming:
                await self.send(message)
            return
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
        sent as they came); ``None`` when the whole response is still held here, or
        when the stream's final body went out and only its trailers are left.
        """
        # No _stop_renewal() here: complete() and release() stop it first thing, with
        # no await before (a transaction's claim has none).
        self.state = _State.FINISHING
        start = self.start
        assert start is not None
        status: int = start["status"]
        content = b"".join(self.chunks)
        execution = self.execution
        assert execution is not None  # owned, or a transaction of its own
        if not lifecycle.completes(status):
            await self._release()
        elif not execution.token:
            # Report-only mode in a transaction holding no claim of ours: the handler's
            # writes commit alone, as they would have without the guard.
            if not await self._commit(None):
                self.state = _State.DONE
                return
        else:
            if self.kept > STREAM_KEEP_LIMIT:
                problem = ResponseNotKept(NOT_KEPT_DETAIL)
                stored = StoredResponse(problem.status, tuple(problem.headers()), problem.body())
            else:
                trailers = self.trailers
                headers = (
                    storable_headers(start.get("headers", ()))
                    if trailers is None
                    else stored_headers(start.get("headers", ()), trailers)
                )
                stored = StoredResponse(status, headers, content)
            if execution.tx is None:
                # The effect happened: a store that fails to record it gets the
                # completion again in the background, for the lease's life (README:
                # guarantees); the client gets the true response now either way.
                await self.runner.complete(execution, stored, span=self.span)
            elif not await self._commit(stored):
                self.state = _State.DONE
                return
            self.runner.observer.outcome(self.req.route, Outcome.EXECUTED)
        self.state = _State.DONE
        send = self.send
        if last is not None:
            await send(last)
        elif not self.streaming:
            await send(start)
            await send({"type": "http.response.body", "body": content, "more_body": False})
        if self.trailers is not None:  # announced by the start: the stream ends with them
            await send({"type": _TRAILERS, "headers": self.trailers, "more_trailers": False})

    async def _commit(self, stored: StoredResponse | None) -> bool:
        """Commit the handler's writes with the record (``stored``), or alone (``None``);
        whether they committed (else the client was answered 503)."""
        execution = self.execution
        assert execution is not None
        runner = self.runner
        try:
            if stored is None:
                await runner.commit_writes(execution)
            else:
                await runner.complete(execution, stored, span=self.span)
        except StoreError as exc:
            # Nothing is recorded and the writes rolled back, or the commit's answer was
            # lost; either way the same key retried replays or runs exactly once.
            unavailable = Outcome.STORE_UNAVAILABLE
            observer = runner.observer
            observer.store_error(self.req.route, self.req.key, "commit", exc,
                                 outcome=unavailable.value)  # fmt: skip
            observer.outcome(self.req.route, unavailable)
            unanswered = StoreUnavailable(
                "The request's changes could not be committed; retry with the same "
                "Idempotency-Key.",
                retry_after=runner.retry_after,
            )
            await send_problem(self.send, unanswered)
            return False
        return True

    async def _release(self) -> None:
        execution = self.execution
        assert execution is not None  # owned, or a transaction of its own
        if execution.token:  # else report-only mode, no claim of ours: its outcome is counted
            self.runner.observer.outcome(self.req.route, Outcome.RELEASED)
        # In a transaction: rolled back, the claim with the writes.
        await self.runner.release(execution, span=self.span)

    async def _unavailable(self, exc: StoreError, phase: str) -> None:
        runner = self.runner
        unavailable = Outcome.STORE_UNAVAILABLE
        runner.observer.store_error(self.req.route, self.req.key, phase, exc,
                                    outcome=unavailable.value)  # fmt: skip
        runner.observer.outcome(self.req.route, unavailable)
        if self.req.policy.mode == "report":
            runner.observer.report(self.req.route, self.req.key, StoreUnavailable.status)
        if runner.fail_open or self.req.policy.mode == "report":
            self.state = _State.UNGUARDED  # the app runs, its answer passes straight through
            return
        self.state = _State.ANSWERED
        problem = StoreUnavailable(
            "The idempotency store is unavailable and the request was not processed; "
            "retry with the same Idempotency-Key.",
            retry_after=runner.retry_after,
        )
        await send_problem(self.send, problem)

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
        self.runner.observer.outcome(self.req.route, outcome)
        self.runner.observer.report(self.req.route, self.req.key, status, outcome=outcome.value)

    async def _answer_existing(self, execution: Execution) -> None:
        claim = execution.claim
        assert claim is not None
        record, route = claim.record, self.req.route
        observer = self.runner.observer
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
            scope = self.scope
            extensions = scope.get("extensions")
            trailers = extensions is not None and _TRAILERS in extensions
            await send_replay(self.send, record.response, scope["headers"], trailers=trailers)
        elif claim.outcome is ClaimOutcome.MISMATCH:
            if logger.isEnabledFor(logging.INFO):
                self._log(logging.INFO, "idempotency.mismatch", outcome=Outcome.MISMATCH.value)
            observer.outcome(route, Outcome.MISMATCH)
            await send_problem(self.send, KeyMismatch(MISMATCH_DETAIL))
        else:
            wait = self.runner.in_progress_wait(execution)
            observer.outcome(route, Outcome.IN_PROGRESS)
            await send_problem(self.send, RequestInProgress(IN_PROGRESS_DETAIL, retry_after=wait))


class GuardAnswered(Exception):
    """Stops the endpoint once the guard has answered itself (replay, 409, 422, 503).

    Raised where FastAPI resolves the guard's claim dependency and caught by the guard
    that raised it, around the app. Not an ``HTTPException``: no exception handler of
    the app's matches it, so nothing inside the guard reacts (an audit row, a metric)
    to an answer the client never receives.
    """

"""The function guard: run a function once per key, over the same stores and lifecycle.

Queue consumers, scheduled jobs and agent tools meet the same duplicates as HTTP
handlers, without a request. :class:`Once` is an adapter over the execution core
(:mod:`.execution`), as the HTTP responder is: claim, renewal, completion (retried for
the lease's life), release and orphans are the core's, and behave as for a request:

    claim ─┬─ CLAIMED / TAKEN_OVER ─► run the function (lease renewed meanwhile)
           │                          ├─ returned: its result, encoded, completes the key
           │                          └─ raised:   the key is released, the error re-raised
           ├─ COMPLETED ─► the stored result, decoded (the function does not run)
           ├─ MISMATCH ──► KeyReused
           └─ IN_PROGRESS ─► InProgress(retry_after), or wait up to ``wait`` for the
                             holder's result (:mod:`.waiting`, as ``Policy(wait=...)``)

The record's request hash is a fingerprint of the call: SHA-256 of the canonical JSON
of the function's qualified name and its bound arguments, defaults applied. The result
is the record's body (``StoredResponse(200, (), body)``), encoded by the codec.

Each call is observed as the middleware observes a request: one outcome (executed,
replayed, in_progress, mismatch, store_unavailable, released) counted under the
namespace in place of a route template, in the :class:`Once`'s own counts and the
metrics sink it was given (the one the middleware uses, say); take-overs and store
latency as well. With a tracer provider set, a span of its own per call carries the
outcome (:mod:`.tracing`), with a child span per store operation.

Synchronous functions run in the calling thread; their store calls run on an event
loop of the :class:`Once`'s own, in a thread of its own, because a store serves one
event loop at a time (:mod:`.stores.loops`): ``asyncio.run`` per call from several
threads would drive one store from several loops at once.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Collection, Coroutine
from datetime import datetime, timedelta
from typing import Any, Literal, ParamSpec, TypeVar, cast, overload

from asgi_idempotency.core.errors import InProgress, KeyReused, StoreError
from asgi_idempotency.core.execution import Execution, Runner
from asgi_idempotency.core.lifecycle import ClaimOutcome
from asgi_idempotency.core.terms import DEFAULT_TTL, LEASE_NOT_GIVEN, ExecutionTerms
from asgi_idempotency.functions.calls import (
    NO_WAIT_IN_TRANSACTIONS,
    ORJSON,
    Call,
    Codec,
    check_namespace,
    check_wait,
    fingerprint,
    key_of,
    qualname,
    record_key,
    without_session,
)
from asgi_idempotency.functions.loop import LoopThread, settled
from asgi_idempotency.observability import tracing
from asgi_idempotency.observability.metrics import MetricsSink, MetricsSnapshot, Outcome
from asgi_idempotency.observability.observer import Observer, store_label
from asgi_idempotency.stores.base import Store, StoredResponse, utcnow

__all__ = ["Codec", "InProgress", "KeyReused", "Once", "fingerprint", "record_key"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Once:
    """Run functions at most once per key, their results stored and returned again.

    ``Once(store, ttl=timedelta(hours=24), lease=timedelta(seconds=30))``, then guard a
    function with ``@once(key=...)`` or call one with ``await once.call(key, fn, ...)``.

    Args:
        store: any :class:`~.stores.base.Store` (shared with the middleware or not:
            function records have keys of their own).
        ttl: how long a result is kept and returned again (default 24 hours).
        lease: how long a running call holds its key without renewal before another
            may take it over (default: the smaller of 30 s and ``ttl``); renewed
            every third of it while the function runs, so it bounds a dead holder's
            silence, not the function's run time. Both validated as :class:`.Policy`'s.
        namespace: scopes the keys; default, per function, its module and qualified name.
            Two functions given one namespace and one key raise :class:`KeyReused`.
        wait: how long a call waits for the result of a key another holder is running
            before it raises :class:`InProgress` (default ``None``: raise at once).
            Unlike ``Policy(wait=...)`` it may exceed the lease (to wait out a dead
            holder and take its key over). As ``Policy(wait=...)``: a holder in this
            process tells its waiters when it ends, one held elsewhere is read with
            backoff, once per key however many calls wait; if the holder raises (its
            key released), one waiting call runs the function and the others wait for
            its result.
        retry_after: seconds :class:`InProgress` suggests, capped by the holder's lease,
            and the longest pause between two reads of a key held elsewhere while
            waiting (default 1.0, as the middleware's; reads pause 0.5 s at most).
        codec: ``dumps``/``loads`` between a result and bytes (default orjson: JSON
            values). Every call returns the result after a trip through the codec,
            the first included, so a result it does not round-trip shows at once.
        clock: the current aware UTC time: the lease clock of stores on one host
            (memory, SQLite; tests); shared stores decide leases on their own clock.
        metrics: a :class:`~.metrics.MetricsSink` (e.g. the middleware's
            ``PrometheusMetrics``) that receives one ``observe(namespace, outcome)`` per
            call, and store latencies and take-overs if it takes them. The namespace
            stands where a request's route template would (``route`` label); a namespace
            never starts with ``/`` and a template always does, so the two stay apart.
            Counted in process whatever it is: :meth:`snapshot`.

    Raises:
        TypeError, ValueError: as :class:`.Policy` for ``ttl``/``lease``/``wait``; an
            empty namespace, or one starting with ``/``.
    """

    def __init__(
        self,
        store: Store,
        *,
        ttl: timedelta = DEFAULT_TTL,
        lease: timedelta = LEASE_NOT_GIVEN,
        namespace: str | None = None,
        wait: timedelta | None = None,
        retry_after: float = 1.0,
        codec: Codec | None = None,
        clock: Callable[[], datetime] = utcnow,
        metrics: MetricsSink | None = None,
    ) -> None:
        terms = ExecutionTerms(ttl=ttl, lease=lease)  # a route's rules, and its lease default
        self.store = store
        self.ttl, self.lease, self._renew_every = terms.ttl, terms.lease, terms.renew_every
        self.namespace = None if namespace is None else check_namespace(namespace)
        self.wait = check_wait(wait)
        self.retry_after = retry_after
        self.codec: Codec = ORJSON() if codec is None else codec
        self.clock = clock
        self._terms = terms
        self._observer = Observer(metrics, store_label(store))
        # The claim, completion and release: the same core as the HTTP responder's.
        self._core = Runner(
            store, clock=clock, fail_open=False, retry_after=retry_after, observer=self._observer
        )
        self._thread: LoopThread | None = None
        self._thread_lock = threading.Lock()

    @overload
    def __call__(
        self,
        *,
        key: Callable[..., str],
        namespace: str | None = None,
        wait: timedelta | None = None,
        exclude: Collection[str] = (),
        transactional: Literal[False] = False,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]: ...

    @overload
    def __call__(
        self,
        *,
        key: Callable[..., str],
        namespace: str | None = None,
        wait: timedelta | None = None,
        exclude: Collection[str] = (),
        transactional: Literal[True],
    ) -> Callable[[Callable[..., Awaitable[R]]], Callable[..., Awaitable[R]]]:
        # Callers call it without the session the guard passes: a signature a
        # ParamSpec cannot spell (one keyword fewer), so the guarded function's
        # arguments go unchecked and its result keeps its type.
        ...

    def __call__(
        self,
        *,
        key: Callable[..., str],
        namespace: str | None = None,
        wait: timedelta | None = None,
        exclude: Collection[str] = (),
        transactional: bool = False,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Guard a function, async or sync; ``key`` takes the call's own arguments.

        ``exclude`` names parameters left out of the fingerprint (a session, a logger).
        A sync function runs in its caller's thread, which may have no event loop.

        ``transactional``: the function is async and takes a keyword parameter
        ``session``; each run gets an SQLAlchemy ``AsyncSession`` in the store
        transaction that holds the claim, and its writes commit with the record (or,
        when it raises, roll back with the claim). Callers call it without ``session``,
        which is not part of the fingerprint. Needs a store with transactions
        (``SQLStore`` on Postgres or MariaDB).

        Raises:
            TypeError: ``transactional`` on a sync function, or one without a
                ``session`` parameter.
            ValueError: ``transactional`` on a store without transactions.
        """
        wait_ = self.wait if wait is None else check_wait(wait)
        given = self.namespace if namespace is None else check_namespace(namespace)
        excluded = frozenset(exclude)
        if transactional:
            self.require_transactions()
            if wait is not None:
                raise ValueError(NO_WAIT_IN_TRANSACTIONS)
            wait_ = None

        def guard(fn: Callable[P, R]) -> Callable[P, R]:
            signature = inspect.signature(fn)
            name = qualname(fn)
            space = given or f"{fn.__module__}.{name}"
            if transactional:
                signature = without_session(fn, signature)

            def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
                return Call(
                    record_key(space, key_of(key(*args, **kwargs))),
                    fingerprint(name, signature, args, kwargs, excluded),
                    space,
                    wait_,
                    name,
                    transactional,
                )

            if inspect.iscoroutinefunction(fn):
                run = cast(Callable[P, Awaitable[Any]], fn)

                @functools.wraps(fn)
                async def guarded_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                    call = prepare(args, kwargs)
                    return await self._run(call, functools.partial(run, *args, **kwargs))

                return cast(Callable[P, R], guarded_async)

            @functools.wraps(fn)
            def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
                call = prepare(args, kwargs)
                return cast(R, self._run_sync(call, functools.partial(fn, *args, **kwargs)))

            return guarded

        return guard

    async def call(
        self, key: str, fn: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Run ``await fn(*args, **kwargs)`` once for ``key``; its result, or the stored one.

        ``transactional=True`` among the keywords (not passed on to ``fn``) runs ``fn``
        as ``@once(..., transactional=True)`` does: with ``session=`` an ``AsyncSession``
        in the transaction that holds the claim and commits with the record. (A type
        checker reads the keywords as ``fn``'s and does not know this one: the
        decorator is the typed form.)

        Raises:
            KeyReused: ``key`` was used with other arguments (or another function).
            InProgress: another holder runs it (after ``wait``, if set); ``retry_after``.
            StoreError: the store failed before the function ran (it did not run).
            CanonicalJSONError, TypeError: the arguments (see :func:`fingerprint`).
            Whatever ``fn`` raises, after the key is released.
        """
        transactional = bool(kwargs.pop("transactional", False))
        if transactional:
            self.require_transactions()
            name = qualname(fn)
            space = self.namespace or f"{getattr(fn, '__module__', None)}.{name}"
            signature = without_session(fn, inspect.signature(fn))
            digest = fingerprint(name, signature, args, kwargs)
            call = Call(record_key(space, key_of(key)), digest, space, None, name, True)
        else:
            call = self._prepare(key, fn, args, kwargs)
        return cast(R, await self._run(call, functools.partial(fn, *args, **kwargs)))

    def call_sync(self, key: str, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """:meth:`call` for a synchronous function, from a thread (event loop or not)."""
        call = self._prepare(key, fn, args, kwargs)
        return cast(R, self._run_sync(call, functools.partial(fn, *args, **kwargs)))

    def require_transactions(self) -> None:
        """Refuse transactional mode on a store that cannot honour it (before any run).

        Raises:
            ValueError: the store has no transactions; the message names transactional mode.
        """
        why = self._core.transactions_unavailable()
        if why is not None:
            raise ValueError(
                "transactional=True needs a store with transactions (SQLStore on "
                f"postgresql+asyncpg:// or mariadb+asyncmy://): {why}"
            )

    def count(self, namespace: str, outcome: Outcome) -> None:
        """Count a call an adapter refused before it reached this guard (a missing or
        invalid key, a caller it cannot name), as the middleware counts a request it
        refused: in :meth:`snapshot` and the metrics sink, under ``namespace``."""
        self._observer.counted(namespace, outcome)

    def snapshot(self) -> MetricsSnapshot:
        """This guard's outcome counts so far, by namespace (in the route's place) and outcome."""
        return self._observer.counts.snapshot()

    def close(self) -> None:
        """Stop the event loop of synchronous calls, if one was started (idempotent).

        The store's connections opened on that loop are closed as it shuts down; the
        store itself stays open (it is the caller's).
        """
        with self._thread_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.close()

    # -- the steps, each on the loop that drives the store -------------------------

    def _prepare(
        self, key: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Call:
        name = qualname(fn)
        space = self.namespace or f"{getattr(fn, '__module__', None)}.{name}"
        digest = fingerprint(name, inspect.signature(fn), args, kwargs)
        return Call(record_key(space, key_of(key)), digest, space, self.wait, name)

    async def _run(self, call: Call, fn: Callable[..., Awaitable[Any]]) -> Any:
        with tracing.function_span(call.namespace, call.function) as opened:
            span = self._recording(call, opened)
            try:
                got = await self._on_store_loop(
                    self._claim(call, span), unheard=functools.partial(self._unheard, call)
                )
            except Exception as exc:
                self._refused(call, span, exc)
                raise
            if isinstance(got, bytes):
                self._outcome(call, span, Outcome.REPLAYED)
                return self.codec.loads(got)
            try:
                if got.tx is None:
                    result = await fn()
                else:
                    result = await fn(session=got.tx.state.session)
            except Exception:
                self._outcome(call, span, Outcome.RELEASED)
                await self._on_store_loop(self._release(call, got, span))
                raise
            except BaseException:
                # Cancelled (or interrupted) part-way: the effect may or may not have
                # happened. As the HTTP side does, the claim stays until its lease ends
                # rather than inviting a rerun now; then a later call takes it over.
                self._on_loop_of_store(self._abandon, call, got)
                raise
            return await self._on_store_loop(self._finish(call, got, result, span))

    def _run_sync(self, call: Call, fn: Callable[[], Any]) -> Any:
        thread = self._loop_thread()
        with tracing.function_span(call.namespace, call.function) as opened:
            span = self._recording(call, opened)
            try:
                got = thread.submit(self._claim(call, span))
            except Exception as exc:
                self._refused(call, span, exc)
                raise
            if isinstance(got, bytes):
                self._outcome(call, span, Outcome.REPLAYED)
                return self.codec.loads(got)
            try:
                result = fn()
            except Exception:
                self._outcome(call, span, Outcome.RELEASED)
                thread.submit(self._release(call, got, span))
                raise
            except BaseException:
                thread.loop.call_soon_threadsafe(self._abandon, call, got)
                raise
            return thread.submit(self._finish(call, got, result, span))

    # -- what operators see: counts, and the call's own span ------------------------

    @staticmethod
    def _recording(call: Call, span: Any) -> Any:
        """The call's span if it records (its key digest set), else ``None``."""
        if span is None or not span.is_recording():
            return None
        tracing.annotate(span, key_digest=call.key[:16])
        return span

    def _outcome(self, call: Call, span: Any, outcome: Outcome) -> None:
        self._observer.counted(call.namespace, outcome)
        if span is not None:
            tracing.annotate(span, outcome=outcome.value)

    def _refused(self, call: Call, span: Any, exc: Exception) -> None:
        """Count the guard's own answer to a call it did not run (raised to the caller)."""
        if isinstance(exc, KeyReused):
            self._outcome(call, span, Outcome.MISMATCH)
        elif isinstance(exc, InProgress):
            self._outcome(call, span, Outcome.IN_PROGRESS)
        elif isinstance(exc, StoreError):
            # Logged as the middleware logs the claim a 503 answered: the function did not run.
            unavailable = Outcome.STORE_UNAVAILABLE
            self._observer.store_error(
                call.namespace, call.key, "claim", exc, outcome=unavailable.value
            )
            self._outcome(call, span, unavailable)

    async def _claim(self, call: Call, span: Any = None) -> bytes | Execution:
        """Claim the key: the stored result's bytes, or the claim (its lease renewed)."""
        execution = await self._core.claim(
            call.key,
            call.fingerprint,
            call.namespace,
            self._terms,
            span=span,
            wait=call.wait,
            transactional=call.transactional,
        )
        if execution.owned:
            return execution
        await self._core.close(execution)  # a transaction's, rolled back: nothing of ours ran
        claim = execution.claim
        assert claim is not None  # a claim was made (not a transaction alone)
        record, outcome = claim.record, claim.outcome
        if outcome is ClaimOutcome.COMPLETED:
            assert record is not None
            assert record.response is not None
            # The middleware's replay event, without its status: a result has none.
            self._log(logging.INFO, "idempotency.replay", call, outcome="replayed")
            return record.response.body
        if outcome is ClaimOutcome.MISMATCH:
            self._log(logging.INFO, "idempotency.mismatch", call, outcome="mismatch")
            raise KeyReused(
                f"key (digest {call.key[:16]}) of namespace {call.namespace!r} was used "
                "with other arguments or another function; use a new key for a new call"
            )
        wait = self._core.in_progress_wait(execution)
        raise InProgress(
            f"key (digest {call.key[:16]}) of namespace {call.namespace!r} is held "
            f"by a running call; retry in {wait:.3g} s",
            retry_after=wait,
        )

    async def _finish(self, call: Call, owned: Execution, result: Any, span: Any = None) -> Any:
        """Complete the key with ``result``; return it as a replay would (via the codec)."""
        self._core.stop(owned)
        try:
            body = self.codec.dumps(result)
        except Exception:
            # Nothing can be stored: released as if the function had raised, so the
            # error shows on the first call, not as a broken replay later.
            self._outcome(call, span, Outcome.RELEASED)
            await self._release(call, owned, span)
            raise
        # The function ran: executed, whether or not the store keeps its result (as the
        # middleware counts a request whose completion failed). A completion the store
        # fails is tried again in the background, for the lease's life (the core's).
        stored = StoredResponse(200, (), body)
        if owned.tx is not None:
            # The commit is the effect: if it fails, nothing happened, and the caller
            # hears so (StoreError) rather than a result that was never kept.
            try:
                await self._core.complete(owned, stored, span=span)
            except StoreError as exc:
                unavailable = Outcome.STORE_UNAVAILABLE
                self._observer.store_error(call.namespace, call.key, "commit", exc,
                                           outcome=unavailable.value)  # fmt: skip
                self._outcome(call, span, unavailable)
                raise
            self._outcome(call, span, Outcome.EXECUTED)
            return self.codec.loads(body)
        self._outcome(call, span, Outcome.EXECUTED)
        await self._core.complete(owned, stored, span=span)
        return self.codec.loads(body)

    async def _release(self, call: Call, owned: Execution, span: Any = None) -> None:
        # The function's own error is the one raised; a release the store fails is
        # logged, and the claim lapses after its lease.
        await self._core.release(owned, span=span)

    def _abandon(self, call: Call, owned: Execution) -> None:
        self._core.abandon(owned)

    def _log(self, level: int, event: str, call: Call, **fields: Any) -> None:
        self._observer.log(level, event, call.namespace, call.key, **fields)

    # -- which event loop drives the store ------------------------------------------

    def _loop_thread(self) -> LoopThread:
        with self._thread_lock:
            if self._thread is None:
                self._thread = LoopThread()
            return self._thread

    async def _on_store_loop(
        self, coro: Coroutine[Any, Any, T], unheard: Callable[[T], None] | None = None
    ) -> T:
        """Await ``coro`` on the loop that drives the store.

        The caller's loop, until synchronous calls have started this guard's own loop;
        from then on that one, so that the store never serves two loops at once. Across
        loops, ``unheard`` is given ``coro``'s result, on the guard's loop, when the
        caller was cancelled before that result reached it.
        """
        thread = self._thread
        if thread is None or asyncio.get_running_loop() is thread.loop:
            return await coro
        answer = asyncio.run_coroutine_threadsafe(coro, thread.loop)
        try:
            return await asyncio.wrap_future(answer)
        except asyncio.CancelledError:
            if unheard is not None:
                # The answer crosses one hop after it was decided: a caller cancelled
                # within it never hears it. Handed over on the guard's loop.
                answer.add_done_callback(functools.partial(settled, thread.loop, unheard))
            raise

    def _unheard(self, call: Call, got: bytes | Execution) -> None:
        """A claim decided on the guard's loop whose caller was cancelled before the
        answer reached it: the function never runs, so a claim that is the caller's is
        released (token-fenced), where otherwise it would stay in progress, renewed, for
        as long as the guard's loop runs. (A cancellation that reaches the claim while
        it is still in flight is the lifecycle's: ``orphaned``.)"""
        if isinstance(got, Execution):
            self._core.release_later(got)

    def _on_loop_of_store(self, fn: Callable[..., None], *args: Any) -> None:
        thread = self._thread
        if thread is None:
            fn(*args)
        else:
            thread.loop.call_soon_threadsafe(fn, *args)

"""``IdempotencyMiddleware``: a pure ASGI guard that runs a handler once per key.

The middleware object holds configuration; a fresh :class:`_Guard` per request
holds that request's state. Flow for a guarded request: policy → key → body and
fingerprint → one atomic claim → run and capture → complete (or release) → send.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Iterable, Mapping
from datetime import datetime
from typing import Any, TypeVar

from .asgi import ASGIApp, Headers, Message, Receive, Scope, Send, send_response
from .fingerprint import fingerprint
from .keys import (
    HEADER,
    PrincipalFunc,
    default_principal,
    parse_key,
    resolve_principal,
    scoped_key,
)
from .metrics import MetricsSink, Outcome
from .policy import Policy, RouteResolver, has_router, iter_endpoint_policies, lookup
from .problems import (
    BodyTooLarge,
    IdempotencyError,
    InvalidKey,
    KeyMismatch,
    MissingKey,
    RequestInProgress,
    StoreUnavailable,
)
from .stores.base import (
    Claim,
    ClaimOutcome,
    Store,
    StoredResponse,
    StoreError,
    decide,
    utcnow,
)

__all__ = ["IdempotencyMiddleware"]

logger = logging.getLogger("asgi_idempotency")
T = TypeVar("T")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# Outcomes a retry could change: not final, so the key is released rather than stored.
RELEASED_STATUSES = frozenset({408, 409, 425, 429})
# Never stored or replayed: hop-by-hop (RFC 9110 §7.6.1), Date (the replay is sent now),
# Set-Cookie (a replayed session cookie is a session handed to whoever holds the key).
_UNSTORED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"date",
        b"set-cookie",
    }
)
_REPLAYED = (b"idempotent-replayed", b"true")


def storable_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    """The response headers that may be replayed to a later request with the same key."""
    kept: list[tuple[bytes, bytes]] = []
    named: set[bytes] = set()
    for name, value in headers:
        lowered = name.lower()
        if lowered in _UNSTORED:
            if lowered == b"connection":  # the headers it names are hop-by-hop too
                named.update(v.strip().lower() for v in value.split(b","))
            continue
        kept.append((name, value))
    if named:
        return tuple((n, v) for n, v in kept if n.lower() not in named)
    return tuple(kept)


class IdempotencyMiddleware:
    """Enforce ``Idempotency-Key`` on a Starlette or FastAPI app.

    Args:
        app: the ASGI app to guard.
        store: a :class:`~asgi_idempotency.SQLStore` or :class:`~asgi_idempotency.MemoryStore`.
        policies: explicit policies by ``"METHOD /route/{template}"`` (or a bare template
            for every method); they win over ``@idempotent`` on the endpoint.
        default_policy: applied to requests in ``methods`` on routes with no policy,
            when they carry the header (default: key optional, 24 h ttl, 30 s lease).
        methods: methods guarded by default (default POST and PATCH). Safe methods
            (GET, HEAD, OPTIONS, TRACE) are never guarded.
        principal: ``scope -> str | None`` (sync or async) naming who owns a key;
            default: Starlette's authenticated user, else anonymous.
        fail_open: when the store fails, run the handler unguarded instead of 503.
            Off by default: a guard that opens under load protects nothing.
        metrics: receives one ``observe(route, outcome)`` per guarded request.
        clock: returns the current aware UTC time (tests drive leases with it).
        retry_after: seconds sent in ``Retry-After`` with a 503, and with a 409 unless
            the running claim's lease ends sooner (default 1).
        prune_interval: when set, delete expired records every this many seconds
            in the background while the app's lifespan runs (default: off; prune
            from cron with ``asgi-idempotency prune`` instead).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        policies: Mapping[str, Policy] | None = None,
        default_policy: Policy | None = None,
        methods: Iterable[str] = ("POST", "PATCH"),
        principal: PrincipalFunc = default_principal,
        fail_open: bool = False,
        metrics: MetricsSink | None = None,
        clock: Callable[[], datetime] = utcnow,
        retry_after: float = 1.0,
        prune_interval: float | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.policies = dict(policies or {})
        self.default_policy = default_policy or Policy()
        self.methods = frozenset(m.upper() for m in methods)
        self.principal = principal
        self.fail_open = fail_open
        self.metrics = metrics
        self.clock = clock
        self.retry_after = retry_after
        self.prune_interval = prune_interval
        self._resolve = RouteResolver()
        # Completions and releases outlive a cancelled request; keep them referenced.
        self._background: set[asyncio.Task[Any]] = set()
        self.check_policies()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        resolved = self._resolve(scope)
        if resolved is None and has_router(scope):
            # The router will answer 404 or 405: no handler runs, nothing to guard.
            await self.app(scope, receive, send)
            return
        policy = lookup(self.policies, method, resolved, scope["path"])
        if policy is None and method in self.methods:
            policy = self.default_policy
        if policy is None or not policy.enabled:
            await self.app(scope, receive, send)
            return
        # A bare ASGI app has no templates; one label keeps metrics' cardinality bounded.
        route = resolved.template if resolved is not None else "<unrouted>"
        await _Guard(self, policy, route, scope, receive, send).run()

    def transactional_engine(self) -> Any:
        """The Postgres engine transactional routes run on.

        Raises:
            ValueError: the store is not a Postgres :class:`SQLStore`.
        """
        engine = getattr(self.store, "engine", None)
        if engine is None or getattr(self.store, "dialect", None) != "postgresql":
            where = getattr(self.store, "dialect", None)
            raise ValueError(
                "Policy(transactional=True) needs SQLStore on Postgres "
                f"(postgresql+asyncpg://...); this middleware has {type(self.store).__name__}"
                + (f" on {where}" if where else "")
            )
        return engine

    def check_policies(self, app: Any = None) -> None:
        """Refuse transactional policies on a store that cannot honour them.

        Checks ``policies``, the default policy and, given the app, every
        ``@idempotent`` endpoint its router reaches. Runs at construction and again
        at lifespan startup, so a misconfiguration stops the app from starting.

        Raises:
            ValueError: a transactional policy on a store other than Postgres.
        """
        found = [p for p in (*self.policies.values(), self.default_policy) if p.transactional]
        if app is not None:
            found += [p for p in iter_endpoint_policies(app) if p.transactional]
        if found:
            self.transactional_engine()

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                self.check_policies(scope.get("app"))
            except ValueError as exc:
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
        first = True

        async def replay() -> Message:
            nonlocal first
            if first:
                first = False
                return message
            return await receive()

        if self.prune_interval is None:
            await self.app(scope, replay, send)
            return
        from .retention import PruningMiddleware

        pruning = PruningMiddleware(self.app, store=self.store, interval=self.prune_interval)
        await pruning(scope, replay, send)

    def _observe(self, route: str, outcome: Outcome) -> None:
        if self.metrics is not None:
            self.metrics.observe(route, outcome)

    async def _store_call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run a completion or release to the end, even if this request is cancelled.

        Awaited directly: no task and no extra loop turns on the common path. If a
        cancellation interrupts it, the same statement runs again in a task of its
        own; both are fenced by the claim's token, so a second run changes nothing
        a first one that did land had not already done.
        """
        try:
            return await make()
        except asyncio.CancelledError:
            self._finish_in_background(make())
            raise

    def _finish_in_background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_background_failure)

    async def _shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` to the end even if this request is cancelled meanwhile."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return await asyncio.shield(task)


class _Guard:
    """One guarded request's state."""

    __slots__ = ("_renewal", "key", "mw", "policy", "receive", "route", "scope", "send")

    def __init__(
        self,
        mw: IdempotencyMiddleware,
        policy: Policy,
        route: str,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        self.mw, self.policy, self.route = mw, policy, route
        self.scope, self.receive, self.send = scope, receive, send
        self.key = ""
        # The lease renewal: a timer until the first renewal is due, then a task.
        self._renewal: asyncio.TimerHandle | asyncio.Task[None] | None = None

    def _log(
        self, level: int, event: str, outcome: Outcome | ClaimOutcome | None = None, **fields: Any
    ) -> None:
        if not logger.isEnabledFor(level):
            return  # replays log at INFO: skip building the record when nobody listens
        if outcome is not None:
            fields["outcome"] = outcome.value
        # Digests only: the scoped key is already a sha256 of (principal, key).
        logger.log(
            level,
            event,
            extra={"event": event, "route": self.route, "key_digest": self.key[:16], **fields},
        )

    async def _reject(self, error: IdempotencyError, outcome: Outcome) -> None:
        self.mw._observe(self.route, outcome)
        await error.send(self.send)

    async def run(self) -> None:
        scope, policy = self.scope, self.policy
        try:
            raw_key, content_type, declared_length = _guard_headers(scope["headers"])
            if raw_key is None:
                if policy.required:
                    raise MissingKey(
                        "This endpoint requires an Idempotency-Key header; generate one key "
                        "per logical operation and send the same key on every retry."
                    )
                self.mw._observe(self.route, Outcome.UNGUARDED)
                await self.mw.app(scope, self.receive, self.send)
                return
            client_key = parse_key(raw_key)
        except MissingKey as exc:
            await self._reject(exc, Outcome.MISSING_KEY)
            return
        except IdempotencyError as exc:
            await self._reject(exc, Outcome.INVALID_KEY)
            return
        try:
            body = await self._read_body(declared_length)
        except BodyTooLarge as exc:
            await self._reject(exc, Outcome.TOO_LARGE)
            return
        if body is None:
            return  # the client left while sending its body: nothing ran, nothing to answer

        chosen = (
            [(n.lower(), v) for n, v in scope["headers"] if n.lower() in policy.header_names]
            if policy.header_names
            else ()
        )
        request_hash = fingerprint(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            body,
            content_type=content_type,
            headers=chosen,
        )
        principal = await resolve_principal(self.mw.principal, scope)
        self.key = scoped_key(principal, client_key)
        if policy.transactional:
            await self._execute_transactional(body, request_hash)
        else:
            await self._claim_and_run(body, request_hash)

    async def _read_body(self, declared_length: bytes | None) -> bytes | None:
        limit = self.policy.max_body_bytes
        if declared_length is not None:
            try:
                declared = int(declared_length)
            except ValueError:
                declared = -1  # the server has framed the body anyway; the count below decides
            if declared > limit:
                raise BodyTooLarge(self._too_large_detail())
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return None
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(self._too_large_detail())
            if not message.get("more_body", False):
                if not chunks:
                    return chunk  # the whole body in one message, as small bodies come
                chunks.append(chunk)
                return b"".join(chunks)
            chunks.append(chunk)

    def _too_large_detail(self) -> str:
        return f"The request body exceeds {self.policy.max_body_bytes} bytes for this endpoint."

    async def _claim_and_run(self, body: bytes, request_hash: str) -> None:
        mw, policy = self.mw, self.policy
        now = mw.clock()
        token = _new_token()
        try:
            claim = await mw.store.claim(
                self.key,
                request_hash,
                token,
                now=now,
                locked_until=now + policy.lease,
                expires_at=now + policy.ttl,
            )
        except StoreError as exc:
            await self._store_unavailable(body, exc, "claim")
            return
        if claim.owned:
            if claim.outcome is ClaimOutcome.TAKEN_OVER:
                self._log(logging.WARNING, "idempotency.takeover", outcome=claim.outcome)
            await self._execute(body, token)
            return
        await self._answer_existing(claim, now)

    async def _store_unavailable(self, body: bytes, exc: BaseException, phase: str) -> None:
        mw = self.mw
        self._log(
            logging.ERROR,
            "idempotency.store_error",
            phase=phase,
            error=type(exc).__name__,
            outcome=Outcome.STORE_UNAVAILABLE,
        )
        mw._observe(self.route, Outcome.STORE_UNAVAILABLE)
        if mw.fail_open:
            await mw.app(self.scope, _replay_body(body, self.receive), self.send)
            return
        await StoreUnavailable(
            "The idempotency store is unavailable and the request was not processed; "
            "retry with the same Idempotency-Key.",
            retry_after=mw.retry_after,
        ).send(self.send)

    @staticmethod
    def _in_progress(retry_after: float) -> RequestInProgress:
        return RequestInProgress(
            "A request with this Idempotency-Key is still being processed; "
            "retry after the Retry-After interval to get its response.",
            retry_after=retry_after,
        )

    async def _answer_existing(self, claim: Claim, now: datetime) -> None:
        record = claim.record
        assert record is not None
        if claim.outcome is ClaimOutcome.MISMATCH:
            self._log(logging.WARNING, "idempotency.mismatch", outcome=Outcome.MISMATCH)
            await self._reject(
                KeyMismatch(
                    "This Idempotency-Key was already used with a different request "
                    "(method, path, query or body). Use a new key for a new operation."
                ),
                Outcome.MISMATCH,
            )
        elif claim.outcome is ClaimOutcome.COMPLETED:
            response = record.response
            assert response is not None
            self._log(
                logging.INFO,
                "idempotency.replay",
                status=response.status,
                outcome=Outcome.REPLAYED,
            )
            self.mw._observe(self.route, Outcome.REPLAYED)
            await send_response(
                self.send, response.status, [*response.headers, _REPLAYED], response.body
            )
        else:
            # Most handlers finish long before their lease ends: suggest the short retry
            # interval, never longer than the lease itself has left.
            remaining = (record.locked_until - now).total_seconds()
            wait = min(remaining, self.mw.retry_after)
            await self._reject(self._in_progress(wait), Outcome.IN_PROGRESS)

    async def _run_captured(self, body: bytes) -> tuple[Message, bytes]:
        """Run the app on the buffered body; hold its response back instead of sending it."""
        start: Message | None = None
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.mw.app(self.scope, _replay_body(body, self.receive), capture)
        if start is None:
            raise RuntimeError("the application returned without sending a response")
        return start, b"".join(chunks)

    async def _send_captured(self, start: Message, content: bytes) -> None:
        await self.send(start)
        await self.send({"type": "http.response.body", "body": content, "more_body": False})

    def _renew_lease_while_running(self, token: str) -> None:
        """Renew the claim's lease every third of the lease until stopped.

        A timer, not a task, until the first renewal is due, so a handler that
        finishes within a third of the lease costs no renewal statement and no task.
        """
        loop = asyncio.get_running_loop()
        self._renewal = loop.call_later(self.policy.renew_every, self._start_renewing, token)

    def _start_renewing(self, token: str) -> None:
        self._renewal = asyncio.ensure_future(self._renew(token))

    async def _renew(self, token: str) -> None:
        mw, policy = self.mw, self.policy
        while True:
            try:
                owned = await mw.store.renew(
                    self.key, token, locked_until=mw.clock() + policy.lease
                )
            except StoreError as exc:
                owned = True  # transient; the next tick tries again before the lease ends
                self._log(logging.WARNING, "idempotency.renew_failed", error=type(exc).__name__)
            if not owned:
                self._log(logging.ERROR, "idempotency.claim_lost", phase="renew")
                return
            await asyncio.sleep(policy.renew_every)

    def _stop_renewing(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None

    async def _execute(self, body: bytes, token: str) -> None:
        mw = self.mw
        self._renew_lease_while_running(token)
        try:
            start, content = await self._run_captured(body)
        except asyncio.CancelledError:
            # Cancelled part-way: the effect may or may not have happened, so the
            # claim stays in progress until its lease ends rather than inviting a rerun.
            self._stop_renewing()
            self._log(logging.WARNING, "idempotency.cancelled")
            raise
        except BaseException:
            self._stop_renewing()
            await self._release(token)
            raise
        self._stop_renewing()

        status: int = start["status"]
        if status >= 500 or status in RELEASED_STATUSES:
            await self._release(token)
        else:
            await self._complete(token, status, start.get("headers", []), content)
            mw._observe(self.route, Outcome.EXECUTED)
        await self._send_captured(start, content)

    async def _execute_transactional(self, body: bytes, request_hash: str) -> None:
        """Claim, run and complete inside one Postgres transaction (see ``transactional``)."""
        from sqlalchemy.ext.asyncio import AsyncSession

        from .transactional import (
            DATABASE_ERRORS,
            IdempotencyTransaction,
            claim_in_transaction,
            complete_in_transaction,
        )

        mw, policy = self.mw, self.policy
        now = mw.clock()
        token = _new_token()
        try:
            conn = await mw.transactional_engine().connect()
        except DATABASE_ERRORS as exc:
            await self._store_unavailable(body, exc, "claim")
            return
        try:
            try:
                await conn.begin()
                claim = await claim_in_transaction(
                    conn,
                    self.key,
                    request_hash,
                    token,
                    now=now,
                    locked_until=now + policy.lease,
                    expires_at=now + policy.ttl,
                )
            except DATABASE_ERRORS as exc:
                await self._store_unavailable(body, exc, "claim")
                return
            if not claim.locked:
                await self._reject(self._in_progress(mw.retry_after), Outcome.IN_PROGRESS)
                return
            if claim.existing is not None:
                existing = claim.existing
                await self._answer_existing(
                    Claim(decide(existing, request_hash, now), existing), now
                )
                return

            session = AsyncSession(bind=conn)
            self.scope.setdefault("state", {})["idempotency"] = IdempotencyTransaction(
                conn, session
            )
            try:
                start, content = await self._run_captured(body)
            except asyncio.CancelledError:
                raise  # closing the connection below rolls back the claim and the writes
            except BaseException:
                mw._observe(self.route, Outcome.RELEASED)
                raise
            status: int = start["status"]
            if status >= 500 or status in RELEASED_STATUSES:
                mw._observe(self.route, Outcome.RELEASED)
                await self._send_captured(start, content)
                return

            async def commit() -> None:
                await session.flush()
                stored = StoredResponse(status, storable_headers(start.get("headers", [])), content)
                await complete_in_transaction(
                    conn, self.key, token, stored, expires_at=mw.clock() + policy.ttl
                )
                await conn.commit()

            try:
                await mw._shielded(commit())
            except DATABASE_ERRORS as exc:
                # Nothing is recorded and the writes rolled back, or the commit's answer
                # was lost; either way the same key retried replays or runs exactly once.
                self._log(
                    logging.ERROR,
                    "idempotency.store_error",
                    phase="commit",
                    error=type(exc).__name__,
                    outcome=Outcome.STORE_UNAVAILABLE,
                )
                mw._observe(self.route, Outcome.STORE_UNAVAILABLE)
                await StoreUnavailable(
                    "The request's changes could not be committed; retry with the same "
                    "Idempotency-Key.",
                    retry_after=mw.retry_after,
                ).send(self.send)
                return
            mw._observe(self.route, Outcome.EXECUTED)
            await self._send_captured(start, content)
        finally:
            # Returns the connection to the pool; an open transaction is rolled back.
            await mw._shielded(conn.close())

    async def _complete(self, token: str, status: int, headers: Headers, body: bytes) -> None:
        stored = StoredResponse(status, storable_headers(headers), body)
        expires_at = self.mw.clock() + self.policy.ttl
        try:
            owned = await self.mw._store_call(
                lambda: self.mw.store.complete(self.key, token, stored, expires_at=expires_at)
            )
        except StoreError as exc:
            # The effect happened but is not recorded: the client still gets the true
            # response; the row stays in progress until its lease ends (README: guarantees).
            self._log(
                logging.ERROR, "idempotency.store_error", phase="complete", error=type(exc).__name__
            )
            return
        if not owned:
            self._log(logging.ERROR, "idempotency.claim_lost", phase="complete")

    async def _release(self, token: str) -> None:
        self.mw._observe(self.route, Outcome.RELEASED)
        try:
            await self.mw._store_call(lambda: self.mw.store.release(self.key, token))
        except StoreError as exc:
            self._log(
                logging.ERROR, "idempotency.store_error", phase="release", error=type(exc).__name__
            )


def _new_token() -> str:
    """A claim's fencing token: 128 random bits (what secrets.token_hex does, minus a call)."""
    return os.urandom(16).hex()


def _guard_headers(headers: Headers) -> tuple[bytes | None, bytes | None, bytes | None]:
    """The raw ``Idempotency-Key``, ``Content-Type`` and ``Content-Length``, in one pass.

    Raises:
        InvalidKey: the key header was sent more than once (which key was meant is unknowable).
    """
    key = content_type = content_length = None
    for name, value in headers:
        name = name.lower()
        if name == HEADER:
            if key is not None:
                raise InvalidKey(
                    "Send the Idempotency-Key header once; it was sent more than once."
                )
            key = value
        elif name == b"content-type":
            if content_type is None:
                content_type = value
        elif name == b"content-length":
            content_length = value
    return key, content_type, content_length


def _log_background_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error(
            "idempotency.store_error",
            extra={"event": "idempotency.store_error", "phase": "background",
                   "error": type(task.exception()).__name__},
        )  # fmt: skip


def _replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then defers to the real one.

    Later calls reach the server, so the app still sees ``http.disconnect``.
    """
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

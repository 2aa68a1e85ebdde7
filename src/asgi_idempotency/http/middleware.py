"""``IdempotencyMiddleware``: a pure ASGI guard that runs a handler once per key.

The middleware object holds configuration and decides, per request, whether it is
guarded (policy, route), then reads what the guard needs (key, body, fingerprint,
principal) into a frozen :class:`~.responder.GuardedRequest` and hands it to a fresh
:class:`~.responder.Responder`, which claims, runs and answers. What a record means
is :mod:`.lifecycle`; the store only does atomic primitives.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any, Literal

from asgi_idempotency.core.errors import (
    AppNotStarted,
    BodyTooLarge,
    IdempotencyError,
    InvalidHost,
    InvalidSignature,
    MissingKey,
    PrincipalMisconfigured,
    PrincipalMissing,
)
from asgi_idempotency.core.keys import check_namespace, parse_key, scoped_key
from asgi_idempotency.http.asgi import ASGIApp, Message, Receive, Scope, Send
from asgi_idempotency.http.fingerprint import fingerprint_after, request_prefix
from asgi_idempotency.http.policy import (
    Policy,
    ResolvedRoute,
    RouteGuard,
    RouteResolver,
    iter_endpoint_policies,
    lookup,
    normalise_policies,
)
from asgi_idempotency.http.principals import DependencyPrincipal, PrincipalFunc
from asgi_idempotency.http.problems import (
    MISSING_KEY_DETAIL,
    NO_CALLER_DETAIL,
    NOT_STARTED_DETAIL,
    PRINCIPAL_REQUIRED,
    STARTUP_FAILED_DETAIL,
    send_problem,
)
from asgi_idempotency.http.readiness import Readiness
from asgi_idempotency.http.request import guard_headers, host_scope, read_body, replay_body
from asgi_idempotency.http.responder import GUARD_SCOPE_KEY, GuardedRequest, Responder
from asgi_idempotency.http.runtime import Runtime
from asgi_idempotency.integrations.appcheck import StartupReport, inspect_app
from asgi_idempotency.integrations.openapi import guard_of_for, install_openapi
from asgi_idempotency.observability.metrics import MetricsSink, MetricsSnapshot, Outcome
from asgi_idempotency.observability.observer import Observer, route_to_server_log
from asgi_idempotency.observability.regenerated import RegeneratedKeys
from asgi_idempotency.stores.base import Store, utcnow

__all__ = ["IdempotencyMiddleware"]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
_UNLIMITED = 1 << 62  # report mode reads any body: the app, not the guard, decides its size


class IdempotencyMiddleware:
    """Enforce ``Idempotency-Key`` on a Starlette or FastAPI app.

    Args:
        app: the ASGI app to guard.
        store: a :class:`~asgi_idempotency.SQLStore` or :class:`~asgi_idempotency.MemoryStore`.
        policies: explicit policies by ``"METHOD /route/{template}"`` (or a bare template
            for every method); they win over ``@idempotent`` on the endpoint. The method
            is case-insensitive (``"post /refunds"`` is ``"POST /refunds"``); two entries
            naming the same route and method raise ``ValueError``. An entry naming no
            route or method the app serves is refused by the startup checks.
        default_policy: applied to requests in ``methods`` on routes with no policy,
            when they carry the header (default: key optional, 24 h ttl, 30 s lease).
        methods: methods guarded by default (default POST and PATCH). Safe methods
            (GET, HEAD, OPTIONS, TRACE) are never guarded.
        principal: who owns a key (:mod:`asgi_idempotency.http.principals`), required:
            ``from_dependency(dep)`` (FastAPI), ``from_user()``, ``from_session(field)``,
            ``from_headers(*names)``, ``ANONYMOUS`` (a public or single-caller
            service), or any ``scope -> str | None`` (sync or async; ``None`` answers
            401). There is no default: one would have to guess who the caller is.
        scope_by_host: the request's host is part of every record's scope (default),
            so tenant-per-subdomain apps whose user ids are tenant-local stay apart:
            the ``Host`` name without its port, and the names a proxy passes on in
            ``X-Forwarded-Host`` and ``Forwarded: host=`` (:func:`.request.host_scope`).
            ``Host`` or ``X-Forwarded-Host`` sent twice is a 400 either way. Turn it
            off (no host in the scope) for a service reached under several names whose
            clients may retry through another one.
        fail_open: when the store fails, run the handler unguarded instead of 503.
            Off by default: a guard that opens under load protects nothing.
        metrics: receives one ``observe(route, outcome)`` per guarded request.
        clock: returns the current aware UTC time. Leases and retention are decided
            on the store's own clock where it is shared (Postgres, MariaDB/MySQL,
            Redis); stores on one host (memory, SQLite) take this one, so tests can
            drive their leases with it.
        retry_after: seconds sent in ``Retry-After`` with a 503, and with a 409 unless
            the running claim's lease ends sooner (default 1).
        prune_interval: when set, delete expired records every this many seconds
            in the background while the app's lifespan runs (default: off; prune
            from cron with ``asgi-idempotency prune`` instead).
        detect_regenerated_keys: a window (e.g. ``timedelta(seconds=60)``) within which
            the same caller sending the same request under a different key is counted
            (``suspected_regenerated_keys``) and logged with both key digests: the
            signature of a client minting keys inside its retry loop. Off by default.
            Seen across every worker and host sharing the store: when on, each request
            the handler runs for writes one short-lived marker row (one more store
            round trip; :mod:`.regenerated` has the cost and what ``stats`` shows).
        mode: ``"report"`` puts every guarded route in report-only mode (see
            :class:`Policy`'s ``mode``): records are kept as usual, but every request
            runs and gets the app's own answer; what the guard would have answered
            is counted and logged. Default ``"enforce"``.
        namespace: the service's name when several services share one store (one
            table, one Redis): 1 to 64 ASCII letters, digits, ``.``, ``_`` or ``-``
            (``"billing"``). Records of different namespaces never answer each
            other, even for the same host, path, caller, key and body; services
            given the same namespace (or none) share records. Default ``None``: no
            namespace, the record keys of a guard without one. Changing it starts
            every key afresh (a retry across the change runs again).

    Raises:
        ValueError: ``namespace`` is not such a name (the empty string included).
    """

    # A guard marks itself so that the route walk can tell a mounted app with a guard of
    # its own (policy.carries_guard) without importing this module.
    asgi_idempotency_guard = True

    def __new__(cls, *args: Any, **kwargs: Any) -> IdempotencyMiddleware:
        # Before __init__ binds its arguments: Python's own "missing 1 required
        # keyword-only argument" would not say what to pass. (No arguments at all is
        # copy or pickle recreating an instance; a subclass may supply its own.)
        constructing = bool(args or kwargs) and cls.__init__ is IdempotencyMiddleware.__init__
        if constructing and kwargs.get("principal") is None:
            raise TypeError(PRINCIPAL_REQUIRED)
        return super().__new__(cls)

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        principal: PrincipalFunc | DependencyPrincipal,
        policies: Mapping[str, Policy] | None = None,
        default_policy: Policy | None = None,
        methods: Iterable[str] = ("POST", "PATCH"),
        scope_by_host: bool = True,
        fail_open: bool = False,
        metrics: MetricsSink | None = None,
        clock: Callable[[], datetime] = utcnow,
        retry_after: float = 1.0,
        prune_interval: float | None = None,
        mode: Literal["enforce", "report"] = "enforce",
        detect_regenerated_keys: timedelta | None = None,
        namespace: str | None = None,
    ) -> None:
        self.app = app
        # Checked first: a bad name must not leave a half-built guard behind.
        space = "" if namespace is None else check_namespace(namespace)
        self.store = store
        self.policies = dict(policies or {})
        self.default_policy = default_policy or Policy()
        self.methods = frozenset(m.upper() for m in methods)
        if not (callable(principal) or isinstance(principal, DependencyPrincipal)):
            raise TypeError(f"principal= {principal!r} is not a principal: " + PRINCIPAL_REQUIRED)
        self.principal = principal
        self.scope_by_host = scope_by_host
        self.fail_open = fail_open
        self.metrics = metrics
        self.clock = clock
        if isinstance(retry_after, bool) or not isinstance(retry_after, (int, float)):
            raise TypeError(f"retry_after is a number of seconds, not {retry_after!r}")
        if not retry_after > 0:  # also refuses NaN
            raise ValueError(f"retry_after must be a positive number of seconds, not {retry_after}")
        self.retry_after = retry_after
        self.prune_interval = prune_interval
        if mode not in ("enforce", "report"):
            raise ValueError(f"mode must be 'enforce' or 'report', not {mode!r}")
        self.mode = mode
        self._resolve = RouteResolver(self._decide, guard=self)
        label = type(store).__name__
        dialect = getattr(store, "dialect", None)
        self._observer = Observer(metrics, f"{label}/{dialect}" if dialect else label)
        self._runtime = Runtime(
            app, store, clock=clock, fail_open=fail_open, retry_after=retry_after,
            observer=self._observer, namespace=space,
        )  # fmt: skip
        self.check_policies()
        self._readiness = Readiness(store, self._observer, retry_after)
        if detect_regenerated_keys is not None:
            self._runtime.regenerated = RegeneratedKeys(detect_regenerated_keys, namespace=space)
        # The checks against the app (appcheck.py) and, for from_dependency, the claim
        # added to FastAPI routes: at lifespan startup, else before the first request.
        self._started = False
        # What every guarded request is answered while set, the handler never run: the
        # checks' refusal, or a lifespan startup that has not completed (or failed).
        self._refusal: IdempotencyError | None = None
        self._claim_endpoints: set[int] | None = None  # from_dependency: endpoints that claim

    @classmethod
    def of(cls, app: Any) -> IdempotencyMiddleware:
        """The guard an app was given with ``add_middleware`` (or ``middleware=[...]``).

        Starlette builds its middleware when it starts, so call this once the app has
        started (in its lifespan, a test client's ``with`` block, or a request).

        Raises:
            LookupError: the app has not started yet, or has no IdempotencyMiddleware.
        """
        node = getattr(app, "middleware_stack", None)
        for _ in range(100):
            if node is None:
                break
            if isinstance(node, cls):
                return node
            node = getattr(node, "app", None)
        raise LookupError(
            "no IdempotencyMiddleware in this app's middleware yet: call "
            "IdempotencyMiddleware.of(app) once the app has started"
        )

    @property
    def namespace(self) -> str | None:
        """The service's namespace in every record's scope, or ``None`` (read-only: the
        keys of records already written depend on it)."""
        return self._runtime.namespace or None

    def snapshot(self) -> MetricsSnapshot:
        """This middleware's outcome counts so far, by route template and outcome.

        Counted in process whatever ``metrics`` is; ``snapshot().replay_rate()`` and
        ``snapshot().conflict_rate()`` are the two numbers to watch.
        """
        return self._observer.counts.snapshot()

    # What decides whether a path is guarded, and how. Assigning any of them drops
    # the answers cached per path; ``policies`` is read-only in place for that reason.
    @property
    def policies(self) -> Mapping[str, Policy]:
        return self._policies

    @policies.setter
    def policies(self, value: Mapping[str, Policy]) -> None:
        self._policies = MappingProxyType(normalise_policies(value))
        self._forget_decisions()

    @property
    def default_policy(self) -> Policy:
        return self._default_policy

    @default_policy.setter
    def default_policy(self, value: Policy) -> None:
        self._default_policy = value
        self._forget_decisions()

    @property
    def methods(self) -> frozenset[str]:
        return self._methods

    @methods.setter
    def methods(self, value: frozenset[str]) -> None:
        self._methods = frozenset(value)
        self._forget_decisions()

    def _forget_decisions(self) -> None:
        resolve = self.__dict__.get("_resolve")  # absent while __init__ assigns the settings
        if resolve is not None:
            resolve.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http" or GUARD_SCOPE_KEY in scope:
            # A request an outer guard holds is its alone.
            await self.app(scope, receive, send)
            return
        if not self._started:
            self._start(scope.get("app"), on_request=True)
        if scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        guard = self._resolve(scope)
        if guard is None:
            await self.app(scope, receive, send)
            return
        request = await self._read(guard, scope, receive, send)
        if request is None:
            return
        readiness = self._readiness
        if not readiness.ready:
            report = request.policy.mode == "report"
            if not await readiness.ensure(guard.route, send, report=report):
                if report:  # the store cannot claim: the app answers, unguarded
                    await self._unguarded(guard, scope, replay_body(request.body, receive), send)
                return
        await Responder(self._runtime, request, scope, receive, send).run()

    def _start(self, app: Any, *, on_request: bool) -> None:
        """The checks against ``app``. A problem found at lifespan startup raises; before
        the first request of an app served without lifespan, the same checks run and a
        problem is logged and answered 500, naming it, on every guarded request.

        Raises:
            ValueError: the app cannot be guarded safely as wired (startup only).
        """
        self._started = True
        route_to_server_log()
        others: list[str] = []
        try:
            self.check_policies(app)
        except ValueError as exc:
            others.append(str(exc))
        report = StartupReport()
        if app is not None:
            report = inspect_app(app, self, self.principal, self._policies, self._policy_for)
        refusal = report.refusal(others)
        # Kept at startup too: a server that serves on after a failed startup (or a test
        # client used without its ``with`` afterwards) must not run a handler unguarded.
        self._refusal = refusal
        if isinstance(self.principal, DependencyPrincipal):
            # Refused: every route its policy guards is answered the refusal, including
            # those that do not use the dependency (left open only once the checks pass).
            self._claim_endpoints = report.claim_endpoints if refusal is None else None
        self._forget_decisions()
        install_openapi(app, guard_of_for(self, app))
        if refusal is None:
            return
        if not on_request:
            raise ValueError(str(refusal))  # the server prints lifespan.startup.failed's message
        self._observer.refused("<startup>", refusal)

    def guard_for(self, method: str, resolved: ResolvedRoute | None, path: str) -> Policy | None:
        """How a request of ``method`` to ``resolved`` (at ``path``) is guarded, or ``None``.

        The one answer behind every request's decision and the OpenAPI document.
        """
        if method in SAFE_METHODS:
            return None
        if resolved is not None and resolved.delegated:
            # A mounted app with its own guard serves the route: that guard decides, by
            # the principal its app's auth yields, and claims exactly once.
            return None
        policy = lookup(self._policies, method, resolved, path)
        if policy is None and method in self._methods:
            policy = self._default_policy
        if policy is None or not policy.enabled:
            return None
        return policy

    def _policy_for(self, method: str, resolved: ResolvedRoute) -> tuple[Policy | None, bool]:
        """The policy for ``method`` on ``resolved``, and whether it is explicit."""
        policy = lookup(self._policies, method, resolved, resolved.template)
        if policy is not None:
            return policy, True
        return (self._default_policy if method in self._methods else None), False

    def _decide(
        self, scope: Scope, resolved: ResolvedRoute | None, routed: bool
    ) -> RouteGuard | None:
        """How a request to this route is guarded, or ``None`` to let it through.

        Depends only on the method, the path, the route and this middleware's
        settings, so :class:`RouteResolver` caches it per path.
        """
        if resolved is None and routed:
            # The router will answer 404 or 405: no handler runs, nothing to guard.
            return None
        method, path = scope["method"], scope["path"]
        policy = self.guard_for(method, resolved, path)
        if policy is None:
            return None
        if self.mode == "report" and policy.mode != "report":
            policy = dataclasses.replace(policy, mode="report")  # once per path: cached
        # A bare ASGI app has no templates; one label keeps metrics' cardinality bounded.
        route = resolved.template if resolved is not None else "<unrouted>"
        claims = self._claim_endpoints
        # from_dependency: a route that does not use the dependency cannot name its
        # caller. Startup refuses those it sees; one it could not (added since, or not a
        # FastAPI route) refuses keyed requests rather than run them unguarded.
        unnamed = (
            claims is not None
            and policy.key_from is None
            and (resolved is None or id(resolved.endpoint) not in claims)
        )
        return RouteGuard(policy, route, request_prefix(method, path), policy.header_names, unnamed)

    async def _read(
        self, guard: RouteGuard, scope: Scope, receive: Receive, send: Send
    ) -> GuardedRequest | None:
        """The guarded request, or ``None`` once the request has been answered or let through."""
        policy, route = guard.policy, guard.route
        observe = self._observer.outcome
        refusal = self._refusal
        if refusal is not None:
            not_started = isinstance(refusal, AppNotStarted)
            observe(route, Outcome.STORE_UNAVAILABLE if not_started else Outcome.UNIDENTIFIED)
            await self._answer(refusal, guard, scope, receive, send)
            return None
        try:
            raw_key, content_type, declared_length, hosts = guard_headers(scope["headers"])
            if raw_key is None and policy.key_from is None:
                if policy.required:
                    raise MissingKey(MISSING_KEY_DETAIL)
                observe(route, Outcome.UNGUARDED)
                await self.app(scope, receive, send)
                return None
            where = host_scope(*hosts) if self.scope_by_host else ""
            delivery = policy.key_from
            principal: Any
            if delivery is not None:
                # A webhook: the sender, at this endpoint, is the caller; its delivery
                # id (read with the body, once the signature holds) the key.
                client_key, principal = "", delivery.principal(scope)
            else:
                assert raw_key is not None
                client_key = parse_key(raw_key)
                who = self.principal
                if guard.unnamed:
                    name = getattr(who, "name", repr(who))
                    raise PrincipalMisconfigured(
                        f"{scope['method']} {route} does not use {name}, the dependency "
                        f"principal={who!r} names callers by, so a keyed request there "
                        f"cannot be scoped to its caller: add Depends({name}) to the "
                        "route, or exempt it with Policy(enabled=False)."
                    )
                principal = None if isinstance(who, DependencyPrincipal) else who(scope)
                if type(principal) is not str and inspect.isawaitable(principal):
                    principal = await principal
                if principal is None and self._claim_endpoints is None:
                    raise PrincipalMissing(NO_CALLER_DETAIL)
        except (PrincipalMissing, PrincipalMisconfigured) as exc:
            observe(route, Outcome.UNIDENTIFIED)
            self._observer.refused(route, exc)
            await self._answer(exc, guard, scope, receive, send)
            return None
        except MissingKey as exc:
            observe(route, Outcome.MISSING_KEY)
            await self._answer(exc, guard, scope, receive, send)
            return None
        except InvalidHost as exc:
            observe(route, Outcome.INVALID_HOST)
            await self._answer(exc, guard, scope, receive, send)
            return None
        except IdempotencyError as exc:
            observe(route, Outcome.INVALID_KEY)
            await self._answer(exc, guard, scope, receive, send)
            return None
        report = policy.mode == "report"
        limit = policy.max_body_bytes
        try:
            body = await read_body(receive, _UNLIMITED if report else limit, declared_length)
        except BodyTooLarge as exc:
            observe(route, Outcome.TOO_LARGE)
            await send_problem(send, exc)
            return None
        if body is None:
            return None  # the client left while sending its body: nothing ran, nothing to answer
        if delivery is not None:
            try:
                client_key = delivery(scope["headers"], body)
            except InvalidSignature as exc:
                # Refused in every mode: a forged delivery is no rollout choice, and its
                # body was never the sender's.
                observe(route, Outcome.INVALID_SIGNATURE)
                await send_problem(send, exc)
                return None
            except IdempotencyError as exc:
                observe(route, Outcome.INVALID_KEY)
                await self._answer(exc, guard, scope, replay_body(body, receive), send)
                return None
        if report and len(body) > limit:
            observe(route, Outcome.TOO_LARGE)
            too_large = BodyTooLarge(f"The request body exceeds {limit} bytes for this endpoint.")
            await self._answer(too_large, guard, scope, replay_body(body, receive), send)
            return None
        names = guard.header_names
        chosen = (
            [(n.lower(), v) for n, v in scope["headers"] if n.lower() in names] if names else ()
        )
        request_hash = fingerprint_after(
            guard.prefix,
            scope.get("query_string", b""),
            body,
            content_type,
            chosen,
            exclude=policy.fingerprint_exclude,
        )
        if principal is None:  # named when FastAPI resolves the dependency
            return GuardedRequest("", None, request_hash, policy, route, body, client_key, where)
        principal = str(principal)
        key = scoped_key(principal, client_key, where, self._runtime.namespace)
        return GuardedRequest(key, principal, request_hash, policy, route, body, client_key, where)

    async def _answer(
        self, exc: IdempotencyError, guard: RouteGuard, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Answer ``exc``; in report mode run the app instead and say what it would have been."""
        if guard.policy.mode != "report":
            await send_problem(send, exc)
            return
        self._observer.report(guard.route, "", exc.status)
        await self._unguarded(guard, scope, receive, send)

    async def _unguarded(
        self, guard: RouteGuard, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Report mode: the app answers as if unguarded. A transactional route's handler
        still gets the transaction it writes through (its writes alone commit)."""
        policy = guard.policy
        if not policy.transactional:
            await self.app(scope, receive, send)
            return
        request = GuardedRequest("", None, "", policy, guard.route, b"", "", "")
        await Responder(self._runtime, request, scope, receive, send).run_unclaimed()

    def check_policies(self, app: Any = None) -> None:
        """Refuse transactional policies on a store that cannot honour them.

        Checks ``policies``, the default policy and, given the app, every
        ``@idempotent`` endpoint its router reaches. Runs at construction and again
        at lifespan startup, so a misconfiguration stops the app from starting.

        Raises:
            ValueError: a transactional policy on a store without transactions.
        """
        found = [p for p in (*self.policies.values(), self.default_policy) if p.transactional]
        if app is not None:
            found += [p for p in iter_endpoint_policies(app, self) if p.transactional]
        why = self._runtime.runner.transactions_unavailable() if found else None
        if why is not None:
            raise ValueError(
                "Policy(transactional=True) needs SQLStore on Postgres or MariaDB "
                f"(postgresql+asyncpg://... or mariadb+asyncmy://...): {why}"
            )

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the app at startup, then run its lifespan with the store's check.

        A refusal is reported as Starlette reports a failing startup: the server gets
        ``lifespan.startup.failed`` with the reason (uvicorn prints it and exits non-zero)
        and the exception is raised (a ``TestClient``'s ``with`` raises it). From
        ``lifespan.startup`` until ``lifespan.startup.complete`` has gone out, guarded
        requests are answered 503 and the handler never runs; after a failed startup,
        503 (or the refusal's 500) for as long as the process serves.
        """
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                self._start(scope.get("app"), on_request=False)
            except ValueError as exc:
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                raise
            self._refusal = AppNotStarted(NOT_STARTED_DETAIL, retry_after=self.retry_after)
        first = True
        answered = False

        async def replay() -> Message:
            nonlocal first
            if first:
                first = False
                return message
            return await receive()

        async def watch(sent: Message) -> None:
            nonlocal answered
            kind = sent["type"]
            if kind == "lifespan.startup.complete":
                answered = True
                self._refusal = None
            elif kind == "lifespan.startup.failed":
                answered = True
                self._refusal = AppNotStarted(STARTUP_FAILED_DETAIL, retry_after=self.retry_after)
            await send(sent)

        prepared = functools.partial(self._readiness.lifespan, self.app)
        try:
            if self.prune_interval is None:
                await prepared(scope, replay, watch)
                return
            from asgi_idempotency.ops.retention import PruningMiddleware

            # The pruner wraps the check, so it starts only once the table is there.
            pruning = PruningMiddleware(prepared, store=self.store, interval=self.prune_interval)
            await pruning(scope, replay, watch)
        finally:
            if not answered and isinstance(self._refusal, AppNotStarted):
                # The app returned or raised without answering startup: it does not speak
                # lifespan (uvicorn's default then serves without it), so requests are
                # served as without lifespan (the store checked on the first guarded
                # ones); the guard's own checks passed.
                self._refusal = None

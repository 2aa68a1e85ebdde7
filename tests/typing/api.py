"""The public API as a user types it: checked by mypy (strict), never run.

Each function below uses the public names the way the README and the docstrings
do, so a change to a public signature or return type fails ``mypy`` here before
it reaches a user. Lines marked ``# type: ignore[code]`` are calls that must stay
type errors: strict mode's ``warn_unused_ignores`` fails the check the day one
of them starts to type-check (a duration that takes a bare number again, a store
passed positionally, a sync transport wrapped in the async one).

Every name of ``asgi_idempotency.__all__`` and ``asgi_idempotency.client.__all__``
is imported here, from the package as a user imports it (tests/project/test_public_api.py
keeps that so). Not a test module: pytest collects ``test_*.py`` only, and importing
this one only defines functions.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Literal, assert_type

import httpx
from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from asgi_idempotency import (
    BUSY,
    AppNotStarted,
    AttemptsUnknown,
    AuditableStore,
    BodyTooLarge,
    Bucket,
    CanonicalJSONError,
    Capabilities,
    Claim,
    ClaimOutcome,
    FanOutMetrics,
    GuardMisconfigured,
    IdempotencyError,
    IdempotencyMiddleware,
    InMemoryMetrics,
    InProgress,
    InvalidHost,
    InvalidKey,
    InvalidSignature,
    KeyMismatch,
    KeyReused,
    MemoryStore,
    MetricsSnapshot,
    MiddlewareMisplaced,
    MissingKey,
    MissingMessageId,
    NewClaim,
    Once,
    OnceError,
    Outcome,
    Policy,
    PreparedStore,
    PrincipalMisconfigured,
    PrincipalMissing,
    Pruner,
    PruningMiddleware,
    Record,
    RecordState,
    RecordStatus,
    RequestInProgress,
    ResponseNotKept,
    SchemaMissing,
    SQLStore,
    Store,
    StoredResponse,
    StoreError,
    StoreTransaction,
    StoreUnavailable,
    SuspectedDuplicate,
    TransactionalStore,
    __version__,
    canonical_json,
    idempotent,
    prune_all,
)
from asgi_idempotency.client import (
    IDEMPOTENCY_KEY_HEADER,
    KEY_VERSION,
    AsyncIdempotentTransport,
    AttemptRecord,
    Decision,
    IdempotentTransport,
    KeyFunction,
    LedgerConflict,
    LedgerEntry,
    LedgerError,
    LedgerStatus,
    OutboundCall,
    OutboundLedger,
    OutcomeUnknown,
    ReadBack,
    RetriesExhausted,
    RetryPolicy,
    derive_key,
    ledger_metadata,
    ledger_table,
    random_key,
    retryable,
)
from asgi_idempotency.client import CanonicalJSONError as ClientCanonicalJSONError
from asgi_idempotency.client import canonical_json as client_canonical_json
from asgi_idempotency.http.principals import (
    ANONYMOUS,
    from_dependency,
    from_headers,
    from_session,
    from_user,
)
from asgi_idempotency.stores.base import Busy
from asgi_idempotency.stores.registry import StoreKind, kind_of, open_store, register
from asgi_idempotency.testing import StoreContract

NOW = datetime(2026, 12, 1, tzinfo=UTC)

# --- the server: policies, the middleware, the decorator ---------------------------


def policies() -> list[Policy]:
    strict = Policy(
        enabled=True,
        required=True,
        ttl=timedelta(hours=1),
        lease=timedelta(seconds=10),
        max_body_bytes=64 * 1024,
        fingerprint_headers=("x-tenant",),
        transactional=False,
        fingerprint_exclude=("/timestamp", "/meta/request_id"),
    )
    assert_type(strict.lease, timedelta)
    assert_type(strict.fingerprint_exclude, tuple[str, ...])
    assert_type(strict.renew_every, float)
    Policy(ttl=30)  # type: ignore[arg-type]  # a bare number: seconds or milliseconds?
    Policy(lease=None)  # type: ignore[arg-type]  # leave it out for the default
    return [strict, Policy()]


@idempotent(required=True, ttl=timedelta(minutes=5), fingerprint_exclude=["/timestamp"])
async def refund(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True}, status_code=201)


@idempotent()
def sync_refund(request: Request) -> Response:
    return Response(status_code=201)


def decorated_endpoints_keep_their_type() -> None:
    # Were @idempotent to return Any or a bare Callable, these would type-check.
    _ = refund(object())  # type: ignore[arg-type]  # still takes a Request
    response: Response = sync_refund(refund)  # type: ignore[arg-type]  # still takes a Request
    del response
    idempotent(refund)  # type: ignore[call-arg, arg-type]  # @idempotent(), with parentheses
    idempotent(ttl=60)  # type: ignore[arg-type]  # a timedelta, as Policy's


def principal(scope: Scope) -> str | None:
    return None


async def async_principal(scope: Scope) -> str | None:
    return "tenant-a"


def app(store: Store, metrics: InMemoryMetrics) -> Starlette:
    app = Starlette(
        routes=[Route("/refunds", refund, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                principal=ANONYMOUS,
                policies={"POST /refunds": Policy(required=True)},
                metrics=metrics,
            ),
            Middleware(PruningMiddleware, store=store, interval=300.0),
        ],
    )
    app.add_middleware(IdempotencyMiddleware, store=store, principal=ANONYMOUS)
    app.add_middleware(IdempotencyMiddleware, store=store)  # type: ignore[call-arg]  # principal=
    Middleware(IdempotencyMiddleware, stor=store)  # type: ignore[call-arg]  # misspelt
    return app


def middleware(store: Store) -> IdempotencyMiddleware:
    inner = Starlette()
    guard = IdempotencyMiddleware(
        inner,
        store=store,
        policies={"POST /refunds": Policy()},
        default_policy=Policy(ttl=timedelta(days=1)),
        methods=("POST", "PUT"),
        principal=principal,
        fail_open=False,
        metrics=FanOutMetrics(InMemoryMetrics()),
        clock=lambda: NOW,
        retry_after=2.0,
        prune_interval=None,
    )
    IdempotencyMiddleware(inner, store=store, principal=async_principal)
    IdempotencyMiddleware(inner, store=store, principal=ANONYMOUS, scope_by_host=False)
    IdempotencyMiddleware(inner, store=store, principal=from_headers("X-Tenant-Id", "X-User-Id"))
    IdempotencyMiddleware(inner, store=store, principal=from_session("user_id"))
    IdempotencyMiddleware(inner, store=store, principal=from_user(identity=str))
    IdempotencyMiddleware(inner, store=store, principal=from_dependency(lambda: "alice"))
    IdempotencyMiddleware(
        inner, store=store, principal=from_dependency(lambda: "alice", identity="username")
    )
    IdempotencyMiddleware(inner, store=store, principal=from_user(identity="username"))
    named = IdempotencyMiddleware(inner, store=store, principal=ANONYMOUS, namespace="billing")
    assert_type(named.namespace, str | None)
    IdempotencyMiddleware(inner, store=store, principal=ANONYMOUS, namespace=b"x")  # type: ignore[arg-type]  # a str
    from_user(identity=3)  # type: ignore[arg-type]  # a function or an attribute name
    from_headers(b"X-Tenant-Id")  # type: ignore[arg-type]  # header names are str
    IdempotencyMiddleware(inner)  # type: ignore[call-arg]  # a store is required
    IdempotencyMiddleware(inner, store)  # type: ignore[call-arg]  # the store by keyword
    IdempotencyMiddleware(inner, store=store)  # type: ignore[call-arg]  # principal= is required
    IdempotencyMiddleware(inner, store=store, principal=ANONYMOUS, retry_after=timedelta(seconds=1))  # type: ignore[arg-type]  # seconds
    assert_type(guard.snapshot(), MetricsSnapshot)
    return guard


def metrics() -> float:
    sink = InMemoryMetrics()
    sink.observe("POST /refunds", Outcome.REPLAYED)
    FanOutMetrics(sink, InMemoryMetrics()).observe("POST /refunds", Outcome.EXECUTED)
    snapshot: MetricsSnapshot = sink.snapshot()
    assert_type(snapshot.total(Outcome.MISMATCH, route="POST /refunds"), int)
    sink.observe("POST /refunds", "replayed")  # type: ignore[arg-type]  # an Outcome
    return snapshot.replay_rate() + snapshot.conflict_rate("POST /refunds")


# --- stores and the record lifecycle -----------------------------------------------


async def stores(engine: AsyncEngine) -> list[Store]:
    memory = MemoryStore()
    sql = SQLStore("postgresql+asyncpg://app@db/app", command_timeout=5.0, pool_size=10)
    borrowed = SQLStore(engine)
    await sql.create_all()
    transactional: TransactionalStore = sql
    prepared: PreparedStore = sql
    await prepared.prepare()
    await PreparedStore.prepare(memory)  # type: ignore[arg-type]  # nothing to prepare
    assert_type(transactional.transactions_unavailable, str | None)
    SQLStore(42)  # type: ignore[arg-type]  # a URL or an AsyncEngine
    SQLStore("sqlite://", 5.0)  # type: ignore[call-arg]  # options by keyword
    not_a_store: Store = object()  # type: ignore[assignment]  # not the protocol
    return [memory, sql, borrowed, not_a_store]


async def records(store: Store) -> None:
    new = NewClaim("k" * 64, "hash", "token", NOW, timedelta(seconds=30), timedelta(1))
    existing: Record | Literal[Busy.BUSY] | None = await store.insert(new)
    if existing is not None and existing is not BUSY:
        assert_type(existing.status, RecordStatus)
        assert_type(await store.replace(existing, new), bool)
    response = StoredResponse(201, ((b"content-type", b"application/json"),), b"{}")
    assert_type(await store.complete(new.key, new.token, response, now=NOW, ttl=new.ttl), bool)
    assert_type(await store.release(new.key, new.token), bool)
    assert_type(await store.renew(new.key, new.token, now=NOW, lease=new.lease), bool)
    assert_type(await store.get(new.key), Record | None)
    assert_type(await store.find("ab", limit=2), list[Record])
    caps: Capabilities = MemoryStore.capabilities
    assert_type(caps.transactions, bool)
    buckets: list[Bucket] = await store.buckets(now=NOW)
    for bucket in buckets:
        assert_type(bucket.oldest_created_at, datetime | None)
    assert_type(await store.count_expired(now=NOW), int)
    assert_type(await store.prune(now=NOW, batch_size=500), int)
    assert_type(await store.prune(), int)  # at the store's own time
    await store.prune(NOW)  # type: ignore[call-arg]  # now by keyword
    audited: AuditableStore = MemoryStore()
    assert_type(MemoryStore.capabilities.audit, bool)
    assert_type(MemoryStore.capabilities.own_clock, bool)
    found = await audited.suspected_duplicates(since=NOW, window=timedelta(minutes=10))
    assert_type(found, list[SuspectedDuplicate])
    assert_type(found[0].keys, int)
    await audited.suspected_duplicates(NOW, timedelta(1))  # type: ignore[call-arg]  # by keyword
    scoped = NewClaim(
        "k" * 64,
        "h",
        "t",
        NOW,
        timedelta(seconds=30),
        timedelta(days=1),
        scope_digest="s" * 64,
        route="/x",
    )
    assert_type(scoped.scope_digest, str | None)
    StoredResponse(201, [], b"")  # type: ignore[arg-type]  # headers are a tuple of pairs
    await store.close()


def memory_store(url: str, **options: object) -> Store:
    return MemoryStore()


def registry() -> Store:
    kind = register(StoreKind("mine", ("mine",), memory_store, Capabilities(prune=False)))
    assert_type(kind.capabilities.migrations, bool)
    assert_type(kind_of("mine://").why_not("prune"), str)
    StoreKind("mine", "mine", memory_store)  # type: ignore[arg-type]  # schemes are a tuple
    return open_store("mine://", command_timeout=2.0)


class ContractOnMemory(StoreContract):
    transactional = False


async def transaction(store: TransactionalStore, new: NewClaim, done: StoredResponse) -> None:
    if store.transactions_unavailable is None:
        async with store.transaction() as tx:
            tx_: StoreTransaction = tx
            await tx_.insert(new)
            await tx_.commit(new.key, new.token, done, now=NOW, ttl=timedelta(days=1))
        async with store.transaction() as tx:
            await tx.commit_writes()  # the handler's writes alone (report-only mode)


def lifecycle(claim: Claim) -> RecordState | None:
    assert_type(claim.owned, bool)
    if claim.outcome is ClaimOutcome.MISMATCH and claim.record is not None:
        return RecordState.COMPLETED if claim.record.response else RecordState.RUNNING
    return None


async def retention(store: Store) -> int:
    deleted = await prune_all(store, batch_size=1000, now=NOW, dry_run=True, pause=0.0)
    async with Pruner(store, interval=60.0, jitter=0.1) as pruner:
        deleted += await pruner.run_once()
    pruner.wake()
    Pruner(store, interval=timedelta(minutes=1))  # type: ignore[arg-type]  # seconds
    return deleted


# --- the function guard ---------------------------------------------------------


async def function_guard(store: Store) -> int:
    once = Once(
        store, ttl=timedelta(hours=24), lease=timedelta(seconds=30), namespace="refunds",
        wait=timedelta(seconds=5), retry_after=0.5, clock=lambda: NOW,
    )  # fmt: skip

    @once(key=lambda msg: msg["id"], exclude=("session",))
    async def handle(msg: dict[str, str], session: object = None) -> int:
        return len(msg)

    @once(key=lambda slot: f"nightly:{slot}", namespace="cron", wait=timedelta(minutes=1))
    def nightly(slot: str) -> str:
        return slot

    async def issue_refund(order: str, amount_p: int) -> dict[str, int]:
        return {order: amount_p}

    assert_type(await handle({"id": "m1"}), int)
    assert_type(nightly("2026-12-04T02:00Z"), str)
    refund = await once.call("refund:A-88214", issue_refund, order="A-88214", amount_p=4500)
    assert_type(refund, dict[str, int])
    assert_type(once.call_sync("k", nightly, "slot"), str)
    await once.call("k", issue_refund, order="A-1", amount_p="45")  # type: ignore[arg-type]  # the function's own types
    await handle("m1")  # type: ignore[arg-type]  # the decorated signature is kept
    Once(store, wait=5)  # type: ignore[arg-type]  # a timedelta, as Policy's durations
    once.close()
    try:
        return await handle({"id": "m2"})
    except InProgress as exc:
        assert_type(exc.retry_after, float)
        raise
    except KeyReused as exc:
        reused: OnceError = exc
        raise reused from None
    except (MissingMessageId, AttemptsUnknown) as exc:  # the broker presets' refusals
        refused: OnceError = exc
        raise refused from None


# --- errors --------------------------------------------------------------------


def errors(exc: Exception) -> int | None:
    tree: list[type[IdempotencyError]] = [
        MissingKey,
        InvalidKey,
        InvalidHost,
        BodyTooLarge,
        KeyMismatch,
        RequestInProgress,
        StoreUnavailable,
        PrincipalMissing,
        PrincipalMisconfigured,
        GuardMisconfigured,
        MiddlewareMisplaced,
        AppNotStarted,
        ResponseNotKept,
        InvalidSignature,
    ]
    misplaced: GuardMisconfigured = MiddlewareMisplaced("GZipMiddleware is inside the guard")
    infrastructure: list[type[StoreError]] = [StoreError, SchemaMissing]
    missing: StoreError = SchemaMissing("no idempotency_records: run asgi-idempotency migrate")
    unavailable: Exception = StoreError.wrap(exc)
    not_an_answer: IdempotencyError = StoreError.wrap(exc)  # type: ignore[assignment]
    answer: IdempotencyError = StoreUnavailable(StoreError.wrap(exc).detail, retry_after=1)
    assert_type(StoreError.wrap(exc), StoreError)
    StoreError("down", retry_after=1.0)  # type: ignore[call-arg]  # a store error's own rule
    in_progress = RequestInProgress("running", retry_after=1.5)
    bad_json: ValueError = CanonicalJSONError("NaN")
    assert ClientCanonicalJSONError is CanonicalJSONError
    if isinstance(exc, IdempotencyError):
        assert_type(exc.body(), bytes)
        assert_type(exc.headers(), list[tuple[bytes, bytes]])
        return exc.status
    del tree, infrastructure, unavailable, not_an_answer, answer, in_progress, bad_json, missing
    del misplaced
    return None


def canonical() -> bytes:
    assert_type(canonical_json({"amount": 4500}), bytes)
    assert_type(__version__, str)
    return client_canonical_json([1, 2.0])


# --- the client: keys, retries, transports, the ledger -------------------------------


def keys() -> str:
    key = derive_key("run-1", 0, "refund", {"amount": 4500})
    derive_key("run-1", 3, "refund", [], bucket=timedelta(hours=1), now=NOW)
    derive_key("run-1", "0", "refund", {})  # type: ignore[arg-type]  # step is an int
    derive_key("run-1", 0, "refund", {}, timedelta(1))  # type: ignore[call-arg]  # by keyword
    version: str = KEY_VERSION
    del version
    return key


def retries(response: httpx.Response, exc: httpx.ConnectError) -> list[Decision]:
    decisions = [
        retryable(response),
        retryable(exc, has_key=True, now=NOW),
        retryable(httpx.HTTPStatusError("503", request=response.request, response=response)),
    ]
    retryable("timeout")  # type: ignore[arg-type]  # an exception or a response
    first = decisions[0]
    assert_type(first.retry, bool)
    assert_type(first.delay, float | None)
    first.retry = False  # type: ignore[misc]  # frozen
    return decisions


def retry_policy() -> RetryPolicy:
    policy = RetryPolicy(attempts=5, timeout=30.0, wait_initial=0.2, wait_max=2.0)
    RetryPolicy(wait_jitter=0.5, wait_exp_base=3.0).stamina_kwargs()
    RetryPolicy(attempts=2.5)  # type: ignore[arg-type]  # whole attempts
    return policy


def exhausted(request: httpx.Request) -> httpx.TransportError:
    attempt = AttemptRecord(number=1, reason="503", status_code=503, error=None, elapsed=0.1)
    error = RetriesExhausted((attempt,), "key", request=request)
    assert_type(error.attempts, tuple[AttemptRecord, ...])
    assert_type(error.key, str | None)
    RetriesExhausted([attempt], "key")  # type: ignore[arg-type]  # a tuple of attempts
    return error


def by_header(request: httpx.Request, /) -> str | None:
    key: str | None = request.headers.get(IDEMPOTENCY_KEY_HEADER)  # httpx: Any
    return key


def transports() -> tuple[httpx.Client, httpx.AsyncClient]:
    key_for: KeyFunction = random_key
    sync = IdempotentTransport(httpx.HTTPTransport(), policy=RetryPolicy(), key_for=by_header)
    async_ = AsyncIdempotentTransport(
        httpx.AsyncHTTPTransport(), policy=RetryPolicy(attempts=3), key_for=key_for
    )
    AsyncIdempotentTransport(httpx.HTTPTransport())  # type: ignore[arg-type]  # the async twin wraps async
    IdempotentTransport(key_for=lambda: "k")  # type: ignore[arg-type]  # takes the request
    return httpx.Client(transport=sync), httpx.AsyncClient(transport=async_)


async def ledger(engine: AsyncEngine) -> bytes:
    book = OutboundLedger(engine, policy=RetryPolicy(), settle=0.5)
    await book.create_all()

    async def call() -> bytes:
        return b'{"refund_id": "r1"}'

    async def read_back() -> bytes | None:
        return None

    protected: OutboundCall = call
    checker: ReadBack = read_back
    result = await book.run(derive_key("run", 0, "refund", {}), protected, read_back=checker)
    entry = await book.get("key")
    if entry is not None:
        row: LedgerEntry = entry
        assert_type(row.status, LedgerStatus)
    assert_type(await book.forget("key"), bool)
    table: Table = ledger_table
    assert table.metadata is ledger_metadata
    await book.run("key", b"not a call")  # type: ignore[arg-type]  # a callable
    return result


def ledger_errors(entry: LedgerEntry, attempts: tuple[AttemptRecord, ...]) -> list[LedgerError]:
    if entry.status is LedgerStatus.UNKNOWN:
        return [LedgerConflict(entry), OutcomeUnknown(entry.key, attempts)]
    LedgerConflict(entry.key)  # type: ignore[arg-type]  # the entry as read
    return []


async def conformance(app: Starlette) -> list[str]:
    from asgi_idempotency.testing import CheckReport, Outcome, assert_conforms, check_app

    report: CheckReport = await check_app(
        app, "/refunds", json={"amount": 1}, headers={"X-API-Key": "a"}, storm=4
    )
    assert_type(report.result("replay").outcome, Outcome)
    await assert_conforms(app, "/refunds", other_caller_headers=[("X-API-Key", "b")])
    await check_app(app, "/refunds", storm="4")  # type: ignore[arg-type]  # a number
    return report.failed

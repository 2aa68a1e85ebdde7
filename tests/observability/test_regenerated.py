"""The opt-in detector for keys minted inside a client's retry loop."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, SQLStore, StoredResponse
from asgi_idempotency.client import derive_key
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.http.principals import from_headers
from asgi_idempotency.observability.prometheus import PrometheusMetrics
from asgi_idempotency.observability.regenerated import MARKER_TOKEN
from asgi_idempotency.stores.base import NewClaim, Record, RecordStatus, Store
from tests.apps import guarded
from tests.conftest import StoreClock, emptied, redis_store

pytestmark = pytest.mark.anyio


async def _refund(request: Request) -> Response:
    return JSONResponse({"ok": True}, status_code=201)


def _app(store: Store | None = None, **guard: Any) -> Starlette:
    store = MemoryStore() if store is None else store
    return guarded(store, _refund, path="/refunds", principal=from_headers("X-User-Id"), **guard)


async def _attempts(app: Starlette, keys: list[str], user: str = "u1") -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for key in keys:
            await c.post(
                "/refunds",
                json={"order": "A-88214", "amount_p": 4500},
                headers={"Idempotency-Key": key, "X-User-Id": user},
            )


def _guard(app: Starlette) -> IdempotencyMiddleware:
    return IdempotencyMiddleware.of(app)


async def test_a_key_minted_per_attempt_is_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asgi_idempotency")
    registry = CollectorRegistry()
    app = _app(detect_regenerated_keys=timedelta(seconds=60), metrics=PrometheusMetrics(registry))
    await _attempts(app, [str(uuid.uuid4()) for _ in range(3)])  # the bug: a key per try
    snapshot = _guard(app).snapshot()
    assert snapshot.suspected_regenerated_keys == {"/refunds": 2}
    value = registry.get_sample_value(
        "idempotency_suspected_regenerated_keys_total", {"route": "/refunds"}
    )
    assert value == 2
    flagged = [r for r in caplog.records if "idempotency.regenerated_key" in r.getMessage()]
    assert len(flagged) == 2
    digests = {flagged[0].__dict__["key_digest"], flagged[0].__dict__["other_key_digest"]}
    assert len(digests) == 2
    assert all(len(d) == 16 for d in digests)


async def test_a_key_derived_once_is_not_flagged() -> None:
    app = _app(detect_regenerated_keys=timedelta(seconds=60))
    key = derive_key("run-1", 3, "refund", {"order": "A-88214"})
    await _attempts(app, [key, key, key])  # retries of one attempt: replays
    await _attempts(app, [str(uuid.uuid4())], user="u2")  # another caller's own request
    assert _guard(app).snapshot().suspected_regenerated_keys == {}


async def test_off_by_default() -> None:
    app = _app()
    await _attempts(app, [str(uuid.uuid4()) for _ in range(3)])
    assert _guard(app).snapshot().suspected_regenerated_keys == {}


def test_the_window_is_a_positive_timedelta() -> None:
    from asgi_idempotency.observability.regenerated import RegeneratedKeys

    with pytest.raises(ValueError, match="window"):
        RegeneratedKeys(timedelta(0))


async def test_store_latency_and_takeovers_reach_prometheus() -> None:
    registry = CollectorRegistry()
    app = _app(metrics=PrometheusMetrics(registry))
    await _attempts(app, ["k-1", "k-1"])  # a claim and a completion, then a replay's claim
    labels = {"operation": "claim", "store": "MemoryStore"}
    assert registry.get_sample_value("idempotency_store_seconds_count", labels) == 2
    completes = {"operation": "complete", "store": "MemoryStore"}
    assert registry.get_sample_value("idempotency_store_seconds_count", completes) == 1
    assert registry.get_sample_value("idempotency_takeovers_total", {"route": "/refunds"}) is None


# --- Across processes: the markers live in the store every worker shares.


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def _worker(
    store: Store,
    clock: Callable[[], datetime],
    registry: CollectorRegistry,
    window: timedelta = timedelta(seconds=60),
) -> Starlette:
    """One worker's app: its own middleware, and its own store object on the shared database."""
    return _app(
        store,
        detect_regenerated_keys=window,
        metrics=PrometheusMetrics(registry),  # both workers count into one registry
        clock=clock,
    )


def _flagged(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value(
        "idempotency_suspected_regenerated_keys_total", {"route": "/refunds"}
    )
    return value or 0.0


async def _send(app: Starlette, key: str, user: str, order: str = "A-88214") -> int:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        response = await c.post(
            "/refunds",
            json={"order": order, "amount_p": 4500},
            headers={"Idempotency-Key": key, "X-User-Id": user},
        )
    return response.status_code


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("redis_cluster", marks=pytest.mark.redis),
    ]
)
async def two_stores(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Store, Store]]:
    """Two store objects (two pools, as two worker processes have) on one database."""
    if request.param.startswith("redis"):
        from asgi_idempotency.stores.redis import RedisStore

        url = request.getfixturevalue(f"{request.param}_url")
        redis_a, redis_b = await redis_store(url), RedisStore(url)  # flushed first
        try:
            yield redis_a, redis_b
        finally:
            await redis_a.close()
            await redis_b.close()
        return
    url = request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url")
    async with emptied(SQLStore(url)) as first:
        second = SQLStore(url)
        try:
            yield first, second
        finally:
            await second.close()


async def test_a_retry_under_a_new_key_on_another_worker_is_flagged(
    two_stores: tuple[Store, Store], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="asgi_idempotency")
    clock, registry = Clock(), CollectorRegistry()
    a, b = (_worker(store, clock, registry) for store in two_stores)
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    assert await _send(a, first, "u1") == 201
    assert await _send(b, second, "u1") == 201  # the bug: the retry minted a new key
    assert _flagged(registry) == 1
    (line,) = [r for r in caplog.records if "idempotency.regenerated_key" in r.getMessage()]
    digests = {line.__dict__["key_digest"], line.__dict__["other_key_digest"]}
    assert len(digests) == 2
    for digest in digests:  # each names one of the two requests' records, as inspect finds it
        (record,) = await two_stores[0].find(digest)
        assert record.status is RecordStatus.COMPLETED
        assert not record.token.startswith(MARKER_TOKEN)
    assert first not in line.getMessage()  # digests only, never the keys
    assert second not in line.getMessage()


async def test_a_key_derived_once_and_another_callers_twin_are_not_flagged(
    two_stores: tuple[Store, Store],
) -> None:
    clock, registry = Clock(), CollectorRegistry()
    a, b = (_worker(store, clock, registry) for store in two_stores)
    key = derive_key("run-1", 3, "refund", {"order": "A-88214"})
    assert await _send(a, key, "u1") == 201
    assert await _send(b, key, "u1") == 201  # the retry, on the other worker: a replay
    assert await _send(a, key, "u1") == 201
    assert await _send(b, str(uuid.uuid4()), "u2") == 201  # same body, another caller
    assert await _send(a, str(uuid.uuid4()), "u1", order="B-1") == 201  # another request
    assert _flagged(registry) == 0


async def test_the_window_restarts_after_it_ends_and_prune_removes_the_markers(
    two_stores: tuple[Store, Store],
) -> None:
    # The window is the store's clock's: two units of it (a few seconds where shared).
    clock, registry = StoreClock(two_stores[0]), CollectorRegistry()
    window = 2 * clock.unit
    a, b = (_worker(store, clock, registry, window) for store in two_stores)
    assert await _send(a, "k-1", "u1") == 201
    await clock.past(window)  # past the window: a new sighting, not a retry
    assert await _send(b, "k-2", "u1") == 201
    assert _flagged(registry) == 0
    await clock.advance(window / 4)
    assert await _send(a, "k-3", "u1") == 201  # within the window k-2 restarted
    assert _flagged(registry) == 1
    # The marker expires with its window; prune deletes it with the expired records.
    store = two_stores[0]
    later = clock.now + window + clock.unit
    assert await store.prune(now=later) == 1
    assert await store.prune(now=later + timedelta(days=2)) == 3  # the three records


class Counting(MemoryStore):
    """Counts store round trips by primitive."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    async def insert(self, new: NewClaim) -> Record | None:
        self.calls["insert"] += 1
        return await super().insert(new)

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        self.calls["replace"] += 1
        return await super().replace(expected, new)

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, now: datetime, ttl: timedelta
    ) -> bool:
        self.calls["complete"] += 1
        return await super().complete(key, token, response, now=now, ttl=ttl)


@pytest.mark.parametrize("enabled", [False, True])
async def test_the_detector_costs_one_insert_per_executed_request_and_none_when_off(
    enabled: bool,
) -> None:
    store = Counting()
    window = timedelta(seconds=60) if enabled else None
    app = _app(store, detect_regenerated_keys=window)
    assert await _send(app, "k-1", "u1") == 201
    fresh = dict(store.calls)
    store.calls.clear()
    assert await _send(app, "k-1", "u1") == 201
    replay = dict(store.calls)
    assert fresh == {"insert": 2 if enabled else 1, "complete": 1}
    assert replay == {"insert": 1}  # a replay runs nothing, so it writes no marker


async def test_a_store_failure_in_the_detector_lets_the_request_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asgi_idempotency")

    class MarkerFails(MemoryStore):
        async def insert(self, new: NewClaim) -> Record | None:
            if new.token.startswith(MARKER_TOKEN):
                raise StoreError("the database did not answer")
            return await super().insert(new)

    app = _app(MarkerFails(), detect_regenerated_keys=timedelta(seconds=60))
    assert await _send(app, "k-1", "u1") == 201
    assert await _send(app, "k-1", "u1") == 201  # completed, so replayed
    assert any("idempotency.regenerated_check_failed" in r.getMessage() for r in caplog.records)

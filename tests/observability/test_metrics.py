"""Metrics and structured logs: a scripted mix of requests, read from Prometheus and a snapshot."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from asgi_idempotency import (
    IdempotencyMiddleware,
    InMemoryMetrics,
    MemoryStore,
    Outcome,
    Policy,
    SQLStore,
)
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.observability import metrics as metrics_module
from asgi_idempotency.observability import prometheus as prometheus_module
from asgi_idempotency.observability.metrics import FanOutMetrics, MetricsSnapshot
from asgi_idempotency.observability.prometheus import PrometheusMetrics
from asgi_idempotency.stores.base import Store
from tests.conftest import StoreClock, TinyFactory
from tests.project.docs_text import docs_text

pytestmark = pytest.mark.anyio

UNREACHABLE = "postgresql+asyncpg://postgres@127.0.0.1:9/x"
RAW_KEY = "raw-key-SECRET-4242"
BODY_MARK = "BODY-SECRET-1717"


async def until(condition: Callable[[], bool], *, within: float = 5.0) -> None:
    """Wait for ``condition``, polling; fail after ``within`` seconds."""
    for _ in range(int(within / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    pytest.fail("condition not reached in time")


def samples(text: str, name: str = "idempotency_requests_total") -> dict[tuple[str, str], float]:
    """``(route, outcome) -> value`` for one counter in an exposition text."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[(sample.labels["route"], sample.labels["outcome"])] = sample.value
    return out


POLICIES = {"POST /pay": Policy(required=True, max_body_bytes=1000)}

# What the script below produces: (route, outcome) -> count.
EXPECTED = {
    ("/pay", Outcome.EXECUTED): 2,
    ("/pay", Outcome.REPLAYED): 2,
    ("/pay", Outcome.MISMATCH): 1,
    ("/pay", Outcome.IN_PROGRESS): 1,
    ("/pay", Outcome.MISSING_KEY): 1,
    ("/pay", Outcome.INVALID_KEY): 1,
    ("/pay", Outcome.TOO_LARGE): 1,
    ("/pay", Outcome.STORE_UNAVAILABLE): 1,
    ("/fail/{status}", Outcome.RELEASED): 2,
    ("/fail/{status}", Outcome.UNGUARDED): 1,
}
GUARDED = sum(n for (_, o), n in EXPECTED.items() if o is not Outcome.UNGUARDED)


async def run_script(store: Store, tiny: TinyFactory, sink: FanOutMetrics) -> None:
    """Every outcome once or twice, through real ASGI requests."""
    app = tiny(store, policies=POLICIES, metrics=sink)
    async with app.client() as client:

        async def pay(key: str | None, body: Any, **kw: Any) -> httpx.Response:
            headers = {} if key is None else {"Idempotency-Key": key}
            response: httpx.Response = await client.post("/pay", json=body, headers=headers, **kw)
            return response

        assert (await pay("k-exec", {"n": 1})).status_code == 201
        for _ in range(2):
            replay = await pay("k-exec", {"n": 1})
            assert replay.status_code == 201
            assert replay.headers["idempotent-replayed"] == "true"
        assert (await pay("k-exec", {"n": 2})).status_code == 422

        first = asyncio.ensure_future(pay("k-wait", {"wait": True}))
        await until(lambda: app.calls.get("pay", 0) == 2)
        assert (await pay("k-wait", {"wait": True})).status_code == 409
        app.gate.set()
        assert (await first).status_code == 201

        assert (await pay(None, {"n": 1})).status_code == 400
        assert (await pay("has space", {"n": 1})).status_code == 400
        assert (await pay("k-big", {"pad": "x" * 2000})).status_code == 413
        for _ in range(2):  # released, so the retry runs again
            failed = await client.post("/fail/500", headers={"Idempotency-Key": "k-fail"})
            assert failed.status_code == 500
        assert app.calls["fail"] == 2
        assert (await client.post("/fail/200")).status_code == 200  # optional key, none sent

    down = SQLStore(UNREACHABLE, command_timeout=2)
    try:
        async with tiny(down, policies=POLICIES, metrics=sink).client() as client:
            response = await client.post(
                "/pay", json={"n": 1}, headers={"Idempotency-Key": "k-503"}
            )
            assert response.status_code == 503
            assert "retry-after" in response.headers
    finally:
        await down.close()


async def test_every_outcome_is_counted_in_prometheus_and_the_snapshot(
    store: Store, tiny: TinyFactory
) -> None:
    registry = CollectorRegistry()
    prom = PrometheusMetrics(registry)
    memory = InMemoryMetrics()
    await run_script(store, tiny, FanOutMetrics(prom, memory))

    expected = {(route, outcome.value): float(n) for (route, outcome), n in EXPECTED.items()}
    exposed = {k: v for k, v in samples(generate_latest(registry).decode()).items() if v}
    assert exposed == expected

    # The same text through the ASGI app an operator mounts at /metrics.
    transport = httpx.ASGITransport(app=prom.asgi_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        scraped = await client.get("/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    assert {k: v for k, v in samples(scraped.text).items() if v} == expected
    assert "# TYPE idempotency_requests_total counter" in scraped.text
    assert RAW_KEY not in scraped.text
    assert "k-exec" not in scraped.text

    snapshot = memory.snapshot()
    assert {k: v for k, v in snapshot.counts.items()} == EXPECTED
    assert snapshot.total(Outcome.REPLAYED) == 2
    assert snapshot.replay_rate() == pytest.approx(2 / GUARDED)
    assert snapshot.conflict_rate() == pytest.approx(1 / GUARDED)
    assert snapshot.replay_rate("/pay") == pytest.approx(2 / 10)
    assert snapshot.conflict_rate("/fail/{status}") == 0.0


def test_rates_are_zero_without_guarded_requests() -> None:
    snapshot = MetricsSnapshot({("/x", Outcome.UNGUARDED): 3})
    assert snapshot.replay_rate() == 0.0
    assert snapshot.conflict_rate() == 0.0


def test_listed_routes_are_exposed_at_zero_before_any_request() -> None:
    registry = CollectorRegistry()
    PrometheusMetrics(registry, prefix="payments_idem", routes=["/pay"])
    exposed = samples(generate_latest(registry).decode(), "payments_idem_requests_total")
    assert exposed == {("/pay", o.value): 0.0 for o in Outcome}


def test_instances_on_one_registry_and_prefix_share_the_counter() -> None:
    registry = CollectorRegistry()
    first = PrometheusMetrics(registry)
    second = PrometheusMetrics(registry, routes=["/late"])  # no "Duplicated timeseries"
    other_prefix = PrometheusMetrics(registry, prefix="other")
    other_registry = PrometheusMetrics(CollectorRegistry())
    assert second.requests is first.requests
    assert other_prefix.requests is not first.requests
    assert other_registry.requests is not first.requests

    first.observe("/pay", Outcome.EXECUTED)
    second.observe("/pay", Outcome.EXECUTED)
    exposed = samples(generate_latest(registry).decode())
    assert exposed[("/pay", "executed")] == 2.0
    assert exposed[("/late", "replayed")] == 0.0  # the second instance's routes, up front


def test_a_name_taken_by_another_collector_is_still_refused() -> None:
    registry = CollectorRegistry()
    PromCounter("idempotency_requests", "someone else's", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusMetrics(registry)


# --- /metrics in a real app -----------------------------------------------------------


def starlette_app() -> Starlette:
    async def pay(request: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    return Starlette(routes=[Route("/pay", pay, methods=["POST"])])


def fastapi_app() -> FastAPI:
    app = FastAPI()

    @app.post("/pay", status_code=201)
    async def pay() -> dict[str, bool]:
        return {"ok": True}

    return app


APPS = pytest.mark.parametrize(
    "make_app", [starlette_app, fastapi_app], ids=["starlette", "fastapi"]
)


def asgi_client(app: ASGIApp) -> httpx.AsyncClient:
    # follow_redirects stays False (httpx's default): a redirect must show as one.
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://t", follow_redirects=False)


def assert_scraped(response: httpx.Response) -> None:
    assert response.status_code == 200, response.headers.get("location")
    assert response.headers["content-type"].startswith("text/plain")
    assert "idempotency_requests_total" in response.text


@APPS
async def test_the_metrics_route_answers_200_at_slash_metrics(
    make_app: Callable[[], Starlette],
) -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    app = make_app()
    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS, metrics=metrics
    )
    app.add_route("/metrics", metrics.endpoint)
    async with asgi_client(app) as client:
        assert (await client.post("/pay", headers={"Idempotency-Key": "k"})).status_code == 201
        scraped = await client.get("/metrics")
    assert_scraped(scraped)
    assert samples(scraped.text) == {("/pay", "executed"): 1.0}


def readme_prometheus_example() -> str:
    """The Python block under the README's "Prometheus" heading, as written."""
    text = docs_text()
    section = text[text.index("#### Prometheus") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


@APPS
async def test_the_readme_prometheus_lines_serve_slash_metrics(
    make_app: Callable[[], Starlette],
) -> None:
    app = make_app()
    # The README's own lines, on the default registry: the second app in this test run
    # registers there too, as a second app in a real process would.
    exec(readme_prometheus_example(), {"app": app, "store": MemoryStore()})
    async with asgi_client(app) as client:
        assert (await client.post("/pay", headers={"Idempotency-Key": "k"})).status_code == 201
        assert_scraped(await client.get("/metrics"))


async def test_two_apps_count_into_the_default_registry_together() -> None:
    def executed() -> float:
        value = REGISTRY.get_sample_value(
            "idempotency_requests_total", {"route": "/pay", "outcome": "executed"}
        )
        return value or 0.0

    before = executed()
    apps = []
    for make_app in (starlette_app, fastapi_app):
        app = make_app()
        metrics = PrometheusMetrics()  # each app its own, both on the default registry
        app.add_middleware(
            IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS, metrics=metrics
        )
        app.add_route("/metrics", metrics.endpoint)
        apps.append(app)
    scraped = []
    for app in apps:
        async with asgi_client(app) as client:
            assert (await client.post("/pay", headers={"Idempotency-Key": "k"})).status_code == 201
            scraped.append(await client.get("/metrics"))
    assert executed() == before + 2
    for response in scraped:
        assert_scraped(response)
    assert samples(scraped[1].text)[("/pay", "executed")] == before + 2


# --- the labels the docs name ---------------------------------------------------------


def readme_section(heading: str, next_heading: str) -> str:
    text = docs_text()
    start = text.index(f"\n{heading}\n")
    return text[start : text.index(f"\n{next_heading}\n", start)]


def documented_route_placeholders() -> set[str]:
    """Placeholder route labels (``<...>``) the README's Metrics section and modules name."""
    texts = [
        readme_section("### Metrics", "### Log events"),
        metrics_module.__doc__ or "",
        prometheus_module.__doc__ or "",
    ]
    return {label for text in texts for label in re.findall(r"(<[a-z_]+>)", text)}


async def test_route_labels_emitted_are_the_ones_documented() -> None:
    memory = InMemoryMetrics()

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        await JSONResponse({"ok": True}, status_code=201)(scope, receive, send)

    policies = {"/pay": Policy(required=True)}
    unrouted = IdempotencyMiddleware(
        bare, store=MemoryStore(), principal=ANONYMOUS, policies=policies, metrics=memory
    )
    async with asgi_client(unrouted) as client:
        assert (await client.post("/pay", headers={"Idempotency-Key": "k"})).status_code == 201

    routed = starlette_app()
    routed.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), principal=ANONYMOUS, metrics=memory
    )
    async with asgi_client(routed) as client:
        missing = await client.post("/nope", headers={"Idempotency-Key": "k"})
        wrong_method = await client.put("/pay", headers={"Idempotency-Key": "k"})
    assert (missing.status_code, wrong_method.status_code) == (404, 405)

    # Requests matching no route are not counted; the bare app's are, as documented.
    assert memory.snapshot().counts == {("<unrouted>", Outcome.EXECUTED): 1}
    assert documented_route_placeholders() == {"<unrouted>"}


# --- in-process counting ----------------------------------------------------------------


def test_in_memory_counts_from_many_threads_add_up() -> None:
    metrics = InMemoryMetrics()
    threads, per_thread = 4, 20_000
    start = threading.Barrier(threads + 1)

    def work() -> None:
        start.wait()
        for _ in range(per_thread):
            metrics.observe("/pay", Outcome.EXECUTED)
        metrics.observe("/pay", Outcome.REPLAYED)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    seen = [metrics.snapshot().total() for _ in range(50)]  # read while they write
    for worker in workers:
        worker.join()
    assert seen == sorted(seen)  # never goes backwards
    assert metrics.snapshot().counts == {
        ("/pay", Outcome.EXECUTED): threads * per_thread,
        ("/pay", Outcome.REPLAYED): threads,
    }


# --- structured logs ----------------------------------------------------------------


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == "asgi_idempotency" and r.__dict__["event"] == event
    ]


def assert_structured(record: logging.LogRecord, *, route: str, outcome: str) -> None:
    fields = record.__dict__
    # Plain logging shows the fields too: the message is "event name=value ...".
    message = record.getMessage()
    assert message.startswith(fields["event"] + " ")
    assert f"route={route}" in message.split()
    assert f"outcome={outcome}" in message.split()
    assert fields["route"] == route
    assert fields["outcome"] == outcome
    digest = fields["key_digest"]
    assert isinstance(digest, str)
    assert len(digest) == 16
    int(digest, 16)  # hex
    flat = repr(fields)
    assert RAW_KEY not in flat
    assert BODY_MARK not in flat


async def test_log_events_carry_route_outcome_and_key_digest_only(
    store: Store, tiny: TinyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_idempotency")
    clock = StoreClock(store)
    policy = Policy(required=True, lease=clock.unit)
    app = tiny(store, policies={"POST /pay": policy}, clock=clock)
    body = {"secret": BODY_MARK}
    async with app.client() as client:

        async def pay(data: Any) -> httpx.Response:
            headers = {"Idempotency-Key": RAW_KEY}
            response: httpx.Response = await client.post("/pay", json=data, headers=headers)
            return response

        assert (await pay(body)).status_code == 201
        assert (await pay(body)).status_code == 201  # replay
        assert (await pay({**body, "n": 2})).status_code == 422  # conflict

        # An abandoned claim: its worker dies in the handler, and its lease ends.
        waiting = {"wait": True, "secret": BODY_MARK}
        hung = asyncio.ensure_future(
            client.post("/pay", json=waiting, headers={"Idempotency-Key": "k2"})
        )
        await until(lambda: app.calls.get("pay", 0) == 2)
        hung.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hung
        await clock.past(clock.unit)
        app.gate.set()
        retry = await client.post("/pay", json=waiting, headers={"Idempotency-Key": "k2"})
        assert retry.status_code == 201
        assert app.calls["pay"] == 3

    down = SQLStore(UNREACHABLE, command_timeout=2)
    try:
        async with tiny(down, policies={"POST /pay": policy}).client() as client:
            failed = await client.post("/pay", json=body, headers={"Idempotency-Key": RAW_KEY})
            assert failed.status_code == 503
    finally:
        await down.close()

    (replay,) = events(caplog, "idempotency.replay")
    assert_structured(replay, route="/pay", outcome="replayed")
    assert replay.__dict__["status"] == 201
    (mismatch,) = events(caplog, "idempotency.mismatch")
    assert_structured(mismatch, route="/pay", outcome="mismatch")
    (takeover,) = events(caplog, "idempotency.takeover")
    assert_structured(takeover, route="/pay", outcome="taken_over")
    errors = events(caplog, "idempotency.store_error")
    assert [e.__dict__["phase"] for e in errors] == ["claim"]
    assert_structured(errors[0], route="/pay", outcome="store_unavailable")
    # The same key gives the same digest, so log lines join up (and match `inspect`).
    assert replay.__dict__["key_digest"] == mismatch.__dict__["key_digest"]
    assert replay.__dict__["key_digest"] == errors[0].__dict__["key_digest"]
    for record in caplog.records:
        assert RAW_KEY not in repr(record.__dict__)
        assert BODY_MARK not in repr(record.__dict__)


def test_the_readme_outcome_table_lists_exactly_the_outcomes() -> None:
    section = readme_section("### Metrics", "### Log events")
    table = section[section.index("| outcome |") :].split("\n\n")[0]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    documented = [re.fullmatch(r"\| `(\w+)` \|.*", row) for row in rows]
    assert all(documented), rows
    assert [m.group(1) for m in documented if m] == [o.value for o in Outcome]
    # The cardinality sentence ("guarded routes times 10") counts the outcomes.
    times = "\N{MULTIPLICATION SIGN}"
    assert f"guarded routes {times} {len(Outcome)}" in section.replace("\n", " ")

"""IdempotentTransport / AsyncIdempotentTransport against a real scripted server on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency.client import (
    IDEMPOTENCY_KEY_HEADER,
    AsyncIdempotentTransport,
    IdempotentTransport,
    RetriesExhausted,
    RetryPolicy,
    random_key,
)
from asgi_idempotency.ops._serve import serve_in_thread

# Fast backoff so a test with several retries stays well under a second.
FAST = RetryPolicy(attempts=5, timeout=10.0, wait_initial=0.01, wait_max=0.05, wait_jitter=0.01)
# The client gives up reading after this long; "slow" steps answer after it.
# Only reads are cut short; connects get room on a loaded machine.
READ_TIMEOUT = httpx.Timeout(5.0, read=0.5)
SLOW = 1.0


@dataclass(frozen=True)
class Step:
    """What the service does for one call: effect first (on 2xx), then wait, then answer."""

    status: int = 201
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Service:
    """A non-idempotent service following a script; the last step repeats."""

    steps: list[Step]
    calls: list[tuple[str | None, bytes]] = field(default_factory=list)
    effects: int = 0

    def app(self) -> Starlette:
        async def op(request: Request) -> Response:
            step = self.steps[min(len(self.calls), len(self.steps) - 1)]
            self.calls.append((request.headers.get(IDEMPOTENCY_KEY_HEADER), await request.body()))
            if step.status < 300:
                self.effects += 1
            await anyio.sleep(step.delay)
            return JSONResponse({"effects": self.effects}, step.status, headers=step.headers)

        return Starlette(routes=[Route("/op", op, methods=["POST", "PUT"])])

    @property
    def keys(self) -> list[str | None]:
        return [key for key, _ in self.calls]


@pytest.fixture(scope="module")
def _server() -> Iterator[tuple[Service, str]]:
    svc = Service([Step()])
    with serve_in_thread(svc.app()) as url:
        yield svc, url


@pytest.fixture
def service(_server: tuple[Service, str]) -> tuple[Service, str]:
    """The module's server with a fresh script. Handlers log a call before they
    sleep, so a slow handler left over from an earlier test cannot leak into this one."""
    svc, url = _server
    svc.steps, svc.calls, svc.effects = [Step()], [], 0
    return svc, url


def _async_client(url: str, **kwargs: object) -> httpx.AsyncClient:
    transport = AsyncIdempotentTransport(policy=FAST, **kwargs)  # type: ignore[arg-type]  # each test's own options
    return httpx.AsyncClient(transport=transport, base_url=url, timeout=READ_TIMEOUT)


def _sync_client(url: str, **kwargs: object) -> httpx.Client:
    transport = IdempotentTransport(policy=FAST, **kwargs)  # type: ignore[arg-type]  # each test's own options
    return httpx.Client(transport=transport, base_url=url, timeout=READ_TIMEOUT)


# --- the guarantee: one key for every attempt ----------------------------------------


@pytest.mark.anyio
async def test_every_attempt_carries_the_same_minted_key(service: tuple[Service, str]) -> None:
    svc, url = service
    # Read timeout (the service acted), then 503, then success.
    svc.steps = [Step(delay=SLOW), Step(503), Step()]
    async with _async_client(url, key_for=random_key) as http:
        response = await http.post("/op", json={"amount": 4500})
    assert response.status_code == 201
    assert len(svc.calls) == 3
    assert len(set(svc.keys)) == 1
    assert svc.keys[0] is not None
    assert response.request.headers[IDEMPOTENCY_KEY_HEADER] == svc.keys[0]
    assert {body for _, body in svc.calls} == {b'{"amount":4500}'}


def test_sync_every_attempt_carries_the_same_key_and_body(service: tuple[Service, str]) -> None:
    svc, url = service
    svc.steps = [Step(delay=SLOW), Step(502), Step()]
    with _sync_client(url, key_for=random_key) as http:
        # A one-shot generator body: the transport buffers it so attempt 3 still has it.
        response = http.post("/op", content=iter([b"part-1,", b"part-2"]))
    assert response.status_code == 201
    assert len(svc.calls) == 3
    assert len(set(svc.keys)) == 1
    assert {body for _, body in svc.calls} == {b"part-1,part-2"}


@pytest.mark.anyio
async def test_a_callers_key_wins_over_key_for(service: tuple[Service, str]) -> None:
    svc, url = service
    svc.steps = [Step(503), Step()]
    async with _async_client(url, key_for=random_key) as http:
        await http.post("/op", json={}, headers={IDEMPOTENCY_KEY_HEADER: "v1:mine"})
    assert svc.keys == ["v1:mine", "v1:mine"]


# --- what is and is not retried ----------------------------------------------------------


@pytest.mark.anyio
async def test_read_timeout_without_a_key_is_not_retried(service: tuple[Service, str]) -> None:
    svc, url = service
    svc.steps = [Step(delay=SLOW)]
    async with _async_client(url) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/op", json={})
    assert svc.keys == [None]


def test_sync_read_timeout_without_a_key_is_not_retried(service: tuple[Service, str]) -> None:
    svc, url = service
    svc.steps = [Step(delay=SLOW)]
    with _sync_client(url) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/op", json={})
    assert len(svc.calls) == 1


@pytest.mark.anyio
async def test_put_is_idempotent_and_retried_without_a_key(service: tuple[Service, str]) -> None:
    svc, url = service
    svc.steps = [Step(delay=SLOW), Step()]
    async with _async_client(url) as http:
        response = await http.put("/op", json={})
    assert response.status_code == 201
    assert svc.keys == [None, None]


@pytest.mark.anyio
@pytest.mark.parametrize("status", [400, 409, 422, 500])
async def test_final_answers_are_returned_unretried(
    service: tuple[Service, str], status: int
) -> None:
    svc, url = service
    svc.steps = [Step(status)]
    async with _async_client(url) as http:  # no key: a 409 is the app's own conflict
        response = await http.post("/op", json={})
    assert response.status_code == status
    assert response.json() == {"effects": 0}
    assert len(svc.calls) == 1


@pytest.mark.anyio
async def test_retry_after_is_honoured(service: tuple[Service, str]) -> None:
    svc, url = service
    svc.steps = [Step(429, headers={"Retry-After": "1"}), Step()]
    started = time.monotonic()
    async with _async_client(url) as http:  # 429: not processed, retried without a key
        response = await http.post("/op", json={})
    assert response.status_code == 201
    assert time.monotonic() - started >= 1.0
    assert len(svc.calls) == 2


@pytest.mark.anyio
async def test_retry_after_beyond_the_budget_gives_up_at_once(
    service: tuple[Service, str],
) -> None:
    svc, url = service
    svc.steps = [Step(503, headers={"Retry-After": "30"})]
    transport = AsyncIdempotentTransport(policy=RetryPolicy(timeout=2.0))
    started = time.monotonic()
    async with httpx.AsyncClient(transport=transport, base_url=url) as http:
        with pytest.raises(RetriesExhausted) as caught:
            await http.post("/op", json={}, headers={IDEMPOTENCY_KEY_HEADER: "k"})
    assert time.monotonic() - started < 1.0
    assert len(caught.value.attempts) == 1
    assert "exceeds the remaining budget" in caught.value.attempts[0].reason


# --- giving up -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_exhaustion_says_how_many_attempts_ran_and_why(service: tuple[Service, str]) -> None:
    svc, url = service
    svc.steps = [Step(delay=SLOW), Step(503), Step(504)]
    policy = RetryPolicy(attempts=3, timeout=10.0, wait_initial=0.01, wait_max=0.05, wait_jitter=0)
    transport = AsyncIdempotentTransport(policy=policy)
    async with httpx.AsyncClient(transport=transport, base_url=url, timeout=READ_TIMEOUT) as http:
        with pytest.raises(RetriesExhausted) as caught:
            await http.post("/op", json={}, headers={IDEMPOTENCY_KEY_HEADER: "k-1"})
    error = caught.value
    assert isinstance(error, httpx.TransportError)
    assert error.key == "k-1"
    assert [a.number for a in error.attempts] == [1, 2, 3]
    assert [a.status_code for a in error.attempts] == [None, 503, 504]
    assert "ReadTimeout" in (error.attempts[0].error or "")
    assert error.attempts[0].elapsed <= error.attempts[1].elapsed <= error.attempts[2].elapsed
    assert str(error).startswith("gave up after 3 attempt(s)")
    assert "#1 ReadTimeout" in str(error)
    assert "#3 504 gateway timeout" in str(error)
    assert len(svc.calls) == 3


def test_sync_connect_errors_are_retried_then_exhausted(refused_url: str) -> None:
    policy = RetryPolicy(attempts=3, timeout=10.0, wait_initial=0.01, wait_max=0.02, wait_jitter=0)
    with (
        httpx.Client(transport=IdempotentTransport(policy=policy), base_url=refused_url) as http,
        pytest.raises(RetriesExhausted) as caught,
    ):
        http.post("/op", json={})  # no key needed: nothing was ever sent
    assert len(caught.value.attempts) == 3
    assert all("ConnectError: nothing was sent" in a.reason for a in caught.value.attempts)
    assert caught.value.key is None


@pytest.mark.anyio
async def test_an_unretryable_end_keeps_its_type_and_gets_the_history(
    service: tuple[Service, str],
) -> None:
    svc, url = service
    svc.steps = [Step(429), Step(delay=SLOW)]
    async with _async_client(url) as http:
        with pytest.raises(httpx.ReadTimeout) as caught:
            await http.post("/op", json={})
    notes = getattr(caught.value, "__notes__", [])
    assert any(n.startswith("after 2 attempts: #1 429 rate limited") for n in notes)
    assert len(svc.calls) == 2


class _CountingTransport(httpx.AsyncHTTPTransport):
    """A real transport that also counts how often it was closed."""

    closed = 0

    async def aclose(self) -> None:
        self.closed += 1
        await super().aclose()


@pytest.mark.anyio
async def test_transport_closes_its_inner_transport(service: tuple[Service, str]) -> None:
    _, url = service
    inner = _CountingTransport()
    async with httpx.AsyncClient(transport=AsyncIdempotentTransport(inner), base_url=url) as http:
        await http.post("/op", json={})
    assert inner.closed == 1

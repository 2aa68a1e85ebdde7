"""The client against the real middleware over loopback HTTP.

The incident this prevents: the server is slower than the client's read timeout,
the client retries, and the refund happens twice. With the transport the retry
carries the same key, meets 409 while the first run is in flight, polls, and gets
the first run's response replayed: one effect, the original body.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from asgi_idempotency.client import (
    IDEMPOTENCY_KEY_HEADER,
    AsyncIdempotentTransport,
    IdempotentTransport,
    RetryPolicy,
    derive_key,
    random_key,
)
from asgi_idempotency.ops._serve import serve_in_thread
from tests.client._apps import guarded_app

# Only reads are cut short; connects get room on a loaded machine.
READ_TIMEOUT = httpx.Timeout(5.0, read=0.3)
HANDLER_DELAY = 0.8  # the server answers well after the client stopped waiting
POLL = RetryPolicy(attempts=30, timeout=15.0, wait_initial=0.05, wait_max=0.2, wait_jitter=0.05)
ARGS = {"order_id": "ord_1", "amount": 4500, "currency": "EUR"}


def _store(kind: str, tmp_path: Path) -> str | Path:
    return "memory" if kind == "memory" else tmp_path / "idempotency.db"


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_slow_server_one_effect_and_the_original_response(kind: str, tmp_path: Path) -> None:
    guarded = guarded_app(_store(kind, tmp_path), delay=HANDLER_DELAY)
    key = derive_key("run-e2e", 0, "refund", ARGS)
    with serve_in_thread(guarded.app, lifespan="on") as url:
        transport = AsyncIdempotentTransport(policy=POLL)
        async with httpx.AsyncClient(
            transport=transport, base_url=url, timeout=READ_TIMEOUT
        ) as http:
            response = await http.post("/refunds", json=ARGS, headers={IDEMPOTENCY_KEY_HEADER: key})

    assert response.status_code == 201
    assert response.headers["idempotent-replayed"] == "true"
    assert len(guarded.effects) == 1
    assert response.json() == guarded.effects[0]  # the first run's body, not a new one
    # Attempt 1 timed out; retries met 409 while it ran; the last one got the replay.
    assert guarded.statuses.count(409) >= 1
    assert guarded.statuses[-1] == 201
    assert set(guarded.statuses) == {201, 409}


def test_sync_client_with_minted_keys_gets_one_effect(tmp_path: Path) -> None:
    guarded = guarded_app("memory", delay=HANDLER_DELAY)
    with serve_in_thread(guarded.app, lifespan="on") as url:
        transport = IdempotentTransport(policy=POLL, key_for=random_key)
        with httpx.Client(transport=transport, base_url=url, timeout=READ_TIMEOUT) as http:
            response = http.post("/refunds", json=ARGS)
            # A second logical call mints a new key: a second, separate effect.
            other = http.post("/refunds", json=ARGS)

    assert response.status_code == other.status_code == 201
    assert response.headers["idempotent-replayed"] == "true"
    assert len(guarded.effects) == 2
    assert response.json() == guarded.effects[0]
    assert other.json() == guarded.effects[1]


@pytest.mark.anyio
async def test_same_key_other_arguments_is_422_and_not_retried() -> None:
    guarded = guarded_app("memory")
    key = derive_key("run-e2e", 0, "refund", ARGS)
    with serve_in_thread(guarded.app, lifespan="on") as url:
        transport = AsyncIdempotentTransport(policy=POLL)
        async with httpx.AsyncClient(transport=transport, base_url=url, timeout=5.0) as http:
            first = await http.post("/refunds", json=ARGS, headers={IDEMPOTENCY_KEY_HEADER: key})
            changed = {**ARGS, "amount": 4501}
            reused = await http.post(
                "/refunds", json=changed, headers={IDEMPOTENCY_KEY_HEADER: key}
            )
            # The same arguments written differently are the same request: a replay.
            reordered = {"currency": "EUR", "amount": 4500.0, "order_id": "ord_1"}
            again = await http.post(
                "/refunds", json=reordered, headers={IDEMPOTENCY_KEY_HEADER: key}
            )

    assert first.status_code == 201
    assert reused.status_code == 422
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert guarded.statuses == [201, 422, 201]
    assert len(guarded.effects) == 1


@pytest.mark.anyio
async def test_without_the_transport_the_same_incident_duplicates() -> None:
    """Control: a hand-written retry that forgets the key runs the handler twice."""
    guarded = guarded_app("memory", delay=HANDLER_DELAY)
    with serve_in_thread(guarded.app, lifespan="on") as url:
        async with httpx.AsyncClient(base_url=url, timeout=READ_TIMEOUT) as http:
            for attempt in range(2):
                key = f"attempt-{attempt}"  # the bug: a new key per attempt
                try:
                    await http.post("/refunds", json=ARGS, headers={IDEMPOTENCY_KEY_HEADER: key})
                except httpx.ReadTimeout:
                    continue
    assert len(guarded.effects) == 2

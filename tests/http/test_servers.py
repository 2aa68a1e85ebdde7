"""The guard on every ASGI server: uvicorn, hypercorn (HTTP/1.1 and HTTP/2) and granian.

Real server processes on loopback, serving ``tests/http/servers_app.py``: a guarded POST runs
once, its retry replays, a reused key with another body is 422, a duplicate in flight
409; and a response with trailers ends promptly, its trailers replayed, on hypercorn
over HTTP/2 (where the guard used to drop them and the stream stayed open until the
server's idle timeout).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from tests.helpers.serving import Server, ServerProcess, run_server
from tests.http.servers_app import TRAILERS

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.http.servers_app:app"
BODY = {"order": "A-88214", "amount_p": 4500}

# (server, HTTP version the client speaks): h2 is cleartext with prior knowledge.
CASES = [
    ("uvicorn", "1.1"),
    ("hypercorn", "1.1"),
    ("hypercorn", "2"),
    ("granian", "1.1"),
    ("granian", "2"),
]


@pytest.fixture(params=CASES, ids=[f"{s}-h{v}" for s, v in CASES])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ServerProcess, str]]:
    server: Server = request.param[0]
    with run_server(server, APP, env={"PYTHONPATH": str(ROOT)}, log_dir=tmp_path) as process:
        yield process, request.param[1]


def client(base_url: str, version: str) -> httpx.AsyncClient:
    h2 = version == "2"
    return httpx.AsyncClient(base_url=base_url, http1=not h2, http2=h2, timeout=10)


async def test_fresh_replay_mismatch_and_in_flight_on_each_server(
    served: tuple[ServerProcess, str],
) -> None:
    server, version = served
    async with client(server.base_url, version) as c:
        key = {"Idempotency-Key": "refund-A-88214"}
        first = await c.post("/refunds", json=BODY, headers=key)
        assert first.http_version == f"HTTP/{version}"
        assert first.status_code == 201, first.text
        assert "idempotent-replayed" not in first.headers
        replay = await c.post("/refunds", json=BODY, headers=key)
        assert replay.status_code == 201
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.content == first.content
        other = await c.post("/refunds", json={**BODY, "amount_p": 1}, headers=key)
        assert other.status_code == 422
        assert other.headers["content-type"] == "application/problem+json"

        slow_key = {"Idempotency-Key": "slow-1"}
        running = asyncio.create_task(c.post("/slow", json=BODY, headers=slow_key))
        deadline = time.monotonic() + 10
        while (await c.get("/entered")).text != "1":
            assert time.monotonic() < deadline, "the first request never reached its handler"
            await asyncio.sleep(0.02)
        duplicate = await c.post("/slow", json=BODY, headers=slow_key)
        assert duplicate.status_code == 409
        assert duplicate.headers["retry-after"]
        await c.get("/release")
        done = await running
        assert done.status_code == 201
        again = await c.post("/slow", json=BODY, headers=slow_key)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == done.content

        # The trailers endpoint: on servers without trailers it sends none; it ends anyway.
        grpc = [await c.post("/grpc", content=b"{}", headers={"Idempotency-Key": "g"})
                for _ in range(2)]  # fmt: skip
        assert [g.status_code for g in grpc] == [200, 200]
        assert grpc[1].headers["idempotent-replayed"] == "true"
        runs = (await c.get("/runs")).json()
    assert runs == {"refunds": 1, "slow": 1, "grpc": 1}


@dataclass
class H2Answer:
    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    ended: bool = False
    seconds: float = 0.0


def h2_post(base_url: str, path: str, headers: list[tuple[str, str]], body: bytes) -> H2Answer:
    """One POST over cleartext HTTP/2 (prior knowledge), read to the end of its stream with
    ``h2`` itself: httpx does not hand trailers to its caller. Gives up after 5 s (a
    stream left open), reporting ``ended=False``."""
    host, port = base_url.removeprefix("http://").split(":")
    answer = H2Answer()
    started = time.monotonic()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        conn.initiate_connection()
        request = [(":method", "POST"), (":scheme", "http"), (":authority", f"{host}:{port}"),
                   (":path", path), ("te", "trailers"), *headers]  # fmt: skip
        conn.send_headers(1, request)
        conn.send_data(1, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        try:
            while not answer.ended:
                data = sock.recv(65536)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        answer.headers = {bytes(n): bytes(v) for n, v in event.headers}
                        answer.status = int(answer.headers[b":status"])
                    elif isinstance(event, h2.events.DataReceived):
                        answer.body += event.data
                        conn.acknowledge_received_data(len(event.data), event.stream_id)
                    elif isinstance(event, h2.events.TrailersReceived):
                        answer.trailers = [(bytes(n), bytes(v)) for n, v in event.headers]
                    elif isinstance(event, h2.events.StreamEnded):
                        answer.ended = True
                sock.sendall(conn.data_to_send())
        except TimeoutError:
            pass  # the stream stayed open
    answer.seconds = time.monotonic() - started
    return answer


def test_a_response_with_trailers_ends_promptly_and_replays_them_on_hypercorn_h2(
    tmp_path: Path,
) -> None:
    env = {"PYTHONPATH": str(ROOT)}
    with run_server("hypercorn", APP, env=env, log_dir=tmp_path) as server:
        key = [("idempotency-key", "refund-grpc-1"), ("content-type", "application/json")]
        first = h2_post(server.base_url, "/grpc", key, b"{}")
        replay = h2_post(server.base_url, "/grpc", key, b"{}")
        # Over HTTP/1.1 hypercorn offers no trailers: the replay ends with its body.
        started = time.monotonic()
        plain = httpx.post(server.base_url + "/grpc", content=b"{}", headers=dict(key), timeout=5)
        plain_seconds = time.monotonic() - started
        runs = httpx.get(server.base_url + "/runs").json()
    for answer in (first, replay):
        assert answer.ended, f"the stream stayed open ({answer.seconds:.1f} s)"
        assert answer.seconds < 2
        assert answer.status == 200
        assert answer.body == b'{"refund": 1}'
        assert answer.trailers == TRAILERS
    assert b"idempotent-replayed" not in first.headers
    assert replay.headers[b"idempotent-replayed"] == b"true"
    assert (plain.status_code, plain.headers["idempotent-replayed"]) == (200, "true")
    assert plain.content == b'{"refund": 1}'
    assert plain_seconds < 2
    assert runs == {"grpc": 1}

"""The outcome is the response the app sent, when its final body goes out; streams flow.

Real uvicorn processes: a BackgroundTask that takes 3 s and then raises neither
delays the answer nor releases the key (the retry replays, the handler ran once); a
Server-Sent Events stream reaches the client event by event, and is stored when it
ends. In process: an ASGI server offering ``http.response.pathsend`` (Granian) gets a
guarded FileResponse's bytes, stored and replayed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from asgi_idempotency import MemoryStore, idempotent
from tests.apps import guarded
from tests.helpers.serving import run_uvicorn

APP = "tests.reliability.answer_app:app"


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        "EFFECTS": str(tmp_path / "effects.txt"),
        "STORE_URL": f"sqlite+aiosqlite:///{tmp_path / 'records.db'}",
    }


def _runs(tmp_path: Path, name: str) -> int:
    return (tmp_path / "effects.txt").read_text().splitlines().count(name)


@pytest.mark.slow
def test_a_failing_background_task_neither_delays_nor_doubles(tmp_path: Path) -> None:
    with run_uvicorn(APP, env=_env(tmp_path), log_dir=tmp_path) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as c:
            headers = {"Idempotency-Key": "order-1"}
            began = time.monotonic()
            first = c.post("/orders", headers=headers)
            took = time.monotonic() - began
            assert first.status_code == 201, first.text
            assert took < 2.0, f"the answer waited {took:.1f}s for the background task"
            time.sleep(3.5)  # the task has raised by now
            again = c.post("/orders", headers=headers)
        assert again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()
        assert _runs(tmp_path, "order") == 1
        assert "the e-mail server is down" in server.log.read_text()  # it did fail


@pytest.mark.slow
def test_a_stream_reaches_the_client_as_it_is_produced_and_replays(tmp_path: Path) -> None:
    with run_uvicorn(APP, env=_env(tmp_path), log_dir=tmp_path) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as c:
            headers = {"Idempotency-Key": "events-1"}
            began = time.monotonic()
            with c.stream("POST", "/events", headers=headers) as r:
                assert r.status_code == 200
                chunks = r.iter_bytes()
                first = next(chunks)
                first_at = time.monotonic() - began
                rest = b"".join(chunks)
                ended_at = time.monotonic() - began
            assert first.startswith(b"data: 0")
            assert first_at < 1.0 < ended_at, (first_at, ended_at)  # not held back
            again = c.post("/events", headers=headers)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == first + rest
        assert _runs(tmp_path, "events") == 1


@pytest.mark.anyio
async def test_pathsend_file_response_delivers_and_replays_its_bytes(tmp_path: Path) -> None:
    receipt = tmp_path / "receipt.pdf"
    receipt.write_bytes(b"%PDF-1.7 receipt A-88214\n" * 100)
    runs: list[int] = []

    @idempotent(required=True)
    async def download(request: Request) -> Response:
        runs.append(1)
        return FileResponse(receipt, status_code=201)

    app = guarded(MemoryStore(), [Route("/receipts", download, methods=["POST"])])

    async def call() -> tuple[int, dict[bytes, bytes], bytes]:
        """As Granian calls an app: the pathsend extension offered."""
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/receipts", "raw_path": b"/receipts",
            "root_path": "", "query_string": b"", "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 80), "extensions": {"http.response.pathsend": {}},
            "headers": [(b"host", b"shop.example"), (b"idempotency-key", b"r-1")],
        }  # fmt: skip
        sent: list[dict[str, Any]] = []
        messages = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)
            raise AssertionError

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(dict(message))

        await app(scope, receive, send)
        start = sent[0]
        assert all(m["type"] != "http.response.pathsend" for m in sent)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return start["status"], dict(start["headers"]), body

    status, _, body = await call()
    assert status == 201
    assert body == receipt.read_bytes()
    status, headers, body = await call()
    assert headers[b"idempotent-replayed"] == b"true"
    assert body == receipt.read_bytes()
    assert runs == [1]


@pytest.mark.anyio
async def test_a_stream_too_large_to_keep_runs_once_and_retries_are_told_so() -> None:
    from collections.abc import AsyncIterator

    import httpx
    from starlette.responses import StreamingResponse

    from asgi_idempotency.http.responder import STREAM_KEEP_LIMIT

    runs: list[int] = []
    chunk = b"x" * 65536

    @idempotent(required=True)
    async def export(request: Request) -> Response:
        runs.append(1)

        async def produce() -> AsyncIterator[bytes]:
            for _ in range(STREAM_KEEP_LIMIT // len(chunk) + 2):  # past the limit
                yield chunk

        return StreamingResponse(produce(), media_type="application/octet-stream")

    app = guarded(MemoryStore(), [Route("/exports", export, methods=["POST"])])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        first = await c.post("/exports", headers={"Idempotency-Key": "e-1"})
        again = await c.post("/exports", headers={"Idempotency-Key": "e-1"})
    assert first.status_code == 200
    assert len(first.content) > STREAM_KEEP_LIMIT  # the client got all of it
    assert again.status_code == 410
    assert again.json()["type"] == "urn:asgi-idempotency:problem:response-not-kept"
    assert again.headers["idempotent-replayed"] == "true"
    assert runs == [1]  # told, not run again

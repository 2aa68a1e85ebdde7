"""The two errors a newcomer meets first, as a one-line log shows them.

A handler that prints ``%(message)s`` (Python's last-resort format, and what many
setups print) shows nothing but the message: it must be one line that says what
failed and what to do, for a missing table and for a database that does not answer.
The structured fields (``extra``) stay as they were.

With no logging configured at all, a started middleware shows WARNING and up in
uvicorn's output or on stderr (docs/operations.md, Log events;
tests/http/test_startup_refusals.py serves one with uvicorn).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_idempotency.stores.sql.store import SQLStore
from tests.apps import guarded
from tests.conftest import PgServer

pytestmark = pytest.mark.anyio


class Lines(logging.Handler):
    """What a ``%(message)s`` handler prints, one entry per record, with the record."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self.shown: list[tuple[str, logging.LogRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.shown.append((self.format(record), record))


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    package = logging.getLogger("asgi_idempotency")
    package.addHandler(handler)
    try:
        yield handler
    finally:
        package.removeHandler(handler)


async def _post(url: str) -> httpx.Response:
    async def pay(_request: Request) -> JSONResponse:
        return JSONResponse({"ok": True}, status_code=201)

    store = SQLStore(url, command_timeout=2)
    app = guarded(store, [Route("/pay", pay, methods=["POST"])])
    try:
        transport = httpx.ASGITransport(app=app)  # no lifespan: checked on the request
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/pay", headers={"Idempotency-Key": "k-1"})
    finally:
        await store.close()


def _one_line_each(lines: Lines, event: str) -> list[tuple[str, logging.LogRecord]]:
    found = [(text, r) for text, r in lines.shown if r.__dict__.get("event") == event]
    assert found, [text for text, _ in lines.shown]
    for text, record in found:
        assert "\n" not in text, text
        assert text.startswith(event + " "), text
        assert f"error={record.__dict__['error']}" in text.split()
    return found


@pytest.mark.postgres
async def test_a_missing_table_reads_as_one_line_with_the_fix(
    pg_server: PgServer, lines: Lines
) -> None:
    with pg_server.database("idem_msg") as url:
        response = await _post(url)
    assert response.status_code == 503
    [(text, record)] = _one_line_each(lines, "idempotency.not_ready")
    assert "the idempotency_records table does not exist" in text
    assert "run `asgi-idempotency migrate --database-url" in text
    assert record.__dict__["error"] == "SchemaMissing"
    assert text.endswith(record.__dict__["detail"])  # the detail, whole, at the end


async def test_a_database_that_does_not_answer_reads_as_one_line_with_the_fix(
    lines: Lines,
) -> None:
    response = await _post("postgresql+asyncpg://postgres@127.0.0.1:9/x")
    assert response.status_code == 503
    for event in ("idempotency.not_ready", "idempotency.store_error"):
        for text, record in _one_line_each(lines, event):
            detail = record.__dict__["detail"]
            assert "ConnectionRefusedError" in detail
            assert f"detail={detail} -- " in text  # the cause, then what to do
            assert "check that it is up and reachable from this server" in text, text
    [(text, record)] = _one_line_each(lines, "idempotency.store_error")
    assert "outcome=store_unavailable" in text.split()
    assert text.index("outcome=") < text.index("detail=")  # fields first, free text last
    assert record.__dict__["outcome"] == "store_unavailable"
    assert record.__dict__["phase"] == "claim"

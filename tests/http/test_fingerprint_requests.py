"""The fingerprint through the middleware, with real httpx requests and a real Starlette app.

Forms re-sent by a client (a fresh multipart boundary, reordered fields) are the same
request; a policy's excluded JSON members (a client's per-attempt timestamp) do not
count. The handler parses what it receives with Starlette's own form parser.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import MemoryStore, Policy
from tests.apps import guarded

pytestmark = pytest.mark.anyio

KEY = {"Idempotency-Key": "upload-7"}


@dataclass
class Uploads:
    """``POST /upload`` reads the form; ``POST /events`` reads JSON. Both count their runs."""

    policies: dict[str, Policy] = field(default_factory=dict)
    runs: int = 0

    def __post_init__(self) -> None:
        async def upload(request: Request) -> Response:
            self.runs += 1
            seen: dict[str, Any] = {}
            async with request.form() as form:  # closes the uploads' spooled files
                for name, value in form.multi_items():
                    if isinstance(value, UploadFile):
                        seen[name] = [value.filename, len(await value.read())]
                    else:
                        seen[name] = value
            return JSONResponse({"id": uuid.uuid4().hex, "form": seen}, status_code=201)

        async def events(request: Request) -> Response:
            self.runs += 1
            return JSONResponse({"id": uuid.uuid4().hex, "got": await request.json()}, 201)

        self.app = guarded(
            MemoryStore(),
            [
                Route("/upload", upload, methods=["POST"]),
                Route("/events", events, methods=["POST"]),
            ],
            policies=self.policies,
        )

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://test"
        )


def _files(content: bytes = b"%PDF-1.7 \x00\x01 invoice") -> dict[str, tuple[str, bytes, str]]:
    return {
        "invoice": ("invoice.pdf", content, "application/pdf"),
        "note": ("note.txt", b"thanks", "text/plain"),
    }


async def test_a_multipart_upload_resent_under_a_new_boundary_is_replayed() -> None:
    u = Uploads()
    async with u.client() as c:
        first = await c.post("/upload", data={"amount": "4500"}, files=_files(), headers=KEY)
        again = await c.post("/upload", data={"amount": "4500"}, files=_files(), headers=KEY)
    sent = [r.request.headers["content-type"] for r in (first, again)]
    assert sent[0].startswith("multipart/form-data; boundary=")
    assert sent[0] != sent[1]  # httpx chose a fresh boundary: the bytes on the wire differ
    assert first.status_code == again.status_code == 201
    assert first.json()["form"] == {
        "amount": "4500",
        "invoice": ["invoice.pdf", 19],
        "note": ["note.txt", 6],
    }
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert u.runs == 1


async def test_a_multipart_upload_with_a_changed_file_byte_is_422() -> None:
    u = Uploads()
    async with u.client() as c:
        first = await c.post("/upload", data={"amount": "4500"}, files=_files(), headers=KEY)
        changed = _files(b"%PDF-1.7 \x00\x02 invoice")
        r = await c.post("/upload", data={"amount": "4500"}, files=changed, headers=KEY)
    assert first.status_code == 201
    assert r.status_code == 422
    assert r.json()["type"].endswith("key-reused")
    assert u.runs == 1


async def test_a_reordered_urlencoded_form_is_replayed_and_a_changed_field_is_422() -> None:
    u = Uploads()
    async with u.client() as c:
        first = await c.post("/upload", data={"amount": "4500", "to": "Ada"}, headers=KEY)
        again = await c.post("/upload", data={"to": "Ada", "amount": "4500"}, headers=KEY)
        changed = await c.post("/upload", data={"to": "Ada", "amount": "4501"}, headers=KEY)
    assert first.request.content != again.request.content  # the fields went in another order
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert changed.status_code == 422
    assert u.runs == 1


async def _stamped(u: Uploads, amounts: tuple[int, ...]) -> list[httpx.Response]:
    """Posts each amount under one key, each body stamped afresh as a client's retry would be."""
    async with u.client() as c:
        return [
            await c.post(
                "/events",
                json={"amount": a, "timestamp": uuid.uuid4().hex, "meta": {"request_id": str(i)}},
                headers=KEY,
            )
            for i, a in enumerate(amounts)
        ]


async def test_excluded_json_members_do_not_count_and_the_rest_still_does() -> None:
    policy = Policy(fingerprint_exclude=("/timestamp", "/meta/request_id"))
    u = Uploads(policies={"POST /events": policy})
    first, again, changed = await _stamped(u, (4500, 4500, 4501))
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert changed.status_code == 422  # the amount is still part of the request
    assert u.runs == 1


async def test_without_the_exclusion_a_fresh_timestamp_is_a_different_request() -> None:
    u = Uploads(policies={"POST /events": Policy()})
    first, again = await _stamped(u, (4500, 4500))
    assert first.status_code == 201
    assert again.status_code == 422
    assert u.runs == 1

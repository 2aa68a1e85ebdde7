"""The README's first example, as printed, served by real uvicorn on a fresh directory.

``examples/fastapi_refunds.py`` is the README's first ``python`` block byte for byte; it
runs with no step before it (the SQLite table is created at startup) and answers the
status table under it: 201, a replay marked ``Idempotent-Replayed: true``, 409 for a
duplicate while the first still runs, 422 for the same key with a different body.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from pathlib import Path

import httpx
import pytest

from asgi_idempotency.ops._serve import uvicorn_process

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fastapi_refunds.py"


def first_python_block(markdown: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", markdown, re.S | re.M)
    assert match is not None, "the README has no python block"
    return match.group(1)


def test_the_example_file_is_the_readmes_first_python_block() -> None:
    readme = first_python_block((ROOT / "README.md").read_text(encoding="utf-8"))
    assert EXAMPLE.read_bytes() == readme.encode("utf-8"), (
        "README.md's first python block and examples/fastapi_refunds.py differ: "
        "change them together"
    )


def _in_progress(db: Path) -> bool:
    if not db.exists():
        return False
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            row = conn.execute(
                "SELECT count(*) FROM idempotency_records WHERE status = 'in_progress'"
            ).fetchone()
    except sqlite3.OperationalError:  # no table yet
        return False
    return bool(row[0])


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_readme_example_works_as_pasted(tmp_path: Path) -> None:
    # A fresh directory holding nothing: the example's ./refunds.db is created there.
    # Two workers start together on that one file; neither needs a migrate step.
    args = ("--app-dir", str(EXAMPLE.parent), "--workers", "2")
    with uvicorn_process(
        "fastapi_refunds:app",
        env={},
        log=tmp_path / "uvicorn.log",
        args=args,
        ready_path="/openapi.json",
        cwd=tmp_path,
    ) as server:
        url = "/orders/42/refunds"
        key = {"Idempotency-Key": "refund-order-42", "X-API-Key": "key-acme-1"}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
            first = asyncio.create_task(c.post(url, json={"amount": 4500}, headers=key))
            # Gate on the claim itself: the first request is in its handler once its
            # row is in progress (the handler then takes 1 s).
            for _ in range(200):
                if _in_progress(tmp_path / "refunds.db"):
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("the first request never claimed its key")
            duplicate = await c.post(url, json={"amount": 4500}, headers=key)
            created = await first
            replayed = await c.post(url, json={"amount": 4500}, headers=key)
            mismatch = await c.post(url, json={"amount": 9999}, headers=key)
            missing = await c.post(url, json={"amount": 4500})
            # Another client with the same key gets its own refund, never acme's.
            other = await c.post(
                url, json={"amount": 4500}, headers={**key, "X-API-Key": "key-globex-1"}
            )
            stranger = await c.post(url, json={"amount": 4500}, headers={**key, "X-API-Key": "x"})

    assert created.status_code == 201, created.text
    assert created.json()["order_id"] == 42
    assert "idempotent-replayed" not in created.headers

    assert duplicate.status_code == 409, duplicate.text
    assert duplicate.headers["content-type"] == "application/problem+json"
    assert "retry-after" in duplicate.headers

    assert replayed.status_code == 201
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.content == created.content  # the same refund_id: it ran once

    assert mismatch.status_code == 422
    assert mismatch.json()["type"] == "urn:asgi-idempotency:problem:key-reused"
    assert missing.status_code == 400
    assert other.status_code == 201
    assert "idempotent-replayed" not in other.headers
    assert other.json()["refund_id"] != created.json()["refund_id"]
    assert stranger.status_code == 401  # auth refused it before any claim
    assert (tmp_path / "refunds.db").exists()

"""``upgrade(url)`` and ``downgrade(url)`` called where an event loop already runs.

An async test or an app's startup hook calls them with its loop running; the
migrations drive async engines with ``asyncio.run``, which refuses to start there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import inspect
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from asgi_idempotency.migrations import TABLE, downgrade, upgrade
from tests.conftest import PgServer
from tests.migrations.test_migrations import _inspect

pytestmark = pytest.mark.anyio


def _tables(url: str) -> set[str]:
    return set(_inspect(url, lambda c: inspect(c).get_table_names()))


async def test_upgrade_and_downgrade_inside_a_running_loop(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'in-loop.db'}"
    upgrade(url)
    assert TABLE in _tables(url)
    downgrade(url)
    assert TABLE not in _tables(url)


@pytest.mark.postgres
async def test_upgrade_from_an_apps_startup_on_postgres(pg_server: PgServer) -> None:
    with pg_server.database("idem_in_loop") as url:

        @asynccontextmanager
        async def lifespan(_app: Starlette) -> AsyncIterator[None]:
            upgrade(url)  # as a FastAPI/Starlette startup would
            yield

        async def ok(_request: object) -> PlainTextResponse:
            return PlainTextResponse("ok")

        app = Starlette(routes=[Route("/", ok)], lifespan=lifespan)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                assert (await client.get("/")).text == "ok"
        assert TABLE in _tables(url)

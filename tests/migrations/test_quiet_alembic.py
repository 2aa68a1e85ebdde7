"""Our own migration runs print none of alembic's INFO lines; a schema diff reads as words.

An app that logs at INFO used to print nine alembic lines at each startup (its plugins
when first imported, then "Context impl ..." for the startup check), which alembic's
own CLI never prints. And ``migrate`` on a table that differs from the head printed
alembic's diff as a repr of ``Column(...)`` objects.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table
from sqlalchemy.ext.asyncio import create_async_engine

from asgi_idempotency.migrations import TABLE, upgrade
from asgi_idempotency.ops.cli import Exit, main
from asgi_idempotency.stores.sql import schema
from tests.conftest import PgServer

# An app's startup as a newcomer writes it: logging at INFO, then the store's check.
STARTUP = textwrap.dedent(
    """
    import asyncio, logging, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if len(sys.argv) > 3:
        logging.getLogger("alembic").setLevel(logging.INFO)  # asked for: shown
    from asgi_idempotency.migrations import upgrade
    from asgi_idempotency.stores.sql.store import SQLStore

    async def start(url):
        store = SQLStore(url)
        try:
            await store.prepare()
        finally:
            await store.close()

    if sys.argv[2] == "migrate":
        upgrade(sys.argv[1])
    asyncio.run(start(sys.argv[1]))
    print("level after:", logging.getLogger("alembic").level)
    """
)


def _start(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", STARTUP, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'quiet.db'}"
        return
    server: PgServer = request.getfixturevalue("pg_server")
    with server.database("idem_quiet") as pg:
        yield pg


def test_an_app_logging_at_info_prints_no_alembic_lines(url: str) -> None:
    done = _start(url, "migrate")
    assert done.returncode == 0, done.stderr
    assert "alembic" not in done.stderr, done.stderr
    assert "level after: 0" in done.stdout  # put back: NOTSET, as the app left it


def test_an_app_that_asks_for_alembic_logs_gets_them(url: str) -> None:
    done = _start(url, "migrate", "verbose")
    assert done.returncode == 0, done.stderr
    assert "alembic.runtime.migration: Running upgrade" in done.stderr, done.stderr


def test_the_level_is_put_back_in_process(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    upgrade(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    assert [r for r in caplog.records if r.name.startswith("alembic")] == []
    assert logging.getLogger("alembic").level == logging.NOTSET


@pytest.mark.postgres
def test_migrate_names_what_differs_in_words(
    pg_server: PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # The records table as some hand-made schema has it: a column the head lacks,
    # status too narrow, and without the expiry index.
    changed = MetaData()
    table = Table(
        TABLE,
        changed,
        *(
            Column(c.name, c.type, nullable=c.nullable, primary_key=c.primary_key)
            for c in schema.records.columns
            if c.name != "status"
        ),
        Column("status", String(8), nullable=False),
        Column("note", Integer, nullable=True),
    )
    with pg_server.database("idem_differs") as url:

        async def create() -> None:
            engine = create_async_engine(url)
            try:
                async with engine.begin() as conn:
                    await conn.run_sync(table.metadata.create_all)
            finally:
                await engine.dispose()

        asyncio.run(create())
        code = main(["migrate", "--database-url", url])
    err = capsys.readouterr().err
    assert code == Exit.UNREACHABLE, err
    assert "Column(" not in err
    assert "the table has an extra column idempotency_records.note (INTEGER)" in err
    assert "column idempotency_records.status type is VARCHAR(8), the head has VARCHAR(16)" in err
    assert "the table lacks index ix_idempotency_records_expires_at on (expires_at)" in err

"""Migrations: one head, upgrade from empty, down and up again, no drift from the Table."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Column, MetaData, String, inspect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from asgi_idempotency.migrations import VERSION_TABLE, alembic_config, downgrade, upgrade
from asgi_idempotency.stores.sql import schema
from asgi_idempotency.stores.sql.schema import metadata
from tests.conftest import MariaDBServer, PgServer

T = TypeVar("T")


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ]
)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'migrated.db'}"
        return
    if request.param == "mariadb":
        mariadb: MariaDBServer = request.getfixturevalue("mariadb_server")
        with mariadb.database("idem_mig") as url:
            yield url
        return
    server: PgServer = request.getfixturevalue("pg_server")
    with server.database("idem_mig") as url:
        yield url


def _inspect(url: str, fn: Callable[[Connection], T]) -> T:
    async def go() -> T:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(fn)
        finally:
            await engine.dispose()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, go()).result()


def test_single_head() -> None:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert len(script.get_heads()) == 1


def _drift(url: str, target: MetaData) -> list[Any]:
    """What alembic's autogenerate would change to turn the database at ``url`` into ``target``."""

    def diff(conn: Connection) -> list[Any]:
        ctx = MigrationContext.configure(
            conn, opts={"compare_type": True, "version_table": VERSION_TABLE}
        )
        return list(compare_metadata(ctx, target))

    return list(_inspect(url, diff))


def test_upgrade_from_empty_matches_the_table_definition(empty_url: str) -> None:
    upgrade(empty_url)
    assert _drift(empty_url, metadata) == []
    tables = _inspect(empty_url, lambda c: inspect(c).get_table_names())
    assert {"idempotency_records", VERSION_TABLE} <= set(tables)
    assert "alembic_version" not in tables  # the application's own history is left alone


def test_down_and_up_round_trip(empty_url: str) -> None:
    upgrade(empty_url)
    downgrade(empty_url)
    assert "idempotency_records" not in _inspect(empty_url, lambda c: inspect(c).get_table_names())
    upgrade(empty_url)
    assert "idempotency_records" in _inspect(empty_url, lambda c: inspect(c).get_table_names())


def test_a_table_change_without_a_migration_is_drift(
    empty_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue #12: a revision built from the live Table follows every change to it, so
    # the comparison above could never fail. The revisions must not read schema.py.
    changed = MetaData()
    table = schema.records.to_metadata(changed)
    table.append_column(Column("note", String(32), nullable=True))
    monkeypatch.setattr(schema, "metadata", changed)
    monkeypatch.setattr(schema, "records", table)
    upgrade(empty_url)
    drift = _drift(empty_url, changed)
    assert [(op[0], op[3].name) for op in drift] == [("add_column", "note")]

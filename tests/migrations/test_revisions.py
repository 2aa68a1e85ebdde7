"""Revisions this version does not carry: asked for, or recorded by a newer version.

A newer release that migrated the database stamps a revision this one has never
seen. ``migrate`` must say so in one line (a usage error, not a traceback and exit
70), and the startup check must refuse the database rather than serve on a schema
it cannot vouch for.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from asgi_idempotency.core.errors import SchemaMissing
from asgi_idempotency.migrations import (
    VERSION_TABLE,
    UnknownRevision,
    head,
    known_revisions,
    upgrade,
)
from asgi_idempotency.ops.cli import Exit, main
from asgi_idempotency.stores.sql.store import SQLStore
from tests.conftest import PgServer

NEWER = "9f9f9f9f9f9f"  # a revision no release of this version carries


@pytest.fixture
def newer_pg(pg_server: PgServer) -> Iterator[str]:
    """A Postgres database migrated to this head, then stamped as a newer version would."""
    with pg_server.database("idem_newer") as url:
        upgrade(url)

        async def stamp() -> None:
            engine = create_async_engine(url)
            try:
                async with engine.begin() as conn:
                    stamp = text(f"UPDATE {VERSION_TABLE} SET version_num = :v")
                    await conn.execute(stamp, {"v": NEWER})
            finally:
                await engine.dispose()

        asyncio.run(stamp())
        yield url


@pytest.mark.postgres
def test_migrate_on_a_database_a_newer_version_migrated_is_one_usage_line(
    newer_pg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["migrate", "--database-url", newer_pg])
    err = capsys.readouterr().err
    assert code == Exit.USAGE, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert NEWER in err
    assert f"it knows {', '.join(known_revisions())}" in err
    assert "newer version" in err


def test_upgrade_to_a_revision_this_version_does_not_carry() -> None:
    known = re.escape(", ".join(known_revisions()))
    with pytest.raises(UnknownRevision, match=rf"unknown revision 'nope'.*knows {known}"):
        upgrade("sqlite+aiosqlite://", "nope")


@pytest.mark.postgres
@pytest.mark.anyio
async def test_prepare_refuses_a_database_stamped_by_a_newer_version(newer_pg: str) -> None:
    store = SQLStore(newer_pg)
    try:
        with pytest.raises(SchemaMissing) as caught:
            await store.prepare()
    finally:
        await store.close()
    for said in (str(caught.value), caught.value.detail):
        assert NEWER in said, said
        assert head() in said, said
        assert "newer version" in said
        assert "asgi-idempotency migrate" not in said  # migrating this version cannot fix it

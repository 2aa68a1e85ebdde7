"""Alembic migrations for ``idempotency_records``, shipped in the wheel and run from code.

They keep their own version table (``idempotency_alembic_version``) so they live
beside an application's own alembic history without touching it.

An application's own alembic autogenerate would propose dropping both tables, which
its models do not know; :func:`include_object` is the filter that keeps them out of
its comparison (see the README's Alembic in your project section).

Besides ``upgrade``/``downgrade``, this module answers the store's startup question
"is this database migrated?" (:func:`schema_problem`) and records the head for a
schema built from the ``Table`` itself (:func:`stamp_head`, used by ``create_all``
and the embedded SQLite default's first start).
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import SchemaItem

__all__ = [
    "TABLE",
    "VERSION_TABLE",
    "SchemaConflict",
    "alembic_config",
    "downgrade",
    "head",
    "include_object",
    "schema_problem",
    "stamp_head",
    "upgrade",
]

VERSION_TABLE = "idempotency_alembic_version"
TABLE = "idempotency_records"
SCRIPT_LOCATION = str(Path(__file__).parent)
_OURS = frozenset((TABLE, VERSION_TABLE))


class SchemaConflict(RuntimeError):
    """``upgrade`` found a records table it did not create and that differs from the head."""


def include_object(
    obj: SchemaItem,
    name: str | None,
    type_: str,
    reflected: bool,
    compare_to: SchemaItem | None,
) -> bool:
    """An alembic ``include_object`` filter that leaves this package's tables alone.

    Alembic calls it positionally with the schema object, its name, its kind
    (``"table"``, ``"column"``, ``"index"``, ...), whether it was reflected from the
    database, and what it is compared with. Pass it to
    ``context.configure(include_object=include_object)`` in your project's
    ``env.py``: ``alembic revision --autogenerate`` then no longer proposes dropping
    ``idempotency_records`` (with its index and columns) or ``idempotency_alembic_version``,
    which ``asgi-idempotency migrate`` keeps. Everything else is included, so to
    combine it with a filter of your own, return ``include_object(...) and yours(...)``.
    """
    if type_ == "table":
        return name not in _OURS
    # Columns, indexes and constraints: excluded with the table they belong to.
    table = getattr(obj, "table", None)
    return getattr(table, "name", None) not in _OURS


def alembic_config(url: str) -> Config:
    """An alembic ``Config`` for the database at ``url``.

    Any spelling :func:`asgi_idempotency.urls.async_url` accepts (``postgres://``,
    ``sqlite:///path.db``, ...). The URL travels in ``Config.attributes``, which
    ``env.py`` reads before ``-x url=``, ``$IDEMPOTENCY_DATABASE_URL`` and the ini, so
    code that names a database migrates that one whatever the environment says.
    """
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.attributes["url"] = url
    return cfg


@functools.cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory(SCRIPT_LOCATION)


def head() -> str:
    """The head revision of the migrations this package carries."""
    revision = _scripts().get_current_head()
    assert revision is not None  # the package always carries at least 0001
    return revision


def _context(connection: Connection) -> MigrationContext:
    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})


def schema_problem(connection: Connection) -> str | None:
    """What is missing for the store to serve on this database, or ``None`` if nothing.

    Ready means the records table exists and the version table records this
    package's head (or a revision this package does not know: a newer release
    migrated the database, and revisions only ever add to the schema it needs).
    A sentence without the fix, for the caller's message.
    """
    names = set(inspect(connection).get_table_names())
    if TABLE not in names:
        return f"the {TABLE} table does not exist"
    current = _context(connection).get_current_heads() if VERSION_TABLE in names else ()
    if not current:
        return (
            f"the {TABLE} table exists but {VERSION_TABLE} records no migration "
            f"(expected head {head()})"
        )
    ours = head()
    known = {script.revision for script in _scripts().walk_revisions()}
    if ours in current or any(revision not in known for revision in current):
        return None
    return (
        f"the {TABLE} table is at migration {', '.join(current)}, not at this version's head {ours}"
    )


def stamp_head(connection: Connection) -> None:
    """Record the head in the version table: the schema was just built from the ``Table``.

    Only for a table created from ``stores/schema.py`` in this same transaction,
    which the migrations test keeps equal to what the head creates.
    """
    _context(connection).stamp(_scripts(), "head")


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision``. Blocks; run it outside an event loop.

    A records table that some earlier release's ``create_all`` built without recording
    a revision is adopted first: if it matches the head's schema exactly, the head is
    recorded for it (alembic's ``stamp``); if it does not, :class:`SchemaConflict` says
    what differs rather than the migration failing on "table already exists".
    """
    asyncio.run(_adopt(url))
    command.upgrade(alembic_config(url), revision)


async def _adopt(url: str) -> None:
    from ..stores.schema import metadata
    from ..urls import async_url

    engine = create_async_engine(async_url(url), poolclass=NullPool)

    def adopt(connection: Connection) -> None:
        names = set(inspect(connection).get_table_names())
        context = _context(connection)
        if TABLE not in names or (VERSION_TABLE in names and context.get_current_heads()):
            return
        context = MigrationContext.configure(
            connection,
            opts={
                "version_table": VERSION_TABLE,
                "compare_type": True,
                # Only our table: the application's own tables are none of our business.
                "include_name": lambda name, kind, _parents: kind != "table" or name == TABLE,
            },
        )
        drift = compare_metadata(context, metadata)
        if drift:
            raise SchemaConflict(
                f"the {TABLE} table exists but was not created by these migrations and "
                f"differs from their head {head()}: {drift}; "
                "rename or drop it, then migrate again"
            )
        stamp_head(connection)

    try:
        async with engine.begin() as conn:
            await conn.run_sync(adopt)
    finally:
        await engine.dispose()


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at ``url`` down to ``revision``."""
    command.downgrade(alembic_config(url), revision)

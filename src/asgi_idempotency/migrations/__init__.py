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
import logging
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import inspect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import CreateIndex, CreateTable, SchemaItem

from asgi_idempotency.stores.sql.schema import records

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Alembic logs at INFO as it works: one line per built-in plugin when first imported,
# then "Context impl ...", "Will assume transactional DDL" and "Running upgrade ..."
# for every context, which an app logging at INFO printed at each startup (nine lines
# for one check) while alembic's own CLI prints none. Our runs raise the "alembic"
# logger to WARNING, unless the application set a level on it itself (then it asked
# for them), and put it back when the last concurrent run ends.
_ALEMBIC_LOG = logging.getLogger("alembic")
_quiet_lock = threading.Lock()
_quiet_runs = 0
_quiet_restore: int | None = None  # the level to put back; None: we changed nothing


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    global _quiet_runs, _quiet_restore
    with _quiet_lock:
        if _quiet_runs == 0 and _ALEMBIC_LOG.level == logging.NOTSET:
            _quiet_restore = _ALEMBIC_LOG.level
            _ALEMBIC_LOG.setLevel(logging.WARNING)
        _quiet_runs += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_runs -= 1
            if _quiet_runs == 0 and _quiet_restore is not None:
                _ALEMBIC_LOG.setLevel(_quiet_restore)
                _quiet_restore = None


def _quiet(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    @functools.wraps(fn)
    def quietly(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        with _quiet_alembic():
            return fn(*args, **kwargs)

    return quietly


# Importing alembic sets up its plugins, logging each (see above). Imported here, not
# at the top, so that the import is quiet too.
with _quiet_alembic():
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.script.revision import RevisionError

__all__ = [
    "create_tables",
    "TABLE",
    "VERSION_TABLE",
    "SchemaConflict",
    "UnknownRevision",
    "alembic_config",
    "describe_diff",
    "downgrade",
    "head",
    "include_object",
    "known_revisions",
    "schema_problem",
    "stamp_head",
    "unknown_revisions",
    "upgrade",
]

VERSION_TABLE = "idempotency_alembic_version"
TABLE = "idempotency_records"
SCRIPT_LOCATION = str(Path(__file__).parent)
_OURS = frozenset((TABLE, VERSION_TABLE))


class SchemaConflict(RuntimeError):
    """``upgrade`` found a records table it did not create and that differs from the head."""


class UnknownRevision(ValueError):
    """A revision this version does not carry: asked for, or recorded in the database.

    A recorded one means a newer release migrated the database; alembic itself would
    stop with "Can't locate revision" deep inside ``env.py``. The message names the
    revision and the ones this version knows.
    """


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

    Any spelling :func:`asgi_idempotency.stores.urls.async_url` accepts (``postgres://``,
    ``sqlite:///path.db``, ...). The URL travels in ``Config.attributes``, which
    ``env.py`` reads before ``-x url=``, ``$IDEMPOTENCY_DATABASE_URL`` and the ini, so
    code that names a database migrates that one whatever the environment says.
    """
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.attributes["url"] = url
    return cfg


@functools.cache
@functools.cache
def _scripts() -> ScriptDirectory:
    # Read once per process: the package's migrations do not change while it runs, and
    # parsing them is the slow part of stamping a fresh database.
    return ScriptDirectory(SCRIPT_LOCATION)


def warm() -> None:
    """Load the migration scripts now (a SQLite store does before it takes the write lock)."""
    _scripts().get_current_head()


def head() -> str:
    """The head revision of the migrations this package carries."""
    revision = _scripts().get_current_head()
    assert revision is not None  # the package always carries at least 0001
    return revision


def known_revisions() -> tuple[str, ...]:
    """The revisions this package carries, oldest first."""
    return tuple(reversed([script.revision for script in _scripts().walk_revisions()]))


def _known() -> str:
    return ", ".join(known_revisions())


def _context(connection: Connection) -> MigrationContext:
    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})


@_quiet
def schema_problem(connection: Connection) -> str | None:
    """What is missing for the store to serve on this database, or ``None`` if nothing.

    Ready means the records table exists and the version table records this
    package's head. A revision this package does not know (a newer release migrated
    the database) is a problem too: this version cannot tell what that schema needs
    from it, so :func:`unknown_revisions` lets the caller say so. A sentence without
    the fix, for the caller's message.
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
    newer = [revision for revision in current if revision not in known_revisions()]
    if newer:
        return (
            f"{VERSION_TABLE} records revision {', '.join(newer)}, which this version of "
            f"asgi-idempotency does not know (its head is {ours}): a newer version migrated "
            "this database"
        )
    if ours in current:
        return None
    return (
        f"the {TABLE} table is at migration {', '.join(current)}, not at this version's head {ours}"
    )


@_quiet
def unknown_revisions(connection: Connection) -> tuple[str, ...]:
    """The revisions the database records that this package does not carry (a newer one's)."""
    if VERSION_TABLE not in inspect(connection).get_table_names():
        return ()
    known = known_revisions()
    return tuple(r for r in _context(connection).get_current_heads() if r not in known)


def describe_diff(diff: list[Any]) -> str:
    """Alembic's autogenerate diff (turning the database into the head) in words.

    ``compare_metadata`` returns tuples of SQLAlchemy objects whose repr is a wall of
    ``Column(...)`` arguments; an operator needs which column or index differs, how.
    """
    return "; ".join(_describe(entry) for entry in diff)


_NAMES = {"table": "table", "index": "index", "constraint": "constraint", "fk": "foreign key"}


def _describe(entry: Any) -> str:
    if isinstance(entry, list):  # one column's modify_* changes, grouped by alembic
        return "; ".join(_describe(change) for change in entry)
    op = entry[0]
    verb, _, kind = op.partition("_")
    if kind == "column":
        _schema, table, column = entry[1:4]
        where = f"column {table}.{column.name} ({column.type})"
        return f"the table lacks {where}" if verb == "add" else f"the table has an extra {where}"
    if kind in _NAMES:
        obj = entry[1]
        name = getattr(obj, "name", None) or "(unnamed)"
        columns = ", ".join(c.name for c in getattr(obj, "columns", ()))
        what = f"{_NAMES[kind]} {name}" + (f" on ({columns})" if columns else "")
        return f"the table lacks {what}" if verb == "add" else f"the table has an extra {what}"
    if verb == "modify":
        _schema, table, column, _existing, in_db, in_head = entry[1:7]
        if kind == "nullable":
            in_db = "NULL" if in_db else "NOT NULL"
            in_head = "NULL" if in_head else "NOT NULL"
        return f"column {table}.{column} {kind} is {in_db}, the head has {in_head}"
    return repr(entry)  # a kind alembic added later: still shown, if raw


@_quiet
def stamp_head(connection: Connection) -> None:
    """Record the head in the version table: the schema was just built from the ``Table``.

    Only for a table created from ``stores/schema.py`` in this same transaction,
    which the migrations test keeps equal to what the head creates.
    """
    _context(connection).stamp(_scripts(), "head")


@_quiet
def upgrade_behind(connection: Connection) -> bool:
    """Upgrade, on ``connection``, a schema recorded at an older revision this package
    carries to the head; whether it did.

    For the embedded SQLite default, whose file the app keeps itself: a file made by an
    earlier version then gains what this version writes with every claim, at its first
    start, as a fresh file would have it. Runs inside the caller's transaction (SQLite's
    write lock). Anything else (no revision recorded, an unknown one) is left as it is,
    for :func:`schema_problem` and ``migrate`` to report.
    """
    from alembic.config import Config
    from alembic.runtime.environment import EnvironmentContext

    from asgi_idempotency.stores.sql.schema import metadata

    current = _context(connection).get_current_heads()
    ours = head()
    if not current or ours in current or not set(current) <= set(known_revisions()):
        return False
    scripts = _scripts()

    def steps(revision: Any, _context: Any) -> Any:
        return scripts._upgrade_revs(ours, revision)

    with EnvironmentContext(Config(), scripts, fn=steps, destination_rev=ours) as env:
        env.configure(
            connection=connection,
            target_metadata=metadata,
            version_table=VERSION_TABLE,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        env.run_migrations()
    return True


def _off_the_loop(run: Callable[[], None]) -> None:
    """``run()`` here, or on a thread of its own when this thread runs an event loop.

    The migrations drive their async engines with ``asyncio.run`` (here and in
    ``env.py``), which refuses to start inside a running loop: called from an async
    test or a FastAPI startup hook, ``upgrade`` would fail. On a worker thread there
    is no running loop; the caller's loop waits meanwhile, as for any blocking call.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        run()
        return
    with ThreadPoolExecutor(1, thread_name_prefix="asgi-idempotency-migrate") as pool:
        pool.submit(run).result()


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision``.

    Blocks until done. Works inside a running event loop too (an async test, a
    FastAPI startup hook): alembic then runs on a worker thread while the loop waits.

    A records table that some earlier release's ``create_all`` built without recording
    a revision is adopted first: if it matches the head's schema exactly, the head is
    recorded for it (alembic's ``stamp``); if it does not, :class:`SchemaConflict` says
    what differs rather than the migration failing on "table already exists".

    Raises:
        UnknownRevision: ``revision``, or the revision the database records, is not
            one this version carries (the database was migrated by a newer version).
        SchemaConflict: as above.
    """
    _check_target(revision)

    @_quiet
    def run() -> None:
        asyncio.run(_adopt(url))
        command.upgrade(alembic_config(url), revision)

    _off_the_loop(run)


def _check_target(revision: str) -> None:
    # Alembic's relative steps ("+1", "0001+1") count from a revision; check that one.
    anchor = re.sub(r"[+-]\d+$", "", revision)
    if not anchor:
        return
    try:
        _scripts().revision_map.get_revisions(anchor)
    except RevisionError:
        raise UnknownRevision(
            f"unknown revision {revision!r}: this version of asgi-idempotency knows "
            f"{_known()} (head {head()})"
        ) from None


async def _adopt(url: str) -> None:
    from asgi_idempotency.stores.sql.schema import metadata
    from asgi_idempotency.stores.urls import async_url

    engine = create_async_engine(async_url(url), poolclass=NullPool)

    def adopt(connection: Connection) -> None:
        newer = unknown_revisions(connection)
        if newer:
            raise UnknownRevision(
                f"the database is at revision {', '.join(newer)}, which this version of "
                f"asgi-idempotency does not know (it knows {_known()}): a newer version "
                "migrated it: upgrade asgi-idempotency (to downgrade the database, use the "
                "version that migrated it)"
            )
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
                f"differs from their head {head()}: {describe_diff(drift)}; "
                "rename or drop it, then migrate again"
            )
        stamp_head(connection)

    try:
        async with engine.begin() as conn:
            await conn.run_sync(adopt)
    finally:
        await engine.dispose()


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at ``url`` down to ``revision``; inside an event loop too.

    Raises:
        UnknownRevision: ``revision`` is not one this version carries.
    """
    _check_target(revision)
    _off_the_loop(_quiet(lambda: command.downgrade(alembic_config(url), revision)))


def create_tables(conn: Connection) -> None:
    """The table and its indexes from the one ``Table``; the migrations' head, if created now.

    A table that exists and records an older revision this package carries is upgraded
    to the head first (the embedded SQLite default has no operator to run ``migrate``).

    Each backend runs it under its own guard against a second process doing the same
    (:attr:`asgi_idempotency.stores.sql.dialect.SQLDialect.create_schema`).
    """
    created = not inspect(conn).has_table(records.name)
    conn.execute(CreateTable(records, if_not_exists=True))
    if not created:
        # A table an earlier version made (an embedded SQLite file, above all): brought
        # to the head when it records an older revision.
        upgrade_behind(conn)
    columns = {column["name"] for column in inspect(conn).get_columns(records.name)}
    # In the order the migrations create them (a set has none), so that a table built
    # here reads the same as a migrated one (SHOW CREATE TABLE lists keys in order).
    # An index on columns an unmigrated table lacks is left to `migrate`.
    for index in sorted(records.indexes, key=lambda index: str(index.name)):
        if {column.name for column in index.columns} <= columns:
            conn.execute(CreateIndex(index, if_not_exists=True))
    if created:
        stamp_head(conn)

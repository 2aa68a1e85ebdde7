"""An application's own alembic project beside our table: its autogenerate leaves ours alone.

A scratch project in ``tmp_path`` (its own model, its own ``env.py``: the README's, as
printed) on a Postgres database of its own, into which ``asgi-idempotency migrate``
has put our table. Its ``alembic revision --autogenerate`` must propose only the
change to its own model, and, without our filter, does propose dropping our tables.
"""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import alembic
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import Column, Engine, Index, Integer, MetaData, String, Table, create_engine

from asgi_idempotency.migrations import TABLE, VERSION_TABLE, include_object
from asgi_idempotency.ops.cli import main as cli_main
from tests.conftest import PgServer
from tests.project.docs_text import docs_text

pytestmark = pytest.mark.postgres


# The application's model as the scratch project declares it: `note` is new, so the
# database (built from the model without it) lags by exactly one column.
MODELS = textwrap.dedent(
    """
    from sqlalchemy import Index, Integer, String
    from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


    class Base(DeclarativeBase):
        pass


    class Order(Base):
        __tablename__ = "orders"
        __table_args__ = (Index("ix_orders_customer", "customer"),)

        id: Mapped[int] = mapped_column(Integer, primary_key=True)
        customer: Mapped[str] = mapped_column(String(64))
        note: Mapped[str | None] = mapped_column(String(200))
    """
)


def _deployed_orders(metadata: MetaData) -> Table:
    """The application's table as its last deploy created it: before ``note``."""
    return Table(
        "orders",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("customer", String(64), nullable=False),
        Index("ix_orders_customer", "customer"),
    )


def readme_env_py() -> str:
    """The ``env.py`` the README prints under "Alembic in your project"."""
    text = docs_text()
    section = text.split("\n### Alembic in your project\n", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "the README's recipe has no python block"
    return found.group(1)


@pytest.fixture
def database(pg_server: PgServer) -> Iterator[Engine]:
    """A database of its own with the application's table and ours, migrated by our CLI."""
    with pg_server.database("idem_app") as url:
        assert cli_main(["migrate", "--database-url", url]) == 0
        engine = create_engine(url.replace("+asyncpg", "+psycopg"))
        try:
            deployed = MetaData()
            _deployed_orders(deployed)
            deployed.create_all(engine)
            yield engine
        finally:
            engine.dispose()


@pytest.fixture
def project(tmp_path: Path, database: Engine) -> Iterator[Config]:
    """A scratch alembic project: ``myapp.models``, the README's ``env.py``, no revisions yet."""
    app = tmp_path / "myapp"
    app.mkdir()
    (app / "__init__.py").write_text("")
    (app / "models.py").write_text(MODELS)
    scripts = tmp_path / "migrations"
    (scripts / "versions").mkdir(parents=True)
    (scripts / "env.py").write_text(readme_env_py())
    template = Path(alembic.__file__).parent / "templates" / "generic" / "script.py.mako"
    shutil.copy(template, scripts / "script.py.mako")
    cfg = Config()
    cfg.set_main_option("script_location", str(scripts))
    url = database.url.render_as_string(hide_password=False)
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    sys.path.insert(0, str(tmp_path))
    try:
        yield cfg
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "myapp" or m.startswith("myapp.")]:
            del sys.modules[name]


def _autogenerate(cfg: Config) -> list[str]:
    """``alembic revision --autogenerate``; the operations its new revision's upgrade() has."""
    made = command.revision(cfg, message="check", autogenerate=True)
    assert made is not None
    assert not isinstance(made, list)  # one script directory, one head: one revision
    source = Path(made.path).read_text()
    upgrade = source.split("def upgrade()", 1)[1].split("def downgrade()", 1)[0]
    return re.findall(r"op\.\w+\([^\n]*", upgrade)


def test_the_readme_env_py_autogenerates_only_the_applications_own_change(
    project: Config,
) -> None:
    ops = _autogenerate(project)
    assert len(ops) == 1
    assert ops[0].startswith("op.add_column('orders', sa.Column('note'")


def test_without_the_filter_autogenerate_proposes_dropping_our_tables(project: Config) -> None:
    # The same project with the one line left out: what the filter is there for, and
    # proof that the test above can fail.
    env = Path(project.get_main_option("script_location") or "") / "env.py"
    source = env.read_text()
    line = "        include_object=include_object,"
    assert line in source
    env.write_text(source.replace(line, "        # " + line.strip()))
    ops = _autogenerate(project)
    assert f"op.drop_table('{TABLE}')" in ops
    assert f"op.drop_table('{VERSION_TABLE}')" in ops
    assert any(op.startswith("op.add_column('orders'") for op in ops)


def _diff(engine: Engine, target: MetaData, **opts: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(compare_metadata(MigrationContext.configure(conn, opts=opts), target))


def test_compare_metadata_with_the_filter_sees_nothing_of_ours(database: Engine) -> None:
    models = MetaData()
    _deployed_orders(models)
    assert _diff(database, models, include_object=include_object) == []
    unfiltered = {(d[0], d[1].name) for d in _diff(database, models) if d[0] == "remove_table"}
    assert unfiltered == {("remove_table", TABLE), ("remove_table", VERSION_TABLE)}


def test_the_filter_still_compares_what_the_application_has_named_like_ours(
    database: Engine,
) -> None:
    # Only our two tables are left out: an application table, a column or an index of
    # the application's that the database lacks is still proposed.
    models = MetaData()
    orders = _deployed_orders(models)
    orders.append_column(Column("records_ref", String(64)))
    Table("idempotency_records_archive", models, Column("key", String(64), primary_key=True))
    diff = _diff(database, models, include_object=include_object)
    assert sorted((d[0], d[-1].name) for d in diff) == [
        ("add_column", "records_ref"),
        ("add_table", "idempotency_records_archive"),
    ]

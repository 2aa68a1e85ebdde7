"""The documented alembic recipe migrates the database it is given, and nothing else.

``alembic -c migrations/alembic.ini -x url=URL upgrade head`` (see migrations/README.md),
then ``$IDEMPOTENCY_DATABASE_URL``, then the ini's ``sqlalchemy.url``, each through
the one URL rule; ``asgi_idempotency.migrations.upgrade(url)`` always uses its ``url``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect

from asgi_idempotency.migrations import upgrade
from asgi_idempotency.stores.urls import ENV_URL
from tests.conftest import PgServer
from tests.migrations.test_migrations import _inspect

INI = Path(__file__).parents[2] / "migrations" / "alembic.ini"


def alembic(cwd: Path, *argv: str, env_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    if env_url is not None:
        env[ENV_URL] = env_url
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(INI), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def tables(url: str) -> set[str]:
    return set(_inspect(url, lambda c: inspect(c).get_table_names()))


def test_x_url_migrates_that_sqlite_file_and_creates_no_other(tmp_path: Path) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    target = tmp_path / "a.db"
    done = alembic(work, "-x", f"url=sqlite:///{target}", "upgrade", "head")
    assert done.returncode == 0, done.stderr
    assert "idempotency_records" in tables(f"sqlite+aiosqlite:///{target}")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.db", "cwd"]


@pytest.mark.postgres
def test_x_url_migrates_that_postgres_database(pg_server: PgServer, tmp_path: Path) -> None:
    with pg_server.database("idem_alembic") as url:
        plain = "postgresql://" + url.split("://", 1)[1]  # the async driver is added
        done = alembic(tmp_path, "-x", f"url={plain}", "upgrade", "head")
        assert done.returncode == 0, done.stderr
        assert "idempotency_records" in tables(url)
    assert list(tmp_path.iterdir()) == []


def test_the_environment_variable_then_x_url_wins(tmp_path: Path) -> None:
    from_env, from_x = tmp_path / "env.db", tmp_path / "x.db"
    done = alembic(tmp_path, "upgrade", "head", env_url=f"sqlite:///{from_env}")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.db"]
    done = alembic(
        tmp_path, "-x", f"url=sqlite:///{from_x}", "upgrade", "head", env_url="sqlite:///other.db"
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.db", "x.db"]
    assert "idempotency_records" in tables(f"sqlite+aiosqlite:///{from_x}")


def test_no_url_anywhere_is_an_error_and_creates_nothing(tmp_path: Path) -> None:
    done = alembic(tmp_path, "upgrade", "head")
    said = done.stdout + done.stderr  # alembic prints "FAILED: ..." on stdout
    assert done.returncode != 0
    assert "-x url=" in said
    assert ENV_URL in said
    assert "Traceback" not in said
    assert list(tmp_path.iterdir()) == []


def test_a_refused_url_names_the_accepted_spellings(tmp_path: Path) -> None:
    done = alembic(tmp_path, "-x", "url=postgresql+psycopg2://u:hunter2@h/db", "upgrade", "head")
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert "postgresql+asyncpg://" in said
    assert "hunter2" not in said
    assert "Traceback" not in said


def test_upgrade_from_code_uses_its_url_not_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_URL, f"sqlite:///{tmp_path / 'env.db'}")
    upgrade(f"sqlite:///{tmp_path / 'code.db'}")  # the rule applies here too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code.db"]

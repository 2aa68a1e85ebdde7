"""The one database-URL rule, and that the CLI and ``SQLStore`` both follow it."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from asgi_idempotency.core import lifecycle
from asgi_idempotency.ops import cli
from asgi_idempotency.stores.sql.store import SQLStore
from asgi_idempotency.stores.urls import ENV_URL, async_url, redact, sqlite_path

SPELLINGS = [
    ("sqlite:///x.db", "sqlite+aiosqlite:///x.db"),
    ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite:///x.db"),
    ("sqlite://", "sqlite+aiosqlite://"),
    ("postgresql://u:pw@h:5433/db", "postgresql+asyncpg://u:pw@h:5433/db"),
    ("postgres://u@h/db?ssl=require", "postgresql+asyncpg://u@h/db?ssl=require"),
    ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("postgres+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("mariadb://u:pw@h:3306/db", "mariadb+asyncmy://u:pw@h:3306/db"),
    ("mariadb+asyncmy://u@h/db", "mariadb+asyncmy://u@h/db"),
    ("mysql://u@h/db?charset=utf8mb4", "mysql+asyncmy://u@h/db?charset=utf8mb4"),
    ("mysql+asyncmy://u@h/db", "mysql+asyncmy://u@h/db"),
]


@pytest.mark.parametrize(("given", "used"), SPELLINGS)
def test_every_spelling_gets_its_async_driver(given: str, used: str) -> None:
    assert async_url(given) == used
    assert async_url(used) == used  # idempotent


def test_passwords_survive_the_rule_with_their_escapes() -> None:
    url = async_url("postgres://app:p%40ss%3Aw%2Frd@db/app")
    assert make_url(url).password == "p@ss:w/rd"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql+psycopg2://u:hunter2@h/db", "needs the async driver asyncpg, not psycopg2"),
        ("postgresql+psycopg://u:hunter2@h/db", "not psycopg"),
        ("sqlite+pysqlite:///x.db", "needs the async driver aiosqlite, not pysqlite"),
        ("mysql+aiomysql://u:hunter2@h/db", "needs the async driver asyncmy, not aiomysql"),
        ("mariadb+mariadbconnector://u:hunter2@h/db", "not mariadbconnector"),
        ("oracle://u:hunter2@h/db", "unsupported database URL scheme 'oracle'"),
        ("not a url", "malformed database URL"),
        ("postgresql://u:hunter2@h:port/db", "malformed database URL"),
    ],
)
def test_anything_else_is_refused_naming_the_accepted_spellings(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        async_url(url)
    text = str(caught.value)
    assert "postgresql+asyncpg://" in text
    assert "sqlite:///path.db" in text
    assert "mariadb+asyncmy://" in text
    assert "hunter2" not in text


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+asyncpg://u:hunter2@h/db", "postgresql+asyncpg://u:***@h/db"),
        ("postgresql://u@h/db?password=hunter2", "postgresql://u@h/db?password=***"),
        ("postgresql://u:hunter2@h:port/db", "<malformed database URL>"),
        ("sqlite:///x.db", "sqlite:///x.db"),
    ],
)
def test_redact_never_shows_a_password(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_sqlite_path() -> None:
    assert sqlite_path("sqlite:///rel/x.db") == "rel/x.db"
    assert sqlite_path("sqlite+aiosqlite:////abs/x.db") == "/abs/x.db"
    assert sqlite_path("sqlite://") is None
    assert sqlite_path("sqlite:///:memory:") is None
    assert sqlite_path("sqlite:///file:x.db?mode=ro&uri=true") is None
    assert sqlite_path("postgresql://u@h/db") is None


def test_the_cli_uses_the_same_rule_and_variable() -> None:
    assert cli.normalize_url is async_url
    assert cli.ENV_URL == ENV_URL == "IDEMPOTENCY_DATABASE_URL"


# --- SQLStore -----------------------------------------------------------------


async def _claim_once(store: SQLStore) -> None:
    now = datetime.now(UTC)
    claim = await lifecycle.claim(
        store,
        uuid.uuid4().hex,
        "ab" * 32,
        uuid.uuid4().hex,
        now=now,
        lease=timedelta(seconds=30),
        ttl=timedelta(hours=1),
    )
    assert claim.owned


@pytest.mark.anyio
@pytest.mark.parametrize("scheme", ["sqlite", "sqlite+aiosqlite"])
async def test_sql_store_takes_every_sqlite_spelling(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"{scheme}:///x.db"
    store = SQLStore(url)
    try:
        assert store.engine.url.render_as_string(hide_password=False) == cli.normalize_url(url)
        await store.create_all()
        await _claim_once(store)
    finally:
        await store.close()
    assert (tmp_path / "x.db").exists()


@pytest.mark.anyio
@pytest.mark.postgres
@pytest.mark.parametrize("scheme", ["postgres", "postgresql", "postgresql+asyncpg"])
async def test_sql_store_takes_every_postgres_spelling(scheme: str, pg_url: str) -> None:
    url = scheme + "://" + pg_url.split("://", 1)[1]
    store = SQLStore(url)
    try:
        assert store.engine.url.render_as_string(hide_password=False) == cli.normalize_url(url)
        await _claim_once(store)
    finally:
        await store.close()


def test_sql_store_refuses_a_sync_driver() -> None:
    with pytest.raises(ValueError, match="needs the async driver asyncpg, not psycopg2"):
        SQLStore("postgresql+psycopg2://postgres@127.0.0.1/test")


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("postgres://u@h/db?sslmode=require", "postgresql+asyncpg://u@h/db?ssl=require"),
        ("postgresql://u@h/db?sslmode=verify-full", "postgresql+asyncpg://u@h/db?ssl=verify-full"),
        (
            "postgres://u@h/db?sslmode=disable&ssl=disable",
            "postgresql+asyncpg://u@h/db?ssl=disable",
        ),
    ],
)
def test_libpq_sslmode_becomes_asyncpg_ssl(given: str, used: str) -> None:
    assert async_url(given) == used


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgres://u@h/db?sslmode=sometimes", "unsupported sslmode 'sometimes'"),
        ("postgres://u@h/db?sslmode=require&ssl=disable", "both sslmode and ssl"),
    ],
)
def test_a_bad_sslmode_is_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        async_url(url)


@pytest.mark.anyio
@pytest.mark.postgres
async def test_a_hosting_provider_url_with_sslmode_connects(pg_url: str) -> None:
    # asyncpg itself refuses sslmode ("unexpected keyword argument"); the rule renames it.
    store = SQLStore(pg_url.replace("postgresql+asyncpg://", "postgres://") + "?sslmode=prefer")
    try:
        await _claim_once(store)
    finally:
        await store.close()

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


# --- Several hosts: a primary and its standbys -----------------------------------

MULTI_HOST = [
    # libpq's form, as HA guides and cloud consoles write it: ports, or 5432 where none.
    (
        "postgresql+asyncpg://app@h1:5432,h2:5433/db?target_session_attrs=read-write",
        "postgresql+asyncpg://app@/db?host=h1,h2&port=5432,5433&target_session_attrs=read-write",
    ),
    ("postgres://app@h1,h2/db", "postgresql+asyncpg://app@/db?host=h1,h2&port=5432,5432"),
    ("postgresql://h1:5433,h2", "postgresql+asyncpg://?host=h1,h2&port=5433,5432"),
    ("postgresql://app@[::1]:5433,h2/db", "postgresql+asyncpg://app@/db?host=::1,h2&port=5433,5432"),
    # SQLAlchemy's own spellings become the same one.
    (
        "postgresql+asyncpg://app@/db?host=h1:5432&host=h2:5433&target_session_attrs=read-write",
        "postgresql+asyncpg://app@/db?host=h1,h2&port=5432,5433&target_session_attrs=read-write",
    ),
    ("postgresql+asyncpg://app@/db?host=h1&host=h2", "postgresql+asyncpg://app@/db?host=h1,h2&port=5432,5432"),
    ("postgresql://app@/db?host=h1,h2&port=5433,5434", "postgresql+asyncpg://app@/db?host=h1,h2&port=5433,5434"),
]  # fmt: skip


@pytest.mark.parametrize(("given", "used"), MULTI_HOST)
def test_multi_host_urls_become_the_lists_asyncpg_takes(given: str, used: str) -> None:
    from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg

    url = async_url(given)
    assert redact(url) == used  # shown with its separators unescaped, every host
    assert async_url(url) == url  # idempotent
    dialect = PGDialect_asyncpg()  # type: ignore[no-untyped-call]  # SQLAlchemy leaves it unannotated
    _, options = dialect.create_connect_args(make_url(url))  # type: ignore[no-untyped-call]  # as above
    hosts, ports = used.split("host=")[1].split("&")[:2]
    assert options["host"] == hosts.split(",")
    assert options["port"] == [int(p) for p in ports.removeprefix("port=").split(",")]


def test_a_multi_host_url_keeps_its_password_and_never_shows_it() -> None:
    url = async_url("postgresql://app:p%40ss@h1:5432,h2:5432/db")
    assert make_url(url).password == "p@ss"
    assert redact(url) == "postgresql+asyncpg://app:***@/db?host=h1,h2&port=5432,5432"
    # As written, too (a message about the URL the user gave): every host, no password.
    assert redact("postgresql://app:hunter2@h1:5432,h2/db?password=hunter2") == (
        "postgresql://app:***@h1:5432,h2/db?password=***"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://u:hunter2@h1,,h2/db", "malformed host ''"),
        ("postgresql://u:hunter2@h1:port,h2/db", "malformed host 'h1:port'"),
        ("postgresql://u:hunter2@h1:70000,h2/db", "malformed host 'h1:70000'"),
        ("postgresql://u:hunter2@h1,h2/db?host=h3", "hosts both before the path and as ?host="),
        ("postgresql://u:hunter2@/db?host=h1,h2&port=1", "lists differ in length"),
        ("mariadb://u:hunter2@h1,h2/db", "mariadb:// takes one host"),
    ],
)
def test_a_malformed_host_list_is_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        async_url(url)
    assert "hunter2" not in str(caught.value)
    assert "postgresql+asyncpg://" in str(caught.value)  # the accepted spellings


def _multi_host(pg_url: str, form: str, live: str | None = None) -> str:
    """``pg_url`` behind a first host that refuses connections (a dead primary)."""
    u = make_url(pg_url)
    dead, live = "127.0.0.1:1", live or f"{u.host}:{u.port or 5432}"
    if form == "libpq":
        url = f"postgresql://{u.username}@{dead},{live}/{u.database}?"
    else:
        url = f"postgresql+asyncpg://{u.username}@/{u.database}?host={dead}&host={live}&"
    return url + "target_session_attrs=read-write"


@pytest.mark.anyio
@pytest.mark.postgres
@pytest.mark.parametrize("form", ["libpq", "sqlalchemy"])
async def test_sql_store_takes_a_multi_host_url(form: str, pg_url: str) -> None:
    # asyncpg tries the hosts in order; read-write takes the one that accepts writes.
    store = SQLStore(_multi_host(pg_url, form))
    try:
        await _claim_once(store)
    finally:
        await store.close()


@pytest.mark.postgres
@pytest.mark.parametrize("form", ["libpq", "sqlalchemy"])
def test_the_cli_takes_a_multi_host_url(
    form: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["stats", "--database-url", _multi_host(pg_url, form)]) == 0
    assert cli.main(["stats", "--database-url", _multi_host(pg_url, form, "127.0.0.1:2")]) != 0
    err = capsys.readouterr().err
    assert "host=127.0.0.1,127.0.0.1&port=1,2&" in err, err  # every host in the message

"""What a newcomer trips on with the command line: URL hints, SQLite URL forms, ``--version``.

Synchronous, like ``test_cli``: the CLI runs its own event loop.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

import asgi_idempotency
from asgi_idempotency.core.lifecycle import claim
from asgi_idempotency.ops.cli import Exit, main
from asgi_idempotency.ops.demo import SCRATCH_PREFIX
from asgi_idempotency.stores import registry, urls
from asgi_idempotency.stores.memory import MemoryStore
from asgi_idempotency.stores.registry import StoreKind, kinds, register
from asgi_idempotency.stores.sql.store import SQLStore
from asgi_idempotency.stores.urls import ACCEPTED, REDIS_SCHEMES, async_url
from tests.conftest import PgServer, backdate


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _schemes(text: str) -> set[str]:
    return {m.lower() for m in re.findall(r"\b([a-z][a-z0-9+]*)://", text)}


# --- one list of URL spellings, Redis included --------------------------------------

EVERY_SCHEME = {
    "postgresql",
    "postgres",
    "postgresql+asyncpg",
    "sqlite",
    "sqlite+aiosqlite",
    "mariadb+asyncmy",
    "mysql+asyncmy",
} | set(REDIS_SCHEMES)


def test_the_one_list_names_every_scheme_the_package_takes() -> None:
    # The registry's list: ours, and those of any kind registered meanwhile (an
    # example's DictStore, imported by another test in this process).
    registered = {scheme for kind in kinds() for scheme in kind.schemes}
    assert EVERY_SCHEME <= _schemes(ACCEPTED) <= EVERY_SCHEME | registered


def test_the_list_is_the_registrys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "KINDS", list(registry.KINDS))
    register(StoreKind("mine", ("mine",), MemoryStore))
    assert "mine://" in urls.ACCEPTED
    with pytest.raises(ValueError, match="mine://"):
        async_url("oracle://h/db")


def _hint_from_sql_store() -> str:
    with pytest.raises(ValueError, match="unsupported") as caught:
        SQLStore("mysql+aiomysql://u@h/db")
    return str(caught.value)


def _hint_from_redis_store() -> str:
    from asgi_idempotency.stores.redis import RedisStore  # redis is in the dev extra

    with pytest.raises(ValueError, match="unsupported") as caught:
        RedisStore("memcached://h:1")
    return str(caught.value)


def _hint_from_async_url(url: str) -> str:
    with pytest.raises(ValueError, match="malformed") as caught:
        async_url(url)
    return str(caught.value)


def test_every_url_hint_lists_the_same_schemes(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, cli_error = run(capsys, "stats", "--database-url", "mysql+aiomysql://u@h/db")
    assert code == Exit.USAGE
    _, help_text, _ = run(capsys, "--help")
    hints = {
        "cli error": cli_error,
        "cli --help": " ".join(help_text.split()),
        "SQLStore": _hint_from_sql_store(),
        "RedisStore": _hint_from_redis_store(),
        "malformed": _hint_from_async_url("not a url"),
    }
    for where, hint in hints.items():
        assert _schemes(hint) >= EVERY_SCHEME, (where, hint)


# --- SQLite URLs with two slashes ---------------------------------------------------


@pytest.mark.parametrize(
    ("url", "meant"),
    [
        ("sqlite://./x", "sqlite+aiosqlite:///./x"),
        ("sqlite://x.db", "sqlite+aiosqlite:///x.db"),
        ("sqlite+aiosqlite://./data/x.db", "sqlite+aiosqlite:///./data/x.db"),
        ("sqlite://u:hunter2@localhost/x.db", "sqlite+aiosqlite:///localhost/x.db"),
    ],
)
def test_a_sqlite_url_with_a_host_is_refused_with_the_right_form(
    url: str, meant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="malformed SQLite URL") as caught:
        SQLStore(url)
    for command in (["stats"], ["migrate"], ["prune"]):
        code, _, err = run(capsys, *command, "--database-url", url)
        assert code == Exit.USAGE, err
        assert meant in err
        assert "sqlite+aiosqlite:///./x.db" in err
        assert "hunter2" not in err
    assert meant in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # nothing created under any name


def test_the_documented_sqlite_spellings_still_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert async_url("sqlite:///x.db") == "sqlite+aiosqlite:///x.db"
    assert async_url("sqlite://") == "sqlite+aiosqlite://"
    assert run(capsys, "migrate", "--database-url", "sqlite+aiosqlite:///./x.db")[0] == Exit.OK
    assert (tmp_path / "x.db").exists()


# --- --version ------------------------------------------------------------------------


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--version")
    assert (code, err) == (Exit.OK, "")
    assert out.strip() == f"asgi-idempotency {asgi_idempotency.__version__}"
    assert asgi_idempotency.__version__ != "0.0.0"  # the installed distribution's


# --- prune --pause ----------------------------------------------------------------------


async def _expired_rows(url: str, count: int) -> None:
    store = SQLStore(url)
    try:
        async with store.engine.begin() as conn:
            await conn.execute(text("DELETE FROM idempotency_records"))
        then = datetime.now(UTC) - timedelta(days=2)
        for _ in range(count):
            digest, token = uuid.uuid4().hex * 2, uuid.uuid4().hex
            claimed = await claim(
                store, digest, "ab" * 32, token, now=then,
                lease=timedelta(seconds=30), ttl=timedelta(hours=1),
            )  # fmt: skip
            assert claimed.owned
            record = await store.get(digest)
            assert record is not None
            await backdate(store, digest, record.created_at - then)  # Postgres wrote it now
    finally:
        await store.close()


PAUSE = 1.0


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("rows", "argv", "pauses"),
    [
        (3, ["--batch-size", "2"], 1),  # 2 then 1: one pause between them
        (4, ["--batch-size", "2", "--max-batches", "2"], 1),  # stops at the cap: no pause after
        (1, ["--batch-size", "2"], 0),  # one short batch: nothing to pause between
    ],
)
def test_prune_pauses_between_batches_never_after_the_last(
    pg_url: str, rows: int, argv: list[str], pauses: int, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(_expired_rows(pg_url, rows))
    code, out, _ = run(
        capsys, "prune", "--json", "--pause", str(PAUSE), *argv, "--database-url", pg_url
    )
    assert code == Exit.OK
    result = json.loads(out)
    assert result["pruned"] == rows
    # Each pause is a whole second; the statements take milliseconds (slack for a busy CI).
    assert pauses * PAUSE <= result["elapsed_s"] < (pauses + 0.7) * PAUSE, result


# --- demo: its database, its failures ------------------------------------------------

UNREACHABLE = "postgresql://postgres@127.0.0.1:9/x"


@pytest.mark.parametrize("argv", [["--kill-after-write"], []])
def test_demo_on_an_unreachable_postgres_is_one_line_and_exit_3(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "demo", *argv, "--database-url", UNREACHABLE)
    assert code == Exit.UNREACHABLE, err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        "asgi-idempotency demo: cannot use the database at "
        "postgresql+asyncpg://postgres@127.0.0.1:9/x: "
        "ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 9)"
    ]


async def _tables_and_scratch(url: str) -> tuple[list[str], list[str]]:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            tables = (
                await conn.execute(
                    text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
                )
            ).scalars()
            scratch = (
                await conn.execute(
                    text("SELECT datname FROM pg_database WHERE datname LIKE :p"),
                    {"p": SCRATCH_PREFIX + "%"},
                )
            ).scalars()
            return list(tables), list(scratch)
    finally:
        await engine.dispose()


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "summary"),
    [
        (["--kill-after-write"], "Default mode: 2 refunds"),
        ([], "With asgi-idempotency: 1 refund. Without: 2 refunds."),
    ],
)
def test_demo_runs_on_the_given_postgres_and_leaves_nothing_behind(
    argv: list[str], summary: str, pg_server: PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with pg_server.database("idem_demo") as url:
        before = asyncio.run(_tables_and_scratch(url))
        assert before[0] == []
        code, out, err = run(capsys, "demo", *argv, "--database-url", url)
        assert code == Exit.OK, out + err
        assert summary in out
        # It ran on the server it was given: on scratch databases there, named in the output.
        host = url.split("@", 1)[1].rsplit("/", 1)[0]
        used = re.findall(rf"scratch database \S+@{re.escape(host)}/({SCRATCH_PREFIX}\w+)", out)
        assert used, out
        tables, scratch = asyncio.run(_tables_and_scratch(url))
        assert tables == []  # nothing written to the user's database
        assert not set(used) & set(scratch)  # and the scratch ones dropped

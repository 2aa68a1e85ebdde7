"""``asgi-idempotency``: each command against Postgres, the exit codes, one real console-script run.

These tests are synchronous: the CLI runs its own event loop (``asyncio.run``), so
the data they need is written with ``asyncio.run`` too.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.core.lifecycle import claim
from asgi_idempotency.ops import cli
from asgi_idempotency.ops.cli import ENV_URL, Exit, main, normalize_url
from asgi_idempotency.stores.base import StoredResponse
from asgi_idempotency.stores.sql.store import SQLStore
from tests.conftest import backdate

FINGERPRINT = "ab" * 32
UNREACHABLE = "postgresql+asyncpg://postgres@127.0.0.1:9/x"
SCRIPT = Path(sys.executable).parent / "asgi-idempotency"


async def _seed(url: str, now: datetime) -> None:
    store = SQLStore(url)
    try:
        async with store.engine.begin() as conn:
            await conn.execute(text("DELETE FROM idempotency_records"))

        async def put(key: str, *, age: timedelta, done: bool, principal: str = "") -> None:
            # Written now at the database's time, then aged by ``age`` from ``now``.
            t0 = now
            token = uuid.uuid4().hex
            digest = scoped_key(principal, key)
            claimed = await claim(
                store,
                digest,
                FINGERPRINT,
                token,
                now=t0,
                lease=timedelta(seconds=30),
                ttl=timedelta(hours=24),
            )
            assert claimed.owned
            if done:
                response = StoredResponse(201, (), b'{"refund_id": "r-1"}')
                await store.complete(digest, token, response, now=t0, ttl=timedelta(hours=24))
            record = await store.get(digest)
            assert record is not None
            await backdate(store, digest, record.created_at - (now - age))

        await put("refund-42", age=timedelta(minutes=5), done=True)
        await put("refund-42", age=timedelta(minutes=5), done=True, principal="alice")
        await put("running", age=timedelta(seconds=1), done=False)
        await put("abandoned", age=timedelta(minutes=3), done=False)
        for i in range(5):
            await put(f"old-{i}", age=timedelta(hours=30), done=i % 2 == 0)
    finally:
        await store.close()


@dataclass(frozen=True)
class Seeded:
    url: str
    at: datetime


@pytest.fixture
def seeded(pg_url: str) -> Seeded:
    """The run's Postgres database, holding 2 + 2 live rows and 5 expired ones, as of now."""
    now = datetime.now(UTC)
    asyncio.run(_seed(pg_url, now))
    return Seeded(pg_url, now)


@pytest.fixture
def db(seeded: Seeded) -> str:
    return seeded.url


def pg_admin(pg_url: str, statement: str) -> None:
    """Run one statement on the server's ``postgres`` database, outside a transaction."""

    async def go() -> None:
        engine = create_async_engine(
            pg_url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT"
        )
        try:
            async with engine.connect() as conn:
                await conn.execute(text(statement))
        finally:
            await engine.dispose()

    asyncio.run(go())


@pytest.fixture
def empty_pg(pg_url: str) -> Iterator[str]:
    """A new, empty Postgres database (no schema), dropped afterwards."""
    name = f"idem_cli_{uuid.uuid4().hex[:10]}"
    pg_admin(pg_url, f'CREATE DATABASE "{name}"')
    try:
        yield pg_url.rsplit("/", 1)[0] + "/" + name
    finally:
        pg_admin(pg_url, f'DROP DATABASE "{name}" WITH (FORCE)')


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def count_rows(url: str) -> int:
    async def go() -> int:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return int(
                    (
                        await conn.execute(text("SELECT count(*) FROM idempotency_records"))
                    ).scalar_one()
                )
        finally:
            await engine.dispose()

    return asyncio.run(go())


# --- migrate ------------------------------------------------------------------


@pytest.mark.postgres
def test_migrate_creates_the_schema_then_is_a_no_op(
    empty_pg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "stats", "--database-url", empty_pg)
    assert code == Exit.NO_SCHEMA
    assert "run `asgi-idempotency migrate`" in err
    for _ in range(2):
        code, out, _ = run(capsys, "migrate", "--database-url", empty_pg)
        assert code == Exit.OK
        assert "latest revision" in out
    assert count_rows(empty_pg) == 0
    code, out, _ = run(capsys, "stats", "--json", "--database-url", empty_pg)
    assert code == Exit.OK
    assert json.loads(out)["total"] == 0


def test_migrate_sqlite_from_a_plain_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'ops.db'}"  # the async driver is added
    assert run(capsys, "migrate", "--database-url", url)[0] == Exit.OK
    assert count_rows(normalize_url(url)) == 0


# --- inspect ------------------------------------------------------------------


@pytest.mark.postgres
def test_inspect_answers_did_this_key_run(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", "refund-42", "--database-url", db)
    assert code == Exit.OK
    assert scoped_key("", "refund-42") in out
    assert "completed" in out
    assert FINGERPRINT in out
    assert "201 (20 bytes stored)" in out
    assert "refund_id" not in out  # sizes, never stored bodies
    assert "lease" not in out  # a lease means nothing once the record is completed

    # The sf-string form of the header spells the same key.
    assert run(capsys, "inspect", '"refund-42"', "--database-url", db)[0] == Exit.OK

    code, out, _ = run(
        capsys, "inspect", "refund-42", "--principal", "alice", "--json", "--database-url", db
    )
    assert code == Exit.OK
    data = json.loads(out)
    assert data["key_digest"] == scoped_key("alice", "refund-42")
    assert data["status"] == "completed"
    assert data["request_hash"] == FINGERPRINT
    assert data["response_status"] == 201
    assert data["locked_until"] is None
    assert data["expired"] is False
    assert datetime.fromisoformat(data["created_at"]) < datetime.fromisoformat(data["expires_at"])

    code, out, _ = run(capsys, "inspect", "refund-42", "--principal", "bob", "--database-url", db)
    assert code == Exit.NOT_FOUND
    assert "no record" in out
    code, out, _ = run(capsys, "inspect", "nope", "--json", "--database-url", db)
    assert code == Exit.NOT_FOUND
    shown = json.loads(out)
    assert (shown["key_digest"], shown["found"]) == (scoped_key("", "nope"), False)
    assert shown["searched"]["host"] is None


@pytest.mark.postgres
def test_inspect_explains_in_progress_and_expired_rows(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "inspect", "running", "--database-url", db)
    assert (code, "running: its lease is live" in out) == (Exit.OK, True)
    assert re.search(r"^lease until +\S+ \(\d+s from now\)$", out, re.MULTILINE)
    code, out, _ = run(capsys, "inspect", "abandoned", "--json", "--database-url", db)
    data = json.loads(out)
    assert (data["status"], data["abandoned"], data["response_status"]) == (
        "in_progress",
        True,
        None,
    )
    code, out, _ = run(capsys, "inspect", "old-0", "--database-url", db)
    assert code == Exit.OK
    assert "expired: a new request with this key runs again" in out


# --- stats and prune ----------------------------------------------------------


@pytest.mark.postgres
def test_stats(seeded: Seeded, capsys: pytest.CaptureFixture[str]) -> None:
    db = seeded.url
    code, out, _ = run(capsys, "stats", "--json", "--database-url", db)
    assert code == Exit.OK
    data = json.loads(out)
    assert data["live"] == {"completed": 2, "in_progress": 2}
    assert data["expired"] == 5
    assert data["abandoned"] == 1
    assert data["total"] == 9
    oldest = datetime.fromisoformat(data["oldest_in_progress"])
    assert abs(oldest - (seeded.at - timedelta(minutes=3))) < timedelta(seconds=1)

    code, out, _ = run(capsys, "stats", "--database-url", db)
    assert code == Exit.OK
    assert "expired, awaiting prune" in out
    assert "3m ago" in out


@pytest.mark.postgres
def test_prune_dry_run_then_prune(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "prune", "--dry-run", "--database-url", db)
    assert code == Exit.OK
    assert "5 expired records would be pruned" in out
    assert count_rows(db) == 9

    code, out, _ = run(capsys, "prune", "--batch-size", "2", "--json", "--database-url", db)
    assert code == Exit.OK
    assert json.loads(out)["pruned"] == 5
    assert count_rows(db) == 4
    code, out, _ = run(capsys, "prune", "--database-url", db)
    assert (code, "pruned 0 expired records" in out) == (Exit.OK, True)


@pytest.mark.postgres
def test_prune_shows_progress_on_a_terminal(db: str) -> None:
    # stderr on a pseudo-terminal, as in an operator's shell.
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "asgi_idempotency.ops.cli", "prune", "--batch-size", "2"],
            env={**os.environ, ENV_URL: db},
            stdout=subprocess.PIPE,
            stderr=secondary,
            timeout=60,
            check=False,
        )
        os.close(secondary)
        secondary = -1
        shown = b""
        while True:  # bounded: the pty reports EOF (OSError on Linux) once drained
            try:
                chunk = os.read(primary, 4096)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(primary)
        if secondary != -1:
            os.close(secondary)
    assert proc.returncode == Exit.OK
    assert b"\rpruned 2 of 5 expired records (40%)" in shown
    assert b"\rpruned 5 of 5 expired records (100%)" in shown
    assert b"pruned 5 expired records" in proc.stdout


# --- errors and exit codes ----------------------------------------------------


def test_no_database_url_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_URL, raising=False)
    code, _, err = run(capsys, "stats")
    assert code == Exit.USAGE
    assert ENV_URL in err


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "malformed database URL"),
        ("mysql+aiomysql://u@h/db", "needs the async driver asyncmy, not aiomysql"),
        ("oracle://u@h/db", "unsupported database URL scheme 'oracle'"),
    ],
)
def test_bad_urls_are_usage_errors(
    url: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "stats", "--database-url", url)
    assert code == Exit.USAGE
    assert message in err


def test_usage_errors_from_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "frobnicate")[0] == Exit.USAGE
    assert run(capsys, "prune", "--batch-size", "0", "--database-url", UNREACHABLE)[0] == Exit.USAGE
    code, _, err = run(capsys, "inspect", "has space", "--database-url", UNREACHABLE)
    assert code == Exit.USAGE
    assert "not a valid Idempotency-Key" in err
    assert run(capsys, "--help")[0] == Exit.OK


def test_unreachable_database(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "inspect", "k", "--timeout", "2", "--database-url", UNREACHABLE)
    assert code == Exit.UNREACHABLE
    assert "cannot use the database at postgresql+asyncpg://postgres@127.0.0.1:9/x" in err


@pytest.mark.postgres
def test_missing_database_and_hidden_password(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = pg_url.rsplit("/", 1)[0] + "/no_such_db_here"
    code, _, err = run(capsys, "stats", "--database-url", missing)
    assert code == Exit.UNREACHABLE
    assert "no_such_db_here" in err
    with_password = "postgresql://postgres:hunter2@127.0.0.1:9/x"
    code, _, err = run(capsys, "stats", "--timeout", "2", "--database-url", with_password)
    assert code == Exit.UNREACHABLE
    assert "hunter2" not in err
    assert "***" in err


def test_missing_table_on_sqlite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.db").touch()  # an empty SQLite database
    url = f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"
    code, _, err = run(capsys, "prune", "--database-url", url)
    assert code == Exit.NO_SCHEMA
    assert "migrate" in err


@pytest.mark.parametrize(
    "command", [["stats"], ["prune"], ["prune", "--dry-run"], ["inspect", "k"]]
)
@pytest.mark.parametrize("scheme", ["sqlite", "sqlite+aiosqlite"])
def test_a_sqlite_file_that_does_not_exist_is_reported_and_not_created(
    command: list[str], scheme: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "typo.db"
    code, out, err = run(capsys, *command, "--database-url", f"{scheme}:///{missing}")
    assert code == Exit.UNREACHABLE
    assert f"no SQLite database at {missing}: the file does not exist" in err
    assert "migrate" in err
    assert out == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["prune", "--pause", "-1"], "argument --pause: must be 0 or more seconds, got '-1'"),
        (["prune", "--pause", "nan"], "argument --pause: must be 0 or more seconds, got 'nan'"),
        (["prune", "--pause", "soon"], "argument --pause: must be a number of seconds, got 'soon'"),
        (["prune", "--batch-size", "0"], "argument --batch-size: must be between 1 and"),
        (["prune", "--batch-size", "1e3"], "argument --batch-size: must be a whole number"),
        (["prune", "--batch-size", str(2**63)], "argument --batch-size: must be between 1 and"),
        (["prune", "--max-batches", "-2"], "argument --max-batches: must be between 1 and"),
        (["stats", "--timeout", "0"], "argument --timeout: must be more than 0 seconds, got '0'"),
        (["--timeout", "-5", "stats"], "argument --timeout: must be more than 0 seconds"),
        (["inspect", "k", "--timeout", "inf"], "argument --timeout: must be more than 0 seconds"),
    ],
)
def test_out_of_range_numbers_are_usage_errors_in_plain_words(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, *argv, "--database-url", UNREACHABLE)
    assert code == Exit.USAGE
    assert message in err
    assert not re.search(r"\b_[a-z]", err), err  # no internal names such as _positive_float


def _words(text: str) -> str:
    return " ".join(text.split())


def test_help_lists_every_exit_code_as_the_module_docstring_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == Exit.OK
    assert cli.__doc__ is not None
    doc, shown = _words(cli.__doc__), _words(out)
    for member in Exit:
        meaning = _words(cli.EXIT_MEANINGS[member])
        assert f"{int(member)} {meaning}" in shown, member
        assert f"{int(member)} {meaning}" in doc, member
    assert "130 interrupted" in shown


def test_demo_without_the_demo_extra_says_what_to_install() -> None:
    blocked = (
        "import sys; sys.modules['uvicorn'] = None; "
        "from asgi_idempotency.ops.cli import main; sys.exit(main(['demo']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == Exit.USAGE, done.stderr
    assert "pip install 'asgi-idempotency[demo]'" in done.stderr
    assert "uvicorn" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.postgres
def test_database_url_from_the_environment_and_option_after_the_command(
    db: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_URL, db.replace("postgresql+asyncpg://", "postgres://"))
    assert run(capsys, "inspect", "refund-42")[0] == Exit.OK
    # An option after the command wins over the environment.
    assert run(capsys, "inspect", "refund-42", "--database-url", UNREACHABLE, "--timeout", "2")[
        0
    ] == (Exit.UNREACHABLE)
    # ... and over one given before the command.
    assert run(capsys, "--database-url", UNREACHABLE, "inspect", "refund-42", "--database-url", db)[
        0
    ] == (Exit.OK)


def test_demo_returns_the_demos_code(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asgi_idempotency.ops.demo as demo

    for code in (0, 1):

        async def fake(url: str | None = None, code: int = code) -> int:
            return code

        monkeypatch.setattr(demo, "run_demo", fake)
        assert run(capsys, "demo")[0] == code


@pytest.mark.slow
def test_demo_plays_the_incident_for_real(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo")
    assert code == Exit.OK
    assert "With asgi-idempotency: 1 refund. Without: 2 refunds." in out
    assert "(replayed)" in out


def test_kill_after_write_demo_needs_postgres(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "demo", "--kill-after-write", "--database-url", "sqlite:///x.db")
    assert code == Exit.USAGE
    assert "needs a Postgres" in err


def test_internal_errors_exit_70(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> Exit:
        raise RuntimeError("bug")

    monkeypatch.setattr(cli, "cmd_stats", broken)
    code, _, err = run(capsys, "stats", "--database-url", UNREACHABLE)
    assert code == Exit.INTERNAL
    assert "RuntimeError: bug" in err


# --- the installed console script ----------------------------------------------


@pytest.mark.postgres
def test_console_script(db: str) -> None:
    assert SCRIPT.exists(), f"{SCRIPT} missing: install the package (pip install -e .)"
    env = {**os.environ, ENV_URL: db}

    def script(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(SCRIPT), *argv], env=env, capture_output=True, text=True, timeout=60, check=False
        )

    stats = script("stats", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["expired"] == 5
    missing = script("inspect", "never-sent")
    assert missing.returncode == 1
    down = script("stats", "--database-url", UNREACHABLE, "--timeout", "2")
    assert down.returncode == 3
    assert "cannot use the database" in down.stderr
    assert "Traceback" not in down.stderr


@pytest.mark.postgres
def test_demo_as_a_user_who_may_not_create_databases_says_so(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Decided by the error's type (Postgres's insufficient_privilege), not its words.
    role = f"idem_nocreate_{uuid.uuid4().hex[:8]}"
    pg_admin(pg_url, f'CREATE ROLE "{role}" LOGIN NOCREATEDB')
    try:
        url = normalize_url(pg_url).replace("//postgres@", f"//{role}@", 1)
        assert role in url
        code, _, err = run(capsys, "demo", "--database-url", url)
        assert code == Exit.UNREACHABLE
        assert "this user may not create databases (grant CREATEDB" in err
    finally:
        pg_admin(pg_url, f'DROP ROLE "{role}"')

"""Stores built from one URL registry, whose declared capabilities the CLI reads."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from asgi_idempotency.ops.cli import Exit, main
from asgi_idempotency.stores import registry
from asgi_idempotency.stores.base import Capabilities, capabilities
from asgi_idempotency.stores.registry import StoreKind, kind_of, open_store, register
from examples.dict_store import DictStore


@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("postgresql://u@h/db", "PostgreSQL"),
        ("postgres+asyncpg://u@h/db", "PostgreSQL"),
        ("postgresql+psycopg2://u@h/db", "PostgreSQL"),  # its URL rule refuses the driver
        ("sqlite:///x.db", "SQLite"),
        ("sqlite+aiosqlite:///x.db", "SQLite"),
        ("mariadb://u@h/db", "MariaDB"),
        ("mysql+asyncmy://u@h/db", "MySQL"),
        ("redis://h:6379/0", "Redis"),
        ("REDISS://h", "Redis"),
        ("redis+cluster://h:7000", "Redis"),
        ("rediss+cluster://h:7000", "Redis"),
    ],
)
def test_every_url_spelling_has_one_kind(url: str, name: str) -> None:
    assert kind_of(url).name == name


@pytest.mark.parametrize("url", ["mongodb://h/db", "redis", "rediscluster://h", "ftp://h"])
def test_a_url_no_kind_takes_is_refused_with_the_accepted_spellings(url: str) -> None:
    with pytest.raises(ValueError, match="use postgresql://"):
        kind_of(url)


def _agree(declared: Capabilities, built: Capabilities) -> None:
    # Batching is the instance's (an argument); everything else is the kind's.
    assert built._replace(batching=False) == declared._replace(batching=False)


@pytest.mark.postgres
@pytest.mark.mariadb
@pytest.mark.redis
@pytest.mark.parametrize("fixture", ["pg_url", "mariadb_url", "sqlite_url", "redis_url"])
def test_a_store_built_from_a_url_offers_what_its_kind_declares(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    url: str = request.getfixturevalue(fixture)
    kind = kind_of(url)
    store = open_store(url, command_timeout=2.0)
    try:
        _agree(kind.capabilities, capabilities(store))
    finally:
        asyncio.run(store.close())


@pytest.fixture
def lacking(monkeypatch: pytest.MonkeyPatch) -> str:
    """A store kind of its own, ``lacking://``, that offers no stats, prune nor migrations."""
    monkeypatch.setattr(registry, "KINDS", list(registry.KINDS))

    class Lacking(DictStore):
        capabilities = Capabilities(stats=False, prune=False)

    register(StoreKind(
        "lacking", ("lacking",), Lacking, Lacking.capabilities,
        lacks={"stats": "it keeps no counts", "prune": "its records expire by themselves"},
    ))  # fmt: skip
    return "lacking://"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_cli_asks_a_registered_store_what_it_offers(
    lacking: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "stats", "--database-url", lacking)
    assert code == Exit.USAGE
    assert err.strip().endswith(
        "stats: this store cannot count its records (it keeps no counts)"
    ), err
    code, out, _ = run(capsys, "prune", "--database-url", lacking)
    assert (code, out.strip()) == (Exit.OK, "nothing to prune: its records expire by themselves")
    code, out, _ = run(capsys, "prune", "--json", "--database-url", lacking)
    assert json.loads(out)["note"] == "nothing to prune: its records expire by themselves"
    code, out, _ = run(capsys, "migrate", "--database-url", lacking)
    assert (code, out.strip()) == (
        Exit.OK,
        "nothing to migrate: the lacking store has no migrations",
    )
    # The primitives every store has work as on any store.
    assert run(capsys, "inspect", "refund-42", "--database-url", lacking)[0] == Exit.NOT_FOUND


def test_the_demo_refuses_a_store_without_a_schema(
    lacking: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "demo", "--database-url", lacking)
    assert code == Exit.USAGE
    assert "the demo runs on Postgres or SQLite, not lacking" in err


def test_a_scheme_is_one_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "KINDS", list(registry.KINDS))
    with pytest.raises(ValueError, match="'rediss' is already Redis's"):
        register(StoreKind("mine", ("mine", "rediss"), DictStore))
    # The same kind registered again (its module imported again) replaces itself.
    first = register(StoreKind("mine", ("mine",), DictStore))
    again = register(StoreKind("mine", ("mine",), DictStore))
    assert kind_of("mine://") is again is not first


def test_a_kind_whose_extra_is_missing_names_it(tmp_path: Path) -> None:
    kind = StoreKind("Nowhere", ("nowhere",), "no_such_driver_module:Store", extra="nowhere")
    with pytest.raises(ImportError, match=r"pip install 'asgi-idempotency\[nowhere\]'"):
        kind.build("nowhere://")

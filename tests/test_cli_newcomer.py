"""What a newcomer trips on with the command line: URL hints, SQLite URL forms, ``--version``.

Synchronous, like ``test_cli``: the CLI runs its own event loop.
"""

from __future__ import annotations

import re

import pytest

from asgi_idempotency.cli import Exit, main
from asgi_idempotency.stores.sql import SQLStore
from asgi_idempotency.urls import ACCEPTED, REDIS_SCHEMES, async_url


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _schemes(text: str) -> set[str]:
    return {m.lower() for m in re.findall(r"\b([a-z][a-z0-9+]*)://", text)}


# --- one list of URL spellings, Redis included --------------------------------------

EVERY_SCHEME = {"postgresql", "postgres", "postgresql+asyncpg", "sqlite", "sqlite+aiosqlite"} | set(
    REDIS_SCHEMES
)


def test_the_one_list_names_every_scheme_the_package_takes() -> None:
    assert _schemes(ACCEPTED) == EVERY_SCHEME


def _hint_from_sql_store() -> str:
    with pytest.raises(ValueError, match="unsupported") as caught:
        SQLStore("mysql+aiomysql://u@h/db")
    return str(caught.value)


def _hint_from_redis_store() -> str:
    pytest.importorskip("redis")
    from asgi_idempotency.stores.redis import RedisStore

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
    for where, text in hints.items():
        assert _schemes(text) >= EVERY_SCHEME, (where, text)

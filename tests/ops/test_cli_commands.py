"""The CLI as commands: each a plain function with typed parameters that returns an exit
code, and one argparse layer built over them that hands each option to its parameter."""

from __future__ import annotations

import argparse
import inspect
import io
from pathlib import Path

import pytest

from asgi_idempotency.ops import cli, commands
from asgi_idempotency.ops.commands import Exit

OPS = Path(cli.__file__).parent


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_reaches_a_parameter_of_its_command_and_back() -> None:
    found = _subparsers()
    assert set(found) == {
        "migrate", "prune", "inspect", "stats", "audit", "scope-digest", "demo", "check",
    }  # fmt: skip
    for name, parser in found.items():
        func = getattr(commands, name.replace("-", "_"))
        params = set(inspect.signature(func).parameters) - {"out"}
        dests = {a.dest for a in parser._actions} - {"help", "func"}
        if name == "migrate":
            # --timeout is taken by every database command; a migration runs without one.
            dests.discard("timeout")
        assert dests == params, name


def test_no_module_in_ops_is_over_600_lines() -> None:
    for path in OPS.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        assert lines <= 600, f"{path.relative_to(OPS)}: {lines} lines"


def test_a_command_is_callable_without_the_parser(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("IDEMPOTENCY_DATABASE_URL", raising=False)
    out = io.StringIO()
    url = f"sqlite:///{tmp_path / 'c.db'}"
    assert commands.migrate(url, out=out) == Exit.OK
    assert commands.prune(url, dry_run=True, out=out) == Exit.OK
    assert "0 expired records would be pruned" in out.getvalue()
    # A usage error is one line on stderr and its code, not an exception.
    assert commands.inspect("k", None) == Exit.USAGE
    assert "no database: pass --database-url" in capsys.readouterr().err
    assert commands.stats(f"sqlite:///{tmp_path / 'none.db'}") == Exit.UNREACHABLE
    err = capsys.readouterr().err
    assert err.startswith("asgi-idempotency stats: no SQLite database at"), err
    assert len(err.splitlines()) == 1


def test_counts_are_pluralised(tmp_path: Path) -> None:
    from asgi_idempotency.ops.commands._common import plural

    assert plural(1, "request") == "1 request"
    assert plural(0, "request") == "0 requests"
    assert plural(1500, "expired record") == "1,500 expired records"


def test_inspect_says_one_byte(tmp_path: Path) -> None:
    import asyncio
    from datetime import UTC, datetime, timedelta

    from asgi_idempotency import SQLStore
    from asgi_idempotency.core import lifecycle
    from asgi_idempotency.core.keys import scoped_key
    from asgi_idempotency.stores.base import StoredResponse

    url = f"sqlite:///{tmp_path / 'one.db'}"
    key = scoped_key("", "k-1")

    async def seed() -> None:
        store = SQLStore(url)
        try:
            await store.prepare()
            now, ttl = datetime.now(UTC), timedelta(hours=1)
            await lifecycle.claim(
                store, key, "f" * 64, "t" * 32, now=now, lease=timedelta(seconds=30), ttl=ttl
            )
            done = await store.complete(
                key, "t" * 32, StoredResponse(201, (), b"1"), now=now, ttl=ttl
            )
            assert done
        finally:
            await store.close()

    asyncio.run(seed())
    out = io.StringIO()
    assert commands.inspect("k-1", url, out=out) == Exit.OK
    assert "201 (1 byte stored)" in out.getvalue()

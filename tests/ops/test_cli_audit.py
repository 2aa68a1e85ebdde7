"""``asgi-idempotency audit``: its exit codes, durations and formats (the storm through
four uvicorn workers on every store is tests/ops/test_audit.py)."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from asgi_idempotency import SQLStore
from asgi_idempotency.core import lifecycle
from asgi_idempotency.migrations import upgrade
from asgi_idempotency.ops.audit import parse_duration
from asgi_idempotency.ops.cli import Exit, main
from tests.conftest import PgServer

ROUTE = "/refunds/{account}"


def sqlite_db(tmp_path: Path, storm: int = 0) -> str:
    """A migrated SQLite file with ``storm`` claims of one caller's request, each under
    its own key, two seconds apart."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'audit.db'}"
    upgrade(url)

    async def fill() -> None:
        store = SQLStore(url)
        now = datetime.now(UTC) - timedelta(minutes=5)
        for n in range(storm):
            at = now + timedelta(seconds=2 * n)
            key = hashlib.sha256(f"k{n}".encode()).hexdigest()
            await lifecycle.claim(
                store, key, "f" * 64, f"{n:032x}", now=at, lease=timedelta(seconds=30),
                ttl=timedelta(days=1), scope_digest="c" * 64, route=ROUTE,
            )  # fmt: skip
        await store.close()

    asyncio.run(fill())
    return url


def test_durations() -> None:
    assert parse_duration("30s") == timedelta(seconds=30)
    assert parse_duration("10m") == timedelta(minutes=10)
    assert parse_duration("1h") == timedelta(hours=1)
    assert parse_duration("2d") == timedelta(days=2)
    for bad in ("", "10", "1.5h", "0m", "-1h", "1w", "1h30m"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)


@pytest.mark.parametrize(
    "args", [["--since", "10x"], ["--window", "0m"], ["--format", "yaml"], ["--since"]]
)
def test_bad_arguments_are_usage_errors(args: list[str], tmp_path: Path) -> None:
    url = sqlite_db(tmp_path)
    assert main(["audit", "--database-url", url, *args]) == Exit.USAGE


def test_no_database_and_a_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IDEMPOTENCY_DATABASE_URL", raising=False)
    assert main(["audit"]) == Exit.USAGE
    missing = f"sqlite:///{tmp_path / 'none.db'}"
    assert main(["audit", "--database-url", missing]) == Exit.UNREACHABLE
    assert not (tmp_path / "none.db").exists()


def test_nothing_found_is_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = sqlite_db(tmp_path, storm=1)
    assert main(["audit", "--database-url", url]) == Exit.OK
    assert capsys.readouterr().out.startswith("no suspected duplicates since ")


def test_found_is_exit_1_in_every_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = sqlite_db(tmp_path, storm=3)
    assert main(["audit", "--database-url", url]) == 1
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("1 suspected duplicate run (2 requests repeated under another key)")
    assert table[2].split()[:5] == [ROUTE, "c" * 16, "f" * 16, "3", "3"]
    assert main(["audit", "--database-url", url, "--format", "prometheus"]) == 1
    assert (
        'idempotency_audit_suspected_regenerated_keys{route="/refunds/{account}"} 2.0'
        in capsys.readouterr().out
    )
    # A lookback that ends before the storm, or a window shorter than its gaps: nothing.
    assert main(["audit", "--database-url", url, "--since", "1m"]) == Exit.OK
    assert main(["audit", "--database-url", url, "--window", "1s"]) == Exit.OK
    assert main(["audit", "--database-url", url, "--window", "2s", "--format", "json"]) == 1
    capsys.readouterr()
    assert main(["audit", "--database-url", url, "--route", "/other"]) == Exit.OK


@pytest.mark.postgres
def test_a_database_not_migrated_to_this_version_is_exit_4(
    pg_server: PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with pg_server.database("idem_audit_old") as url:
        upgrade(url, "0002")
        assert main(["audit", "--database-url", url]) == Exit.NO_SCHEMA
        assert "migrate" in capsys.readouterr().err


@pytest.mark.anyio
async def test_the_exporter_sets_the_gauge_per_route_and_resets_it() -> None:
    from prometheus_client import CollectorRegistry

    from asgi_idempotency import MemoryStore
    from asgi_idempotency.observability.prometheus import PrometheusMetrics
    from asgi_idempotency.ops.audit import AuditExporter

    store, registry = MemoryStore(), CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    clock = [datetime.now(UTC)]
    exporter = AuditExporter(store, metrics, clock=lambda: clock[0])
    name = "idempotency_audit_suspected_regenerated_keys"
    for n in range(3):
        at = clock[0] - timedelta(minutes=5) + timedelta(seconds=n)
        await lifecycle.claim(
            store, f"{n:064x}", "f" * 64, f"{n:032x}", now=at, lease=timedelta(0),
            ttl=timedelta(days=1), scope_digest="c" * 64, route=ROUTE,
        )  # fmt: skip
    assert len(await exporter.run_once()) == 1
    assert registry.get_sample_value(name, {"route": ROUTE}) == 2
    clock[0] += timedelta(hours=2)  # the storm has left the lookback
    assert await exporter.run_once() == []
    assert registry.get_sample_value(name, {"route": ROUTE}) == 0
    with pytest.raises(TypeError, match=r"Capabilities\.audit"):
        AuditExporter(object(), metrics)


def test_an_sqlite_file_of_an_earlier_version_is_reported_not_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0002")
    assert main(["audit", "--database-url", url]) == Exit.NO_SCHEMA
    assert "not at this version's head" in capsys.readouterr().err
    assert main(["audit", "--database-url", url]) == Exit.NO_SCHEMA  # still: nothing changed

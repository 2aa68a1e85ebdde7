"""One error boundary per driver: its failures become StoreError, a missing table
SchemaMissing, and what is not the driver's (a bug of ours) passes through unchanged."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta

import pytest
from sqlalchemy import text

from asgi_idempotency import IdempotencyError, SchemaMissing, SQLStore, StoreError
from asgi_idempotency.stores.base import NewClaim, utcnow
from asgi_idempotency.stores.errors import ErrorBoundary
from asgi_idempotency.stores.sql.mysql import MYSQL_ERRORS
from asgi_idempotency.stores.sql.postgres import PG_ERRORS
from asgi_idempotency.stores.sql.sqlite import SQLITE_ERRORS

SQL_KINDS = [
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
]
pytestmark = pytest.mark.anyio

# The table is dropped: never the run's shared database, which every other test uses.
SERVER_FIXTURE = {"postgres": "pg_server", "mariadb": "mariadb_server"}


@pytest.fixture
def own_url(kind: str, request: pytest.FixtureRequest, sqlite_url: str) -> Iterator[str]:
    if kind == "sqlite":
        yield sqlite_url  # a file of this test's own
        return
    with request.getfixturevalue(SERVER_FIXTURE[kind]).database("idem_boundary") as url:
        yield url


def test_a_store_error_is_infrastructure_not_an_http_answer() -> None:
    # The responder alone turns it into its 503; nobody may send it as an answer.
    assert not issubclass(StoreError, IdempotencyError)
    assert issubclass(SchemaMissing, StoreError)


@pytest.mark.parametrize("boundary", [PG_ERRORS, SQLITE_ERRORS, MYSQL_ERRORS])
def test_a_bug_inside_a_boundary_is_not_a_store_error(boundary: ErrorBoundary) -> None:
    with pytest.raises(TypeError), boundary:
        raise TypeError("a bug of ours")
    with pytest.raises(StoreError) as raised, boundary:
        raise ConnectionResetError("peer went away")
    assert str(raised.value) == "ConnectionResetError: peer went away"


def test_a_value_error_is_a_driver_failure_on_sqlite_only() -> None:
    # aiosqlite says "Connection closed" with a ValueError; on Postgres it is a bug.
    with pytest.raises(StoreError), SQLITE_ERRORS:
        raise ValueError("Connection closed")
    with pytest.raises(ValueError, match="a bug of ours"), PG_ERRORS:
        raise ValueError("a bug of ours")


@pytest.mark.parametrize("kind", SQL_KINDS)
async def test_a_missing_table_is_schema_missing_on_every_operation(
    kind: str, own_url: str
) -> None:
    store = SQLStore(own_url)
    try:
        await store.create_all()
        async with store.engine.begin() as conn:
            await conn.execute(text("DROP TABLE idempotency_records"))
        now = utcnow()
        new = NewClaim("k" * 64, "h", "t", now, timedelta(seconds=5), timedelta(1))
        operations: list[Callable[[], Awaitable[object]]] = [
            lambda: store.insert(new),
            lambda: store.release(new.key, new.token),
            lambda: store.get(new.key),
            lambda: store.buckets(now=now),
            lambda: store.prune(now=now),
        ]
        for operation in operations:
            with pytest.raises(SchemaMissing) as raised:
                await operation()
            assert "migrate" in raised.value.detail
            assert "idempotency_records" in str(raised.value)  # the driver's words, for the log
    finally:
        await store.close()

"""What differs between SQL backends, declared once per backend: :class:`SQLDialect`.

:class:`~.sql.SQLStore` is one store for every SQL database; everything it does
differently per database is a field of the backend's :class:`SQLDialect`, declared in
that backend's module (:mod:`.postgres`, :mod:`.sqlite`, :mod:`.mysql`) next to its hot
path, from the statements :mod:`.statements` compiles for it once. A new SQL backend is
a module that declares one, its statements, and a line in :data:`BACKENDS`; nothing in
``SQLStore``, the lifecycle or the middleware changes (SQLAlchemy's dialects are the
model: per-backend differences in one place, the rest shared).
"""

from __future__ import annotations

import asyncio
import enum
import importlib
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, NamedTuple, Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from asgi_idempotency.stores.base import Busy, StoreTransaction
from asgi_idempotency.stores.errors import ErrorBoundary
from asgi_idempotency.stores.sql.statements import Clock

__all__ = [
    "BACKENDS",
    "MAX_BATCH",
    "HotPath",
    "HotPathOptions",
    "Op",
    "SQLDialect",
    "dialect_named",
    "leave_engine",
    "pool_options",
]


# By default at most this many operations share one batched statement or transaction,
# so a burst commits in parts and the first of it is not held back behind the last.
MAX_BATCH = 256


class Op(enum.StrEnum):
    """The hot path's fenced one-row operations: each names its statement in every
    dialect's compiled set (:mod:`.statements`)."""

    REPLACE = "replace"
    COMPLETE = "complete"
    RELEASE = "release"
    RENEW = "renew"


class HotPath(Protocol):
    """A dialect's hot path: the claim and the fenced operations, one round trip each.

    Values are the statements' parameters, already in the driver's types (the
    dialect's :attr:`SQLDialect.time`). Failures are :class:`~.base.StoreError` (the
    dialect's :attr:`SQLDialect.errors`).
    """

    async def claim(
        self, values: dict[str, Any]
    ) -> tuple[bool, Sequence[Any] | Literal[Busy.BUSY] | None]:
        """(inserted, the row in the way as ``RECORD_COLUMNS``, :data:`~.base.BUSY` if an
        open transaction holds that row (a hot path that does not wait for it), or None
        if not visible)."""
        ...

    async def rowcount(self, name: Op, values: dict[str, Any]) -> int:
        """Run the fenced statement of ``name``; how many rows it changed."""
        ...

    async def close(self) -> None: ...


# Opens a transaction on the engine; its connection's closing task joins the set.
OpenTransaction = Callable[
    [AsyncEngine, set[asyncio.Task[Any]]], AbstractAsyncContextManager[StoreTransaction]
]


class HotPathOptions(NamedTuple):
    limit: int  # connections the hot path may keep (server databases)
    timeout: float  # the store's command_timeout
    batching: bool  # send what queues during a statement as the next one
    max_batch: int  # at most this many operations in one statement or transaction


@dataclass(frozen=True, slots=True, kw_only=True)
class SQLDialect:
    """One SQL backend, as :class:`~.sql.SQLStore` needs to know it."""

    label: str  # for messages: "Postgres", "SQLite", "MariaDB/MySQL"
    driver: str  # the async DBAPI driver the hot path speaks (engine.dialect.driver)
    errors: ErrorBoundary  # the driver's failures, mapped to StoreError once
    time: Callable[[datetime], Any]  # an aware time, as the driver binds it
    # The database's clock, which decides leases and expiry for every host sharing it
    # (its statements take durations); None on one host (SQLite): the caller's clock,
    # bound as times.
    clock: Clock | None
    hot_path: Callable[[AsyncEngine, HotPathOptions], HotPath]
    # create_async_engine's keyword arguments for an engine the store builds, from
    # (command_timeout, pool_size), and what to install on it once built.
    engine_options: Callable[[float, int], dict[str, Any]]
    configure_engine: Callable[[AsyncEngine, float], None]
    # The table, its indexes and the migrations' head, safely from many processes at
    # once: (the engine, its autocommit variant, command_timeout).
    create_schema: Callable[[AsyncEngine, AsyncEngine, float], Awaitable[None]]
    # One batch of a prune, on an autocommit connection.
    prune: Callable[..., Awaitable[int]]
    # The schema is the store's own (created at startup) rather than the operator's
    # (checked at startup, created by migrations).
    embedded: bool = False
    batching: bool = False  # batching when the store's argument does not say
    can_batch: bool = False
    # A transaction holding the claim, the handler's writes and the record; None with
    # the reason in ``no_transactions``.
    transaction: (
        Callable[
            [AsyncEngine, set[asyncio.Task[Any]]], AbstractAsyncContextManager[StoreTransaction]
        ]
        | None
    ) = None
    no_transactions: str = "cannot hold the claim and the handler in one transaction"
    # Why the connected server cannot serve this backend's statements (too old), from
    # SQLAlchemy's server_version_info; checked by prepare() at startup.
    server_problem: Callable[[tuple[Any, ...] | None], str | None] | None = None


def pool_options(command_timeout: float, pool_size: int) -> dict[str, Any]:
    """The pool of an engine the store builds for a database server (not SQLite)."""
    return {
        # pool_size for the hot path, as many again for everything else.
        "pool_size": 2 * pool_size,
        # No overflow: the hot path holds a connection for one statement, so waiting a
        # moment for one is far cheaper than connecting, and overflow connections are
        # closed when returned to a full pool, so it would reconnect constantly.
        "max_overflow": 0,
        "pool_timeout": command_timeout,
        # Checkouts cost no ping: a broken connection fails its statement, the store
        # invalidates it, and the next statement connects afresh.
        "pool_pre_ping": False,
    }


def leave_engine(engine: AsyncEngine, command_timeout: float) -> None:
    """For a backend that installs nothing on the engines the store builds."""


# SQLAlchemy's dialect name -> the module declaring its DIALECT; imported on first use,
# so that a backend's extra is needed only by those who use it.
BACKENDS = {
    "postgresql": "postgres_batched",  # the Postgres backend, batching by default
    "sqlite": "sqlite",
    "mysql": "mysql",
    "mariadb": "mariadb",  # the MySQL backend, with transactions
}


def dialect_named(name: str) -> SQLDialect:
    """The backend for SQLAlchemy's dialect ``name``.

    Raises:
        ValueError: no SQL backend serves that dialect.
    """
    module = BACKENDS.get(name)
    if module is None:
        raise ValueError(f"SQLStore supports {', '.join(BACKENDS)}, not {name}")
    found: SQLDialect = importlib.import_module(f".{module}", __package__).DIALECT
    return found

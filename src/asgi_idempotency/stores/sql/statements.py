"""Every SQL statement of the store, built once from the one ``Table`` and compiled per driver.

The hot-path statements are compiled at import for asyncpg and for sqlite3 and run
by the driver as prepared statements; the rest run through SQLAlchemy Core. The
dialects differ in two statements, both named here: the claim (Postgres returns
the row in its way from the same statement, through a data-modifying CTE; SQLite
inserts and, on conflict, selects; MariaDB/MySQL ``INSERT IGNORE`` and, when no row
was affected, select) and the transactional claim (Postgres only: an advisory lock
folded into the insert).

Leases and retention are decided on the store's clock where the store is shared
(:class:`~.base.Store`): on Postgres ``statement_timestamp()`` (one instant for every
row of a statement, batched or not, and each statement's own inside a transaction,
where ``now()`` would be the transaction's start), on MariaDB/MySQL
``UTC_TIMESTAMP(6)`` (naive UTC, as the columns hold; constant within a statement), so
the statements take the lease and the ttl as microseconds (``lease_us``, ``ttl_us``)
and return the store's time with the row they read (``read_at``). SQLite, on one host,
binds the times the caller's clock gives (``now``, ``locked_until``, ``expires_at``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    BigInteger,
    ClauseElement,
    Dialect,
    Select,
    String,
    bindparam,
    case,
    delete,
    exists,
    func,
    insert,
    literal_column,
    null,
    select,
    true,
    update,
)
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.dialects.mysql.asyncmy import dialect as _asyncmy_dialect
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.postgresql.asyncpg import dialect as _asyncpg_dialect
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.dialects.sqlite.aiosqlite import dialect as _aiosqlite_dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnClause

from asgi_idempotency.stores.base import NewClaim, RecordStatus
from asgi_idempotency.stores.sql.schema import MYSQL_DIALECTS, UTCDateTime, records

__all__ = [
    "clock_claim_values",
    "CALLER_CLOCK",
    "CLAIM_LOCKED",
    "COMPLETE",
    "MARIADB_TX_CLAIM",
    "MARIADB_TX_COMPLETE",
    "MARIADB_TX_REPLACE",
    "MYSQL",
    "MYSQL_CLOCK",
    "PG",
    "PG_CLOCK",
    "PG_BATCHED",
    "PG_LONE",
    "RECORD_COLUMNS",
    "REPLACE",
    "SQLITE",
    "Clock",
    "Compiled",
]

_t = records
_TIME = UTCDateTime()
_TEXT = String()
_MICROSECONDS = BigInteger()

_IN_PROGRESS: ColumnClause[Any] = literal_column(f"'{RecordStatus.IN_PROGRESS.value}'")
_COMPLETED: ColumnClause[Any] = literal_column(f"'{RecordStatus.COMPLETED.value}'")

# The columns a Record is read from, in this order, by every statement that reads one.
RECORD_COLUMNS = (
    _t.c.request_hash,
    _t.c.status,
    _t.c.token,
    _t.c.created_at,
    _t.c.locked_until,
    _t.c.expires_at,
    _t.c.response_status,
    _t.c.response_headers,
    _t.c.response_body,
)


class Clock(NamedTuple):
    """Whose time a dialect's statements decide with, and how they write a deadline."""

    now: Any  # the time, as an expression
    lease: Any  # now + the lease
    ttl: Any  # now + the retention
    read_at: Any  # the store's time, returned with a row read; NULL on the caller's clock


def _store_clock(now: Any, after: Callable[[str], Any]) -> Clock:
    return Clock(now, after("lease_us"), after("ttl_us"), now.label("read_at"))


def _pg_after(now: Any) -> Callable[[Any], Any]:
    return lambda us: now + us * literal_column("interval '1 microsecond'")


_PG_NOW = func.statement_timestamp(type_=_TIME)
PG_CLOCK = _store_clock(
    _PG_NOW, lambda name: _pg_after(_PG_NOW)(bindparam(name, type_=_MICROSECONDS))
)
_MYSQL_NOW: Any = literal_column("UTC_TIMESTAMP(6)", type_=_TIME)
MYSQL_CLOCK = _store_clock(
    _MYSQL_NOW,
    lambda name: func.timestampadd(
        literal_column("MICROSECOND"),
        bindparam(name, type_=_MICROSECONDS),
        _MYSQL_NOW,
        type_=_TIME,
    ),
)
# SQLite: one host, the caller's clock, bound as times.
CALLER_CLOCK = Clock(
    bindparam("now", type_=_TIME),
    bindparam("locked_until", type_=_TIME),
    bindparam("expires_at", type_=_TIME),
    null().label("read_at"),
)


def _claimed_row(clock: Clock) -> dict[str, Any]:
    """What a claim writes, whether it inserts the row or replaces one."""
    return {
        "request_hash": bindparam("request_hash"),
        "status": _IN_PROGRESS,
        "token": bindparam("token"),
        "created_at": clock.now,
        "locked_until": clock.lease,
        "expires_at": clock.ttl,
        # The audit's scope digest and route (NULL for claims that are not HTTP requests).
        "scope_digest": bindparam("scope_digest", type_=_TEXT),
        "route": bindparam("route", type_=_TEXT),
    }


_NO_RESPONSE = {"response_status": null(), "response_headers": null(), "response_body": null()}
_KEY = _t.c.key == bindparam("key")
# Core reserves bind names equal to a column's for an UPDATE's SET clause.
_WHERE_KEY = _t.c.key == bindparam("where_key")


def _lock_wait() -> Any:
    """A condition that is always true and, evaluated, sets this statement's lock wait.

    ``set_config(..., is_local => true)`` is ``SET LOCAL``: in autocommit it lasts
    until the statement's own implicit transaction ends. Put in a filter that every
    row passes before the statement locks anything, it bounds every lock wait of the
    statement to ``lock_timeout`` (the ``lock_timeout`` parameter, e.g. ``'100ms'``);
    past it Postgres raises lock_not_available (55P03) and the statement rolls back.
    """
    return func.set_config(
        literal_column("'lock_timeout'"), bindparam("lock_timeout", type_=_TEXT), true()
    ).is_not(None)


def _pg_claim(lock: bool, lock_wait: bool = False) -> Select[Any]:
    """Insert, or return the row in the way, in one statement (and, with ``lock``, under
    ``pg_try_advisory_xact_lock`` on the key, first; with ``lock_wait``, waiting at most
    ``lock_timeout`` for a row lock).

    The outer SELECT sees the statement's snapshot, so a row committed by a racing
    claim after it began reads as NULL (the caller then asks again), and a row updated
    since reads as it was: a take-over of that row must compare-and-swap. With
    ``lock`` too, as the lock is taken after the snapshot.
    """
    claimed = _claimed_row(PG_CLOCK)
    rows = select(bindparam("key"), *claimed.values())
    if lock_wait:
        rows = rows.where(_lock_wait())
    got: Any = true()
    if lock:
        # Volatile, so Postgres evaluates it once and before the insert that reads it.
        # A held lock means another transaction is deciding this key right now.
        lock_cte = select(
            func.pg_try_advisory_xact_lock(
                func.hashtextextended(bindparam("key", type_=_t.c.key.type), literal_column("0"))
            ).label("got")
        ).cte("lock")
        rows = rows.where(select(lock_cte.c.got).scalar_subquery())
        got = select(lock_cte.c.got).scalar_subquery()
    ins = (
        pg_insert(_t)
        .from_select(["key", *claimed], rows)
        .on_conflict_do_nothing(index_elements=[_t.c.key])
        .returning(_t.c.key)
        .cte("ins")
    )
    inserted = exists(select(ins.c.key))
    one = select(literal_column("1").label("one")).subquery("one")
    return (
        select(got.label("locked"), inserted.label("inserted"), *RECORD_COLUMNS, PG_CLOCK.read_at)
        .select_from(one)
        .outerjoin(_t, _KEY & ~inserted & got)
    )


def _sqlite_insert() -> ClauseElement:
    return (
        sqlite_insert(_t)
        .values(key=bindparam("key"), **_claimed_row(CALLER_CLOCK))
        .on_conflict_do_nothing(index_elements=[_t.c.key])
        .returning(literal_column("1"))
    )


# Not ON DUPLICATE KEY UPDATE key=key: SQLAlchemy connects with CLIENT_FOUND_ROWS
# (rowcounts count matched rows, which the fenced updates rely on), and under it that
# no-op update reports 1 row, as an insert does. INSERT IGNORE reports 0 on a duplicate.
# IGNORE would also truncate an overlong value where strict mode refuses it: the
# driver checks lengths first (mysql.py).
def _mysql_insert() -> ClauseElement:
    claimed = _claimed_row(MYSQL_CLOCK)
    return insert(_t).prefix_with("IGNORE").values(key=bindparam("key"), **claimed)


def _select(clock: Clock) -> Select[Any]:
    return select(*RECORD_COLUMNS, clock.read_at).where(_KEY)


_OWNED = _WHERE_KEY & (_t.c.token == bindparam("where_token")) & (_t.c.status == _IN_PROGRESS)


def _complete(clock: Clock) -> Any:
    return (
        update(_t)
        .where(_OWNED)
        .values(
            status=_COMPLETED,
            expires_at=clock.ttl,
            response_status=bindparam("response_status"),
            response_headers=bindparam("response_headers"),
            response_body=bindparam("response_body"),
        )
    )


_RELEASE = delete(_t).where(_OWNED)


# A renewal moves retention to at least the new lease (Store.renew): a live claim is
# never expired, so prune's and the claim's plain `expires_at <= now` stay right.
def _renew(clock: Clock) -> Any:
    return (
        update(_t)
        .where(_OWNED)
        .values(
            locked_until=clock.lease,
            expires_at=case((_t.c.expires_at < clock.lease, clock.lease), else_=_t.c.expires_at),
        )
    )


# Compare-and-swap on the row exactly as it was read: a renewal, a completion or
# another take-over in between changes one of these, and the swap fails.
def _replace(clock: Clock) -> Any:
    return (
        update(_t)
        .where(
            _WHERE_KEY,
            _t.c.token == bindparam("old_token"),
            _t.c.status == bindparam("old_status"),
            _t.c.locked_until == bindparam("old_locked_until", type_=_TIME),
        )
        .values(**_claimed_row(clock), **_NO_RESPONSE)
    )


class Compiled:
    """A statement compiled for one driver: its SQL and the order of its parameters."""

    __slots__ = ("_pick", "names", "sql")

    def __init__(self, stmt: ClauseElement, dialect: Dialect) -> None:
        compiled = cast(SQLCompiler, stmt.compile(dialect=dialect))
        self.sql: str = compiled.string
        self.names: tuple[str, ...] = tuple(compiled.positiontup or ())
        self._pick = operator.itemgetter(*self.names)

    def args(self, values: dict[str, Any]) -> tuple[Any, ...]:
        if len(self.names) == 1:  # itemgetter of one name returns the value, not a tuple
            return (self._pick(values),)
        return self._pick(values)  # type: ignore[no-any-return]


def _compile_all(dialect: Dialect) -> dict[str, Compiled]:
    clock: Clock
    claim: ClauseElement
    if dialect.name == "postgresql":
        clock, claim = PG_CLOCK, _pg_claim(lock=False)
    elif dialect.name in MYSQL_DIALECTS:
        clock, claim = MYSQL_CLOCK, _mysql_insert()
    else:
        clock, claim = CALLER_CLOCK, _sqlite_insert()
    stmts: dict[str, ClauseElement] = {
        "claim": claim,
        "select": _select(clock),
        "complete": _complete(clock),
        "release": _RELEASE,
        "renew": _renew(clock),
        "replace": _replace(clock),
    }
    return {name: Compiled(stmt, dialect) for name, stmt in stmts.items()}


# Transactional mode runs these through Core, on the request's own connection.
CLAIM_LOCKED = _pg_claim(lock=True)
REPLACE = _replace(PG_CLOCK)  # a compare-and-swap even under the key's lock: postgres.py says why
COMPLETE = _complete(PG_CLOCK)

PG = _compile_all(_asyncpg_dialect())  # type: ignore[no-untyped-call]  # untyped in SQLAlchemy
SQLITE = _compile_all(_aiosqlite_dialect())
# asyncmy's server-side prepared statements take MySQL's own ``?`` placeholders.
MYSQL = _compile_all(_asyncmy_dialect(paramstyle="qmark"))

# Batched hot path (Postgres, ``SQLStore(batching=True)``): one statement carries many
# requests, as parallel arrays unnested into rows. Each request's answer is its own row
# of the result, matched by key (a statement never holds one key twice:
# ``postgres_batched.py``).


def _unnest(name: str, *columns: tuple[str, Any]) -> Any:
    """``unnest($1::t1[], $2::t2[], ...) AS name(c1, c2, ...)``: one row per request.

    Text arrays are unbounded (``VARCHAR[]``, not ``VARCHAR(64)[]``): a cast to a
    bounded type truncates silently, where the column itself refuses a long value.
    """
    arrays = [bindparam(f"{name}_{col}", type_=ARRAY(typ)) for col, typ in columns]
    return (
        func.unnest(*arrays)
        .table_valued(*(col for col, _ in columns))
        .render_derived(name=name, with_types=False)
    )


def _pg_claim_many() -> Select[Any]:
    """Insert every row that is free, and return the row in the way of every other.

    Rows are inserted in key order, so two batches (of this process or another) that
    share keys take their locks in the same order and cannot deadlock. As in the
    one-row claim, the row in the way is read in the statement's snapshot: a row
    committed by a racing claim after the statement began reads as NULL (the caller
    asks again). A lock wait (on an uncommitted insert of one of its keys) lasts
    ``lock_timeout`` at most: every row of ``v`` passes the filter that sets it before
    any row is inserted.
    """
    rows = _unnest(
        "v",
        ("key", _TEXT),
        ("request_hash", _TEXT),
        ("token", _TEXT),
        ("lease_us", _MICROSECONDS),
        ("ttl_us", _MICROSECONDS),
        ("scope_digest", _TEXT),
        ("route", _TEXT),
    )
    v = select(rows).where(_lock_wait()).cte("v")
    after = _pg_after(_PG_NOW)
    ins = (
        pg_insert(_t)
        .from_select(
            [
                "key",
                "request_hash",
                "status",
                "token",
                "created_at",
                "locked_until",
                "expires_at",
                "scope_digest",
                "route",
            ],
            select(v.c.key, v.c.request_hash, _IN_PROGRESS, v.c.token)
            .add_columns(_PG_NOW, after(v.c.lease_us), after(v.c.ttl_us))
            .add_columns(v.c.scope_digest, v.c.route)
            .order_by(v.c.key),
        )
        .on_conflict_do_nothing(index_elements=[_t.c.key])
        .returning(_t.c.key)
        .cte("ins")
    )
    return select(
        v.c.key, ins.c.key.is_not(None).label("inserted"), *RECORD_COLUMNS, PG_CLOCK.read_at
    ).select_from(
        v.outerjoin(ins, ins.c.key == v.c.key).outerjoin(
            _t, (_t.c.key == v.c.key) & ins.c.key.is_(None)
        )
    )


def _fenced_many(name: str, *extra: tuple[str, Any]) -> Any:
    return _unnest(name, ("key", _TEXT), ("token", _TEXT), *extra)


def _owned_by(u: Any) -> Any:
    """Token-fenced per row: only the claim that owns a row changes it."""
    return (_t.c.key == u.c.key) & (_t.c.token == u.c.token) & (_t.c.status == _IN_PROGRESS)


def _in_key_order(u_rows: Any) -> tuple[Any, Any]:
    """The batch's rows as a CTE, and a CTE locking the rows they own in key order.

    An ``UPDATE ... FROM unnest(...)`` locks rows in the order its join yields them:
    the array's order, or the table's, whichever the plan follows. Two statements
    over the same rows in different orders (a batch of renewals and one of
    completions, in two processes) can then each hold a row the other waits for, and
    Postgres aborts one, with every completion it carried. Locking first in one
    global order (``ORDER BY key FOR UPDATE``: a sort below the lock) leaves no
    cycle. The filter of the rows' CTE sets the statement's lock wait before any lock.
    """
    u = select(u_rows).where(_lock_wait()).cte("u")
    locked = (
        select(_t.c.key)
        .join(u, _owned_by(u))
        .order_by(_t.c.key)
        .with_for_update(of=_t)
        .cte("locked")
    )
    return u, locked


def _fenced_statement(kind: str, u_rows: Any, **values: Callable[[Any], Any]) -> Any:
    u, locked = _in_key_order(u_rows)
    where = (_owned_by(u), _t.c.key == locked.c.key)
    stmt: Any
    if kind == "delete":
        stmt = delete(_t).where(*where)
    else:
        stmt = update(_t).where(*where).values({name: make(u) for name, make in values.items()})
    return stmt.returning(_t.c.key, _t.c.token)


_COMPLETE_MANY = _fenced_statement(
    "update",
    _fenced_many(
        "u",
        ("ttl_us", _MICROSECONDS),
        ("response_status", _t.c.response_status.type),
        ("response_headers", _t.c.response_headers.type),
        ("response_body", _t.c.response_body.type),
    ),
    status=lambda u: _COMPLETED,
    expires_at=lambda u: _pg_after(_PG_NOW)(u.c.ttl_us),
    response_status=lambda u: u.c.response_status,
    response_headers=lambda u: u.c.response_headers,
    response_body=lambda u: u.c.response_body,
)
_RELEASE_MANY = _fenced_statement("delete", _fenced_many("u"))
_RENEW_MANY = _fenced_statement(
    "update",
    _fenced_many("u", ("lease_us", _MICROSECONDS)),
    locked_until=lambda u: _pg_after(_PG_NOW)(u.c.lease_us),
    expires_at=lambda u: func.greatest(_t.c.expires_at, _pg_after(_PG_NOW)(u.c.lease_us)),
)


def _completed_by() -> Select[Any]:
    """The rows of (key, token) pairs that are completed: a completion sent again after
    its connection broke asks which of its first attempt's had landed."""
    c = _fenced_many("c")
    return (
        select(_t.c.key, _t.c.token)
        .select_from(_t.join(c, (_t.c.key == c.c.key) & (_t.c.token == c.c.token)))
        .where(_t.c.status == _COMPLETED)
    )


# name -> compiled statement; parameters are arrays named "<alias>_<column>".
PG_BATCHED = {
    name: Compiled(stmt, _asyncpg_dialect())  # type: ignore[no-untyped-call]  # as PG above
    for name, stmt in {
        "claim": _pg_claim_many(),
        "complete": _COMPLETE_MANY,
        "release": _RELEASE_MANY,
        "renew": _RENEW_MANY,
        "completed_by": _completed_by(),
    }.items()
}

# The one-row statements of PG, waiting at most ``lock_timeout`` for a row lock: what
# the batching driver sends for a batch of one, so that a lone statement stuck behind
# a held row cannot hold up the requests queued behind it either.
PG_LONE = {
    name: Compiled(stmt, _asyncpg_dialect())  # type: ignore[no-untyped-call]  # as PG above
    for name, stmt in {
        "claim": _pg_claim(lock=False, lock_wait=True),
        "complete": _complete(PG_CLOCK).where(_lock_wait()),
        "release": _RELEASE.where(_lock_wait()),
        "renew": _renew(PG_CLOCK).where(_lock_wait()),
    }.items()
}

# MariaDB's transactional claim (mariadb.py), through Core's connection: insert, or
# return the row in the way, in one statement (MariaDB 10.5+ returns the row an
# ON DUPLICATE KEY UPDATE met). Its no-op update locks that row exclusively until the
# transaction ends, as the insert locks a new one: one transaction decides a key at a
# time. No warning either way (INSERT IGNORE's would cost a SHOW WARNINGS round trip
# through the driver's cursor).
MARIADB_TX_CLAIM: ClauseElement = (
    mysql_insert(_t)
    .values(key=bindparam("key"), **_claimed_row(MYSQL_CLOCK))
    .on_duplicate_key_update(key=_t.c.key)
    .returning(*RECORD_COLUMNS, MYSQL_CLOCK.read_at)
)
# The transaction's compare-and-swap and completion, on the server's clock as the rest.
MARIADB_TX_REPLACE: ClauseElement = _replace(MYSQL_CLOCK)
MARIADB_TX_COMPLETE: ClauseElement = _complete(MYSQL_CLOCK)
# MariaDB's hot path claims with it too (mariadb.py): one statement, one round trip, for
# a replay, 409 or 422 as for a first request.
MYSQL["claim_returning"] = Compiled(MARIADB_TX_CLAIM, _asyncmy_dialect(paramstyle="qmark"))


_US = timedelta(microseconds=1)


def clock_claim_values(new: NewClaim) -> dict[str, Any]:
    """What a claim binds on a store with its own clock (Postgres, MariaDB/MySQL): the
    lease and the retention as durations, which the statement adds to the server's now."""
    return {
        "request_hash": new.request_hash,
        "token": new.token,
        "lease_us": new.lease // _US,
        "ttl_us": new.ttl // _US,
        "scope_digest": new.scope_digest,
        "route": new.route,
    }

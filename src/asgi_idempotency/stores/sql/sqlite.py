"""SQLite: the embedded default's hot path, on one connection and one thread of the store's own.

SQLite admits one writer at a time and every hot-path statement writes, so queueing
on one connection's thread costs nothing, while several connections would wait for
each other in ``busy_timeout`` sleeps. The store opens that connection itself, with
the standard library's ``sqlite3``, on a thread that lives as long as the connection
(:class:`ConnectionThread`); SQLAlchemy's engine, over aiosqlite, keeps the schema,
migrations and everything off the hot path. Each operation is one call into the
thread, which runs its statement(s) and hands plain rows back to the event loop: the
claim inserts and, on conflict, reads the row in the way, both in that one call
(SQLite has no data-modifying CTE).

Operations that queue up while the thread is busy run together, in one
``BEGIN IMMEDIATE`` transaction, and are answered once it commits: one lock and one
WAL commit for the lot, so durability is shared, not weakened. A statement that
fails rolls the batch back and every operation in it runs again on its own; a failed
BEGIN or COMMIT leaves nothing written and fails them all (the 503 path). An
operation whose waiter was cancelled before the thread reached it is not run.

An in-memory database cannot be shared by two connections, so on one the hot path
runs its statements through the engine instead (tests and demos only; slower).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from asgi_idempotency.migrations import create_tables
from asgi_idempotency.stores.codec import sqlite_time
from asgi_idempotency.stores.sql.dialect import MAX_BATCH, HotPath, HotPathOptions, SQLDialect
from asgi_idempotency.stores.sql.errors import sql_boundary
from asgi_idempotency.stores.sql.queries import prune_by_key
from asgi_idempotency.stores.sql.statements import SQLITE

__all__ = [
    "ConnectionThread",
    "DIALECT",
    "EngineSQLiteDriver",
    "MAX_BATCH",
    "SQLITE_ERRORS",
    "SQLiteDriver",
    "pragmas",
    "sqlite_driver",
]


# sqlite3 raises ProgrammingError on a closed connection; aiosqlite (the engine's
# connections) a ValueError ("Connection closed", "no active connection").
_SQLITE_BROKEN: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    sqlite3.ProgrammingError,
    sqlite3.InterfaceError,
)


def _sqlite_breaks(exc: BaseException) -> bool:
    return isinstance(exc, _SQLITE_BROKEN) and not isinstance(exc, TimeoutError)


def _sqlite_no_table(exc: BaseException) -> bool:
    # SQLite reports a missing table with its generic error code (SQLITE_ERROR); its
    # message is all there is to tell it by.
    return isinstance(exc, sqlite3.OperationalError) and str(exc).startswith("no such table")


SQLITE_ERRORS = sql_boundary(
    (sqlite3.Error, ValueError), _sqlite_breaks, missing_table=_sqlite_no_table
)

T = TypeVar("T")

# A job for the thread: the future to settle, the function and its arguments.
_Job = tuple["asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]
# An answer: the future, whether the function returned, and its result or exception.
_Answer = tuple["asyncio.Future[Any]", bool, Any]


def _sqlite_claim(
    conn: sqlite3.Connection, insert_args: tuple[Any, ...], select_args: tuple[Any, ...]
) -> tuple[bool, Sequence[Any] | None]:
    # Runs on the connection's thread: insert, and on conflict read, in one hop.
    if conn.execute(SQLITE["claim"].sql, insert_args).fetchone() is not None:
        return True, None
    return False, conn.execute(SQLITE["select"].sql, select_args).fetchone()


def _sqlite_rowcount(conn: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> int:
    return conn.execute(sql, args).rowcount


def _settle(answers: list[_Answer]) -> None:
    # On the event loop. A waiter that was cancelled has stopped listening; its
    # statement ran (or not) all the same, as any statement already sent does.
    for future, ok, value in answers:
        _settle_one(future, ok, value)


def _settle_one(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if not future.done():
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def _answer_one(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits now
        future.get_loop().call_soon_threadsafe(_settle_one, future, ok, value)


def _answer(answers: list[_Answer]) -> None:
    # On the thread: one wake-up per event loop for every answer ready at once.
    by_loop: dict[asyncio.AbstractEventLoop, list[_Answer]] = {}
    for answer in answers:
        by_loop.setdefault(answer[0].get_loop(), []).append(answer)
    for loop, some in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits now
            loop.call_soon_threadsafe(_settle, some)


class ConnectionThread:
    """One ``sqlite3`` connection, opened, used and closed by one thread of its own.

    :meth:`_execute` queues a function for the thread and awaits its result (the
    names ``_execute`` and ``_conn`` are aiosqlite's, whose connection this replaced;
    ``tests/stores/test_round_trips.py`` counts hops through them). The thread takes
    whatever is queued, runs it, and answers through ``loop.call_soon_threadsafe``.
    With ``batch``, jobs queued together run in one ``BEGIN IMMEDIATE`` transaction.

    Args:
        connect: opens the connection; called on the thread.
        batch: run jobs queued together in one transaction (see :meth:`_run_batch`).
        max_batch: at most this many jobs in one transaction.
    """

    def __init__(
        self,
        connect: Callable[[], sqlite3.Connection],
        *,
        batch: bool = True,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._connect = connect
        self._batch = batch
        self._max_batch = max_batch
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._conn: sqlite3.Connection | None = None
        self._open = False
        # Held to queue a job and to stop taking them, so that none is queued unanswered.
        self._gate = threading.Lock()
        # A daemon, so that a store never closed does not keep the interpreter from exiting
        # (every answered statement has committed).
        self.thread = threading.Thread(
            target=self._serve, name="asgi-idempotency-sqlite", daemon=True
        )

    @property
    def alive(self) -> bool:
        """Whether the connection is open and its thread takes jobs."""
        return self._open

    async def start(self) -> None:
        """Start the thread and open the connection on it (raises what ``connect`` raises)."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._jobs.put((ready, _nothing, ()))  # answered once the connection is open
        self._open = True
        self.thread.start()
        try:
            await ready
        except BaseException:
            self._open = False
            # Cancelled while it was connecting: once connected, it closes again.
            self._jobs.put((asyncio.get_running_loop().create_future(), _close, ()))
            raise

    async def _execute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the connection's thread and return what it returns."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._gate:
            if not self._open:
                raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
            self._jobs.put((future, fn, args))
        return await future

    async def close(self) -> None:
        """Run what is queued, close the connection, and join the thread."""
        if self._open:
            with self._gate:
                self._open = False
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._jobs.put((done, _close, ()))
            try:
                await asyncio.shield(done)
            finally:
                self.thread.join()  # it has answered its last job: it returns at once
        elif self.thread.is_alive():  # it stopped on a broken connection
            self.thread.join()

    # On the thread.

    def _serve(self) -> None:
        first_future, _, _ = self._jobs.get()
        try:
            conn = self._conn = self._connect()
        except BaseException as exc:
            _answer([(first_future, False, exc)])
            self._stop(exc)
            return
        _answer([(first_future, True, None)])
        jobs = self._jobs
        while True:
            job = jobs.get()
            if jobs.empty() and job[1] is not _close:  # one at a time: the short way
                _answer_one(*_run_one(job))
                continue
            batch = [job]
            while len(batch) < self._max_batch:  # and whatever else is queued already
                try:
                    batch.append(jobs.get_nowait())
                except queue.Empty:
                    break
            closing = next((i for i, job in enumerate(batch) if job[1] is _close), None)
            work = batch if closing is None else batch[:closing]
            if self._batch and len(work) > 1:
                if not self._run_batch(conn, work):
                    return
            else:
                for job in work:
                    _answer_one(*_run_one(job))
            if closing is not None:
                conn.close()
                _answer([_run_one(batch[closing])])
                return

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Job]) -> bool:
        """Run ``batch`` in one transaction, answered after it commits; False if broken.

        When a statement fails, the transaction rolls back and every job runs again
        on its own, so a statement fails only its own request. When BEGIN or COMMIT
        fails, nothing of the batch stays written and every job gets that error.
        """
        answers: list[_Answer] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
        except BaseException as exc:
            _answer([(f, False, exc) for f, _, _ in batch])
            return True
        try:
            for job in batch:
                answers.append(_run_one(job))
                if not answers[-1][1]:
                    break
            else:
                conn.execute("COMMIT")
                _answer(answers)
                return True
            failure = None
        except BaseException as exc:  # COMMIT
            failure = exc
        try:
            if conn.in_transaction:  # some errors (SQLITE_FULL, IOERR) roll back by themselves
                conn.execute("ROLLBACK")
        except BaseException as exc:
            # Unknown state: closing the connection rolls back for certain.
            conn.close()
            _answer([(f, False, exc) for f, _, _ in batch])
            self._stop(exc)
            return False
        if failure is not None:
            _answer([(f, False, failure) for f, _, _ in batch])
        else:
            for job in batch:
                _answer_one(*_run_one(job))
        return True

    def _stop(self, exc: BaseException) -> None:
        # Take no more jobs, and answer what was queued with the error.
        with self._gate:
            self._open = False
        while True:
            try:
                future, _, _ = self._jobs.get_nowait()
            except queue.Empty:
                return
            _answer_one(future, False, exc)


def _nothing() -> None:
    return None


def _close() -> None:
    return None  # a marker: the thread closes the connection, then answers this job


def _run_one(job: _Job) -> _Answer:
    future, fn, args = job
    if future.cancelled():
        # Its waiter went away before the statement was sent: it is not sent (a claim
        # run now would leave a row that nobody owns until its lease runs out).
        return future, True, None
    try:
        return future, True, fn(*args)
    except BaseException as exc:
        return future, False, exc


class SQLiteDriver:
    """The SQLite hot path: one :class:`ConnectionThread`, opened on first use, in autocommit.

    Args:
        engine: the store's engine; its URL says which database file to open.
        timeout: seconds a statement waits for the database lock before failing
            (sqlite3's ``timeout``, and ``busy_timeout`` through :func:`pragmas`).
        batch: run operations queued together in one transaction.
        max_batch: at most this many operations in one transaction.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        timeout: float = 5.0,
        batch: bool = False,
        max_batch: int = MAX_BATCH,
    ) -> None:
        args, kwargs = engine.dialect.create_connect_args(engine.url)
        self._database: str = args[0]
        self._kwargs: dict[str, Any] = {
            **kwargs,
            "timeout": timeout,
            "isolation_level": None,  # autocommit: sqlite3 opens no transaction of its own
            "check_same_thread": True,  # the connection never leaves its thread
        }
        self._timeout = timeout
        self._batch = batch
        self._max_batch = max_batch
        self._thread: ConnectionThread | None = None
        self._lock = asyncio.Lock()

    def _open(self) -> sqlite3.Connection:
        conn: sqlite3.Connection = sqlite3.connect(self._database, **self._kwargs)
        try:
            pragmas(self._timeout)(conn, None)
        except BaseException:
            conn.close()
            raise
        return conn

    async def _connection(self) -> ConnectionThread:
        thread = self._thread
        if thread is None or not thread.alive:
            async with self._lock:
                if self._thread is None or not self._thread.alive:
                    if self._thread is not None:  # stopped on a broken connection
                        await self._thread.close()
                    fresh = ConnectionThread(
                        self._open, batch=self._batch, max_batch=self._max_batch
                    )
                    await fresh.start()
                    self._thread = fresh
                thread = self._thread
        return thread

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            conn = self._thread
            if conn is None or not conn.alive:
                conn = await self._connection()
            return await conn._execute(fn, conn._conn, *args)
        except SQLITE_ERRORS.errors as exc:
            if SQLITE_ERRORS.breaks(exc) and self._thread is not None:
                broken, self._thread = self._thread, None
                await broken.close()
            raise SQLITE_ERRORS.translate(exc) from exc

    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        return await self._run(
            _sqlite_claim,
            SQLITE["claim"].args(values),
            SQLITE["select"].args(values),
        )

    async def rowcount(self, name: str, values: dict[str, Any]) -> int:
        stmt = SQLITE[name]
        return await self._run(_sqlite_rowcount, stmt.sql, stmt.args(values))

    async def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            await thread.close()


class EngineSQLiteDriver:
    """The hot path's statements through the engine: for an in-memory database only.

    A second connection to ``:memory:`` would open a second, empty database, so the
    statements run on the engine's own connection, through Core's public API.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine.execution_options(isolation_level="AUTOCOMMIT")

    async def claim(self, values: dict[str, Any]) -> tuple[bool, Sequence[Any] | None]:
        with SQLITE_ERRORS:
            async with self._engine.connect() as conn:
                claim = SQLITE["claim"]
                if (await conn.exec_driver_sql(claim.sql, claim.args(values))).first():
                    return True, None
                select = SQLITE["select"]
                row = (await conn.exec_driver_sql(select.sql, select.args(values))).first()
                return False, None if row is None else tuple(row)

    async def rowcount(self, name: str, values: dict[str, Any]) -> int:
        stmt = SQLITE[name]
        with SQLITE_ERRORS:
            async with self._engine.connect() as conn:
                return (await conn.exec_driver_sql(stmt.sql, stmt.args(values))).rowcount

    async def close(self) -> None:
        return None


def sqlite_driver(
    engine: AsyncEngine, *, timeout: float, batch: bool, max_batch: int = MAX_BATCH
) -> SQLiteDriver | EngineSQLiteDriver:
    """The hot path for ``engine``'s database: a connection thread, unless it is in memory."""
    args, kwargs = engine.dialect.create_connect_args(engine.url)
    database = str(args[0])
    in_memory = database == ":memory:" or (
        bool(kwargs.get("uri"))
        and ("mode=memory" in database or database.startswith("file::memory:"))
    )
    if in_memory:
        return EngineSQLiteDriver(engine)
    return SQLiteDriver(engine, timeout=timeout, batch=batch, max_batch=max_batch)


def pragmas(timeout: float) -> Callable[[Any, Any], None]:
    """The connect hook (SQLAlchemy's ``connect`` event) that sets up each connection.

    Args:
        timeout: seconds a statement waits for the write lock (``busy_timeout``):
            the store's ``command_timeout``, so that a locked database answers 503
            after the time the user configured.
    """
    busy_ms = max(1, round(timeout * 1000))

    def set_pragmas(dbapi_connection: Any, _record: Any) -> None:
        # WAL lets readers run beside the one writer; busy_timeout makes concurrent
        # workers wait for the write lock instead of failing with "database is locked".
        # It replaces the handler sqlite3's own ``timeout`` set, so it is the one wait.
        # The busy timeout first: switching a fresh file to WAL needs the lock too.
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return set_pragmas


async def _create_schema(
    engine: AsyncEngine, autocommit: AsyncEngine, command_timeout: float
) -> None:
    # Workers starting together queue for the write lock below: load what stamping the
    # head needs (alembic, the migration scripts) before taking it, not while the
    # others wait.
    from asgi_idempotency.migrations import warm

    await asyncio.to_thread(warm)
    # pysqlite opens no transaction for DDL, and a deferred one would let two workers
    # both see no table: take SQLite's write lock first (busy timeout).
    async with autocommit.connect() as conn:
        await conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            await conn.run_sync(create_tables)
        except BaseException:
            await conn.exec_driver_sql("ROLLBACK")
            raise
        await conn.exec_driver_sql("COMMIT")


def _hot_path(engine: AsyncEngine, options: HotPathOptions) -> HotPath:
    return sqlite_driver(
        engine, timeout=options.timeout, batch=options.batching, max_batch=options.max_batch
    )


def _engine_options(command_timeout: float, pool_size: int) -> dict[str, Any]:
    return {"connect_args": {"timeout": command_timeout}}


def _configure_engine(engine: AsyncEngine, command_timeout: float) -> None:
    event.listen(engine.sync_engine, "connect", pragmas(command_timeout))


DIALECT = SQLDialect(
    label="SQLite",
    driver="aiosqlite",
    errors=SQLITE_ERRORS,
    time=sqlite_time,
    clock=None,  # one host: the caller's clock
    hot_path=_hot_path,
    engine_options=_engine_options,
    configure_engine=_configure_engine,
    create_schema=_create_schema,
    prune=prune_by_key,
    embedded=True,
    # One writer at a time: operations queued behind the lock share its transaction.
    batching=True,
    can_batch=True,
)

"""Support for the reliability suite: a loopback TCP proxy the test controls, a DB probe."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from asgi_idempotency import SQLStore
from asgi_idempotency.stores.codec import as_time

T = TypeVar("T")


class TcpProxy:
    """A loopback TCP proxy to one upstream, on an event loop in a thread of its own.

    A thread, not the test's loop, so that synchronous callers (``run_uvicorn``'s
    readiness probe) and blocking drivers cannot starve it. Modes:

    - ``forward``: pipe bytes both ways;
    - ``down``: every open connection is reset and new ones are accepted then reset
      (the database is gone);
    - ``stall``: connections stay open but nothing is forwarded either way, and new
      ones are accepted and never answered (the database hangs).

    :meth:`lose_next_answer`: the next request a client sends (on any connection) is
    forwarded and runs, and nothing the server sends on that connection afterwards
    reaches the client (``answers_lost`` counts what was swallowed): the test then
    breaks the connection for real (``KILL``, ``CLIENT KILL``), after the statement
    landed and before its client heard so.

    ``round_trips`` counts client turns on the wire: data from the client after the
    server last spoke (or first on a connection). One prepared statement already
    cached on its connection is one turn, whatever the code above the driver does.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode = "forward"
        self.accepted = 0
        self.round_trips = 0
        self.answers_lost = 0
        self._lose_next = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tcp-proxy", daemon=True
        )
        self._thread.start()
        self._server: asyncio.Server = self._call(
            asyncio.start_server(self._handle, "127.0.0.1", 0)
        )
        self.port: int = self._server.sockets[0].getsockname()[1]

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout=10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            if self.mode == "down":
                return
            if self.mode == "stall":
                while await reader.read(65536):
                    pass
                return
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            self._writers.add(up_writer)
            turn = ["server"]  # whose data went through last, on this connection
            lost = [False]  # whether the server's answers on it go nowhere
            await asyncio.gather(
                self._pipe(reader, up_writer, turn, "client", lost),
                self._pipe(up_reader, writer, turn, "server", lost),
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.transport.abort()
            self._tasks.discard(task)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        turn: list[str],
        side: str,
        lost: list[bool],
    ) -> None:
        try:
            while data := await reader.read(65536):
                if self.mode != "forward":
                    continue  # stalled: swallow, never deliver
                if side == "client" and self._lose_next:
                    self._lose_next, lost[0] = False, True
                elif side == "server" and lost[0]:
                    self.answers_lost += 1
                    continue
                if side == "client" and turn[0] != "client":
                    self.round_trips += 1
                turn[0] = side
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()

    async def _reset_all(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()
        await asyncio.sleep(0)

    def cut(self) -> None:
        """The database goes away: reset every connection, refuse to forward new ones."""
        self.mode = "down"
        self._call(self._reset_all())

    def stall(self) -> None:
        """The database hangs: connections stay open and nothing comes back."""
        self.mode = "stall"

    def lose_next_answer(self) -> None:
        """Swallow every answer to the next request a client sends (see the class)."""
        self._lose_next = True

    def restore(self) -> None:
        """The database is back. Stalled connections carry half-delivered traffic: reset them."""
        was = self.mode
        self.mode = "forward"
        if was == "stall":
            self._call(self._reset_all())

    async def _shutdown(self) -> None:
        self._server.close()
        await self._reset_all()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        await self._server.wait_closed()

    def close(self) -> None:
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def url_for(self, url: str) -> str:
        """``url`` with its host and port pointed at this proxy."""
        return (
            make_url(url)
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )


@dataclass(frozen=True)
class RecordRow:
    status: str
    locked_until: datetime
    response_status: int | None


class Probe:
    """Reads the database (Postgres or MariaDB) directly, to check what the rows say."""

    def __init__(self, store: SQLStore) -> None:
        self.store = store

    async def records(self) -> list[RecordRow]:
        async with self.store.engine.connect() as conn:
            result = await conn.execute(
                text("SELECT status, locked_until, response_status FROM idempotency_records")
            )
            # Aware whatever the database: MariaDB's DATETIME(6) reads back naive (UTC).
            return [RecordRow(r.status, as_time(r.locked_until), r.response_status) for r in result]

    async def refunds(self) -> list[tuple[str, str, int]]:
        """(id, order_id, amount) of every refund the demo recorded."""
        async with self.store.engine.connect() as conn:
            result = await conn.execute(text("SELECT id, order_id, amount FROM demo_refunds"))
            return [(r.id, r.order_id, r.amount) for r in result]

    async def wait_for(
        self, what: str, predicate: Callable[[], Awaitable[T]], *, within: float = 10.0
    ) -> T:
        """Poll ``predicate()`` (async) until truthy; fail after ``within`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            value = await predicate()
            if value:
                return value
            if loop.time() > deadline:
                pytest.fail(f"timed out after {within}s waiting for {what}")
            await asyncio.sleep(0.02)


def demo_env(url: str, *, lease: float | None = None) -> dict[str, str]:
    """Environment for ``asgi_idempotency.ops.demo:app`` on ``url``."""
    env = {"IDEMPOTENCY_DEMO_DATABASE_URL": url}
    if lease is not None:
        env["IDEMPOTENCY_DEMO_LEASE"] = str(lease)
    return env


DEMO = "asgi_idempotency.ops.demo:app"
SHARED_LEASE = 1.0  # seconds: the lease of the suite's shared demo servers


async def close_bounded(store: SQLStore, proxy: TcpProxy | None = None) -> None:
    """Dispose ``store`` without hanging the suite: heal the proxy first, bound the close."""
    if proxy is not None:
        proxy.restore()  # a stalled link would make a graceful close wait forever
    await asyncio.wait_for(store.close(), 10)

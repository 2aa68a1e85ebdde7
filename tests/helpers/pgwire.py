"""Count Postgres round trips on the wire: a loopback TCP proxy that reads the frontend protocol.

Every round trip a client waits for ends in one message from it: ``Sync`` for the
extended protocol (Parse/Bind/Execute ... Sync), ``Query`` for the simple protocol
(how drivers send BEGIN and COMMIT). So counting those two messages counts round
trips, whatever the driver or library above does, and the statement texts seen in
``Parse``/``Query`` (and the statements named in ``Bind``) tell what each one ran.

Used by ``bench.run`` (the round-trip column) and ``tests/stores/test_round_trips.py``.
Connect through it without TLS (``?ssl=disable``) so that the stream is readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field
from typing import Self

__all__ = ["LoopbackProxy", "RoundTrip", "WireCounter"]

_SSL_REQUEST = 80877103
_GSS_REQUEST = 80877104
_CANCEL_REQUEST = 80877102


@dataclass
class RoundTrip:
    """One client wait: the statements it executed (``executed``) and prepared (``prepared``)."""

    executed: list[str] = field(default_factory=list)
    prepared: list[str] = field(default_factory=list)

    @property
    def verbs(self) -> list[str]:
        """First word of each executed statement, upper-cased: ``WITH``, ``UPDATE``, ``BEGIN``..."""
        return [s.split(None, 1)[0].rstrip(";").upper() if s.strip() else "" for s in self.executed]


class _Session:
    def __init__(self, counter: WireCounter) -> None:
        self.counter = counter
        self.buf = bytearray()
        self.startup = True
        self.statements: dict[str, str] = {}
        self.current = RoundTrip()

    def feed(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.startup:
                if len(self.buf) < 8:
                    return
                (length,) = struct.unpack_from("!i", self.buf, 0)
                if len(self.buf) < length:
                    return
                (code,) = struct.unpack_from("!i", self.buf, 4)
                del self.buf[:length]
                if code not in (_SSL_REQUEST, _GSS_REQUEST, _CANCEL_REQUEST):
                    self.startup = False  # the StartupMessage: typed messages follow
                continue
            if len(self.buf) < 5:
                return
            kind = chr(self.buf[0])
            (length,) = struct.unpack_from("!i", self.buf, 1)
            if len(self.buf) < 1 + length:
                return
            body = bytes(self.buf[5 : 1 + length])
            del self.buf[: 1 + length]
            self._message(kind, body)

    def _message(self, kind: str, body: bytes) -> None:
        if kind == "P":  # Parse: name, query
            name, query = body.split(b"\x00", 2)[:2]
            text = query.decode("utf-8", "replace")
            self.statements[name.decode()] = text
            self.current.prepared.append(text)
        elif kind == "B":  # Bind: portal, statement name
            statement = body.split(b"\x00", 2)[1].decode()
            self.current.executed.append(self.statements.get(statement, "?"))
        elif kind == "Q":  # simple query: a round trip of its own
            self.current.executed.append(body.rstrip(b"\x00").decode("utf-8", "replace"))
            self._end()
        elif kind == "S":  # Sync: the client now waits for the server
            self._end()

    def _end(self) -> None:
        self.counter.trips.append(self.current)
        self.current = RoundTrip()


class LoopbackProxy:
    """A TCP server on a free loopback port in front of ``upstream``: ``async with`` it,
    then connect to ``127.0.0.1:proxy.port``. Each client connection is served by
    :meth:`_serve` in a task of its own; leaving the block stops them all."""

    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        await self._server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._tasks.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class WireCounter(LoopbackProxy):
    """``async with WireCounter(port=5432) as wc:`` then connect to ``127.0.0.1:wc.port``.

    ``wc.trips`` lists every round trip since start or the last :meth:`reset`.
    """

    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432) -> None:
        super().__init__(upstream_host, upstream_port)
        self.trips: list[RoundTrip] = []

    def reset(self) -> list[RoundTrip]:
        """Return the round trips so far and start counting afresh."""
        trips, self.trips = self.trips, []
        return trips

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = _Session(self)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, parse: bool) -> None:
            try:
                while data := await src.read(65536):
                    if parse:
                        session.feed(data)
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

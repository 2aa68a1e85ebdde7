"""Network faults between a Postgres client and a real server: a loopback TCP proxy.

``async with FaultProxy(host, port) as proxy:`` then connect to ``127.0.0.1:proxy.port``
without TLS (``?ssl=disable``). What it can do to the traffic, each switched by the test:

- ``drop_cancels``: a cancel request (the separate connection a driver opens to abandon
  a running statement) is swallowed, as when it arrives too late: the statement the
  client gave up on runs on.
- :meth:`cut_after`: the next execution of a statement whose text contains a marker is
  forwarded, the server's whole answer (up to ReadyForQuery: it has committed) is
  swallowed, and the client's connection is then closed. The client sees a broken
  connection for a statement that did land.

Nothing of Postgres is imitated: the server is real, only the wire between is faulty.
"""

from __future__ import annotations

import asyncio
import struct

from tests.helpers.pgwire import LoopbackProxy

__all__ = ["FaultProxy"]

_CANCEL_REQUEST = 80877102


class FaultProxy(LoopbackProxy):
    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432) -> None:
        super().__init__(upstream_host, upstream_port)
        self.drop_cancels = False
        self.cancels_dropped = 0
        self.cuts = 0  # statements whose answer was swallowed and connection cut
        self._cut_marker: str | None = None

    def cut_after(self, marker: str) -> None:
        """Cut the connection of the next statement containing ``marker``, after it ran."""
        self._cut_marker = marker

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(8)
            (code,) = struct.unpack_from("!i", head, 4)
            if code == _CANCEL_REQUEST and self.drop_cancels:
                self.cancels_dropped += 1
                writer.close()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                writer.close()
                return
            (length,) = struct.unpack_from("!i", head, 0)
            up_writer.write(head + await reader.readexactly(length - 8))
            await _Link(self, reader, writer, up_reader, up_writer).run()
        except (OSError, asyncio.IncompleteReadError):
            writer.close()


class _Link:
    """One client connection, its startup packet forwarded: typed messages either way."""

    def __init__(
        self,
        proxy: FaultProxy,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        self.proxy = proxy
        self.reader, self.writer = reader, writer
        self.up_reader, self.up_writer = up_reader, up_writer
        self.statements: dict[bytes, str] = {}
        self.swallow = False  # the server's answer goes nowhere; then the client is cut

    async def run(self) -> None:
        try:
            await asyncio.gather(self._from_client(), self._from_server())
        finally:
            self.writer.close()
            self.up_writer.close()

    async def _from_client(self) -> None:
        reader = self.reader
        while True:
            kind = await reader.readexactly(1)
            length = await reader.readexactly(4)
            body = await reader.readexactly(struct.unpack("!i", length)[0] - 4)
            self._inspect(kind, body)
            self.up_writer.write(kind + length + body)
            await self.up_writer.drain()

    def _inspect(self, kind: bytes, body: bytes) -> None:
        marker = self.proxy._cut_marker
        if kind == b"P":  # Parse: statement name, query text
            name, query = body.split(b"\x00", 2)[:2]
            self.statements[name] = query.decode("utf-8", "replace")
        elif kind == b"B" and marker is not None:  # Bind: portal, statement name
            name = body.split(b"\x00", 2)[1]
            if marker in self.statements.get(name, ""):
                self.proxy._cut_marker = None
                self.swallow = True

    async def _from_server(self) -> None:
        reader = self.up_reader
        while True:
            kind = await reader.readexactly(1)
            length = await reader.readexactly(4)
            body = await reader.readexactly(struct.unpack("!i", length)[0] - 4)
            if kind == b"Z" and self.swallow:  # ReadyForQuery
                # The statement ran to its end (committed, in autocommit); the client
                # never hears so: its connection breaks instead.
                self.proxy.cuts += 1
                self.writer.transport.abort()
                return
            if self.swallow:
                continue
            self.writer.write(kind + length + body)
            await self.writer.drain()

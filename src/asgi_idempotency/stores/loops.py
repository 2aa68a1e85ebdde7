"""Stores on successive event loops: connections opened per loop, and closed on their loop.

A connection of asyncpg, redis-py or aiosqlite belongs to the event loop that opened
it: its socket is that loop's, and used from another loop it fails ("Event loop is
closed", "attached to a different loop"). Starlette's ``TestClient`` used without
``with``, as FastAPI's documentation shows it, runs every request on an event loop of
its own, closed once the request is answered; so may a script that calls
``asyncio.run`` twice. A store therefore keeps its pool or client per loop: each call
compares the running loop with the loop of its connections (one identity check), and
on a new loop opens a fresh pool or client there.

The old connections cannot be closed from the new loop (a closed loop runs nothing,
and asyncio has no public way to close a transport whose loop is closed: left to the
garbage collector, each says ``ResourceWarning: unclosed transport``). So they are
closed *on* their own loop as it shuts down: a :class:`LoopTenure` is an asynchronous
generator registered with that loop, whose ``finally`` closes them when the loop runs
``shutdown_asyncgens()``, as ``asyncio.run``, ``asyncio.Runner``, ``anyio.run`` (and
so ``TestClient``'s portal), uvicorn and pytest's async plugins do before closing a
loop. A loop closed without that step leaves them to the garbage collector. Two loops
that use one store at the same time, from two threads, are not supported.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

__all__ = ["LoopTenure"]


async def _until_shutdown(close: Callable[[], Awaitable[None]]) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await close()


class LoopTenure:
    """What a store opened on the running loop, closed by ``close`` when that loop shuts down.

    Made on the loop it belongs to (``loop``); :meth:`end` closes it earlier, on that loop
    (the store's ``close()``).
    """

    __slots__ = ("_gen", "loop")

    def __init__(self, close: Callable[[], Awaitable[None]]) -> None:
        self.loop = asyncio.get_running_loop()
        self._gen = _until_shutdown(close)
        # The generator's first step, taken here: asking for it is what hands the
        # generator to the running loop's first-iteration hook (the loop then keeps it,
        # weakly, for shutdown_asyncgens), and nothing before its yield awaits, so the
        # step completes at once without a loop pass. The store keeps the tenure alive.
        step = self._gen.asend(None)
        try:
            step.send(None)
        except StopIteration:
            return
        raise AssertionError("the tenure's first step awaited")  # pragma: no cover

    async def end(self) -> None:
        """Close what the tenure holds now (on its own loop); shutdown then finds it closed."""
        await self._gen.aclose()

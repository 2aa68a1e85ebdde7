"""The event loop of a guard's synchronous calls: a daemon thread of its own, because a
store serves one event loop at a time (:mod:`.stores.loops`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["LoopThread", "settled"]

T = TypeVar("T")


class LoopThread:
    """An event loop in a daemon thread, for the store calls of synchronous functions."""

    def __init__(self) -> None:
        started: Future[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = Future()
        self.thread = threading.Thread(
            target=self._run, args=(started,), name="asgi-idempotency-once", daemon=True
        )
        self.thread.start()
        self.loop, self._stop = started.result()

    def _run(self, started: Future[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
        # asyncio.Runner's close cancels what is left and runs shutdown_asyncgens, where
        # the stores close the connections they opened on this loop (stores/loops.py).
        with asyncio.Runner() as runner:
            runner.run(self._serve(started))

    async def _serve(
        self, started: Future[tuple[asyncio.AbstractEventLoop, asyncio.Event]]
    ) -> None:
        stop = asyncio.Event()
        started.set_result((asyncio.get_running_loop(), stop))
        await stop.wait()

    def submit(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join()


def settled(
    loop: asyncio.AbstractEventLoop, unheard: Callable[[T], None], answer: Future[T]
) -> None:
    # Any thread: the answer settles on the guard's loop, or had already.
    if not answer.cancelled() and answer.exception() is None:
        loop.call_soon_threadsafe(unheard, answer.result())

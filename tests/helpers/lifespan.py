"""An app served in process after its lifespan startup, as uvicorn would start it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
import pytest

__all__ = ["StartupFailed", "refuses", "served", "start"]


async def start(app: Any) -> tuple[dict[str, Any], Callable[[], Awaitable[None]]]:
    """Send ``lifespan.startup``; return the first answer and a function that shuts down."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.create_task(app(scope, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    answer = await asyncio.wait_for(outbox.get(), 10)

    async def stop() -> None:
        if not task.done():
            await inbox.put({"type": "lifespan.shutdown"})
        if answer["type"] != "lifespan.startup.failed":
            await asyncio.wait_for(task, 10)
            return
        # A failed startup also raises its reason from the app, as Starlette's own does;
        # the reason is the answer's message.
        with suppress(Exception):
            await asyncio.wait_for(task, 10)

    return answer, stop


@asynccontextmanager
async def served(
    app: Any, base_url: str = "http://shop.example"
) -> AsyncIterator[httpx.AsyncClient]:
    """The app after its lifespan startup, and a client; raises if startup failed."""
    answer, stop = await start(app)
    if answer["type"] != "lifespan.startup.complete":
        await stop()
        raise StartupFailed(answer.get("message", ""))
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as c:
            yield c
    finally:
        await stop()


class StartupFailed(Exception):
    pass


async def refuses(app: Any) -> str:
    with pytest.raises(StartupFailed) as failed:
        async with served(app):
            pass
    return str(failed.value)

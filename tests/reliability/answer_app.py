"""A FastAPI app served by real uvicorn for the answer tests: BackgroundTasks and streams.

``EFFECTS`` names a file each handler run appends a line to (several processes may
serve it); ``STORE_URL`` the store's SQLAlchemy URL.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import BackgroundTasks, FastAPI
from fastapi.responses import StreamingResponse

from asgi_idempotency import IdempotencyMiddleware, SQLStore, idempotent
from asgi_idempotency.http.principals import ANONYMOUS

EFFECTS = Path(os.environ["EFFECTS"])

app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware, store=SQLStore(os.environ["STORE_URL"]), principal=ANONYMOUS
)


def effect(name: str) -> int:
    with EFFECTS.open("a") as f:
        f.write(name + "\n")
    return len(EFFECTS.read_text().splitlines())


async def slow_failing_task() -> None:
    await asyncio.sleep(3)
    raise RuntimeError("the e-mail server is down")  # after the answer: changes nothing


@app.get("/refunds/count")
def count() -> dict[str, int]:  # sync: FastAPI runs it in a thread
    return {"n": len(EFFECTS.read_text().splitlines()) if EFFECTS.exists() else 0}


@app.post("/orders", status_code=201)
@idempotent(required=True)
async def order(tasks: BackgroundTasks) -> dict[str, int]:
    n = effect("order")
    tasks.add_task(slow_failing_task)
    return {"order": n}


@app.post("/events")
async def events() -> StreamingResponse:
    effect("events")

    async def produce() -> AsyncIterator[bytes]:
        for i in range(4):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.5)

    return StreamingResponse(produce(), media_type="text/event-stream")

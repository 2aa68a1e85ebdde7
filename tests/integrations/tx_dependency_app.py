"""The README's wiring in transactional mode, served by a real uvicorn for the SIGKILL test.

``from_dependency`` names the caller from an API key; the handler writes its refund
through ``get_session`` and then waits ``after`` seconds before answering: the window a
crash hits, after touching the file ``IDEMPOTENCY_TEST_WRITTEN`` names. The database URL
comes from ``IDEMPOTENCY_TEST_TX_URL``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi.security import APIKeyHeader
from pydantic import BaseModel
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from asgi_idempotency import IdempotencyMiddleware, SQLStore, idempotent
from asgi_idempotency.integrations.transactional import get_session
from asgi_idempotency.ops.demo import refunds
from asgi_idempotency.principals import from_dependency

API_KEYS = {"key-acme": "acme"}


def current_client(key: Annotated[str, Depends(APIKeyHeader(name="X-API-Key"))]) -> str:
    if key not in API_KEYS:
        raise HTTPException(401, "unknown API key")
    return API_KEYS[key]


class RefundIn(BaseModel):
    amount: int
    after: float = 0


app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    store=SQLStore(os.environ["IDEMPOTENCY_TEST_TX_URL"]),
    principal=from_dependency(current_client),
)


@app.post("/orders/{order_id}/refunds", status_code=201)
@idempotent(required=True, transactional=True)
async def refund(
    order_id: str,
    body: RefundIn,
    client: Annotated[str, Depends(current_client)],
    session: Annotated[AsyncSession, Depends(get_session)],
) -> dict[str, Any]:
    refund_id = str(uuid.uuid4())
    await session.execute(insert(refunds).values(id=refund_id, order_id=order_id,
                                                 amount=body.amount))  # fmt: skip
    await session.flush()
    await asyncio.to_thread(Path(os.environ["IDEMPOTENCY_TEST_WRITTEN"]).touch)
    await asyncio.sleep(body.after)  # the refund is written, not yet committed
    return {"refund_id": refund_id, "client": client}

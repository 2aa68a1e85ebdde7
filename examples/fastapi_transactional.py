"""Transactional mode: the refund row and the idempotency record commit together.

``IDEMPOTENCY_DATABASE_URL=postgresql+asyncpg://... uvicorn examples.fastapi_transactional:app``
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI
from pydantic import BaseModel
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from asgi_idempotency import IdempotencyMiddleware, SQLStore, idempotent
from asgi_idempotency.ops.demo import demo_metadata, refunds
from asgi_idempotency.principals import ANONYMOUS
from asgi_idempotency.transactional import get_session

store = SQLStore(
    os.environ.get("IDEMPOTENCY_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1/postgres")
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    await store.create_all()
    async with store.engine.begin() as conn:
        await conn.run_sync(demo_metadata.create_all)
    yield
    await store.close()


app = FastAPI(lifespan=lifespan)
# No auth in this example: one caller. An app with users passes a principal that
# names them from the request (from_user(), from_session(...), from_headers(...)).
app.add_middleware(IdempotencyMiddleware, store=store, principal=ANONYMOUS)


class RefundIn(BaseModel):
    amount: int


@app.post("/orders/{order_id}/refunds", status_code=201)
@idempotent(required=True, transactional=True)
async def refund(
    order_id: int, body: RefundIn, session: Annotated[AsyncSession, Depends(get_session)]
) -> dict[str, object]:
    refund_id = str(uuid.uuid4())
    # Written in the same transaction as the idempotency record: both commit, or neither.
    await session.execute(
        insert(refunds).values(id=refund_id, order_id=str(order_id), amount=body.amount)
    )
    return {"refund_id": refund_id, "amount": body.amount}

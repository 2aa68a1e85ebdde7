"""The README's FastAPI example, runnable: ``uvicorn examples.fastapi_refunds:app``."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from fastapi import FastAPI
from pydantic import BaseModel

from asgi_idempotency import IdempotencyMiddleware, SQLStore, idempotent

store = SQLStore(os.environ.get("IDEMPOTENCY_DATABASE_URL", "sqlite+aiosqlite:///./refunds.db"))


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    await store.create_all()  # in production: `asgi-idempotency migrate`
    yield
    await store.close()


app = FastAPI(lifespan=lifespan)
app.add_middleware(IdempotencyMiddleware, store=store)


class RefundIn(BaseModel):
    amount: int


class RefundOut(BaseModel):
    refund_id: str
    order_id: int
    amount: int


@app.post("/orders/{order_id}/refunds", status_code=201)
@idempotent(required=True, ttl=timedelta(hours=24))
async def refund(order_id: int, body: RefundIn) -> RefundOut:
    # Runs once per Idempotency-Key; retries get this response replayed.
    return RefundOut(refund_id=str(uuid.uuid4()), order_id=order_id, amount=body.amount)

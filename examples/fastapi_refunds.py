import asyncio
import uuid
from datetime import timedelta

from fastapi import FastAPI
from pydantic import BaseModel

from asgi_idempotency import IdempotencyMiddleware, SQLStore, idempotent

store = SQLStore("sqlite+aiosqlite:///./refunds.db")  # or postgresql+asyncpg://...
app = FastAPI()
app.add_middleware(IdempotencyMiddleware, store=store)


class RefundIn(BaseModel):
    amount: int


@app.post("/orders/{order_id}/refunds", status_code=201)
@idempotent(required=True, ttl=timedelta(hours=24))
async def refund(order_id: int, body: RefundIn) -> dict[str, object]:
    # Runs once per Idempotency-Key; every retry gets this response replayed,
    # and a retry that arrives while it still runs gets 409.
    await asyncio.sleep(1)  # stands in for the call to the payment provider
    return {"refund_id": str(uuid.uuid4()), "order_id": order_id, "amount": body.amount}

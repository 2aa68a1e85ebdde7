import asyncio
import uuid
from datetime import timedelta

from fastapi import Depends, FastAPI, HTTPException
from fastapi.security import APIKeyHeader
from pydantic import BaseModel

from asgi_idempotency import IdempotencyMiddleware, SQLStore, idempotent
from asgi_idempotency.principals import from_dependency

API_KEYS = {"key-acme-1": "acme", "key-globex-1": "globex"}  # stands in for your key store
api_key = APIKeyHeader(name="X-API-Key")


def current_client(key: str = Depends(api_key)) -> str:
    if key not in API_KEYS:
        raise HTTPException(401, "unknown API key")
    return API_KEYS[key]  # who the caller is: each client's keys are its own


store = SQLStore("sqlite+aiosqlite:///./refunds.db")  # or postgresql+asyncpg://...
app = FastAPI()
app.add_middleware(IdempotencyMiddleware, store=store, principal=from_dependency(current_client))


class RefundIn(BaseModel):
    amount: int


@app.post("/orders/{order_id}/refunds", status_code=201)
@idempotent(required=True, ttl=timedelta(hours=24))
async def refund(
    order_id: int, body: RefundIn, client: str = Depends(current_client)
) -> dict[str, object]:
    # Runs once per Idempotency-Key; every retry gets this response replayed,
    # and a retry that arrives while it still runs gets 409.
    await asyncio.sleep(1)  # stands in for the call to the payment provider
    return {"refund_id": str(uuid.uuid4()), "order_id": order_id, "amount": body.amount}

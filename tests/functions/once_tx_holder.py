"""A consumer process that runs a transactional :class:`Once` function and dies in it.

``python -m tests.functions.once_tx_holder URL`` handles one message: its function inserts the
refund through the session it is given, prints ``written``, then hangs until the test
SIGKILLs the process: the effect is written and not committed, as when a consumer dies
after its effect and before its acknowledgement.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.ops.demo import refunds

NAMESPACE = "tx-consumer"


def handler(once: Once, *, hang: bool) -> Any:
    @once(key=lambda msg: msg["id"], namespace=NAMESPACE, transactional=True)
    async def handle(msg: dict[str, Any], *, session: AsyncSession) -> dict[str, str]:
        await session.execute(insert(refunds).values(id=msg["id"], order_id="1", amount=5))
        if hang:
            print("written", flush=True)
            await asyncio.sleep(3600)  # killed here: written, not committed
        return {"refund": msg["id"]}

    return handle


async def main(url: str) -> None:
    store = SQLStore(url)
    await handler(Once(store), hang=True)({"id": "m-1"})


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))

"""A queue consumer that issues each refund once, however often its message is delivered.

Queues deliver at least once: a consumer that crashes, or only takes longer than the
broker's visibility timeout, gets its message delivered again, perhaps to another
worker while the first is still at work. Here two workers share a queue that delivers
every message twice; the guard, keyed by the message's own id, runs each refund once
and hands the second delivery the first one's result. Run it again and nothing is
issued: the results are kept for a day (``ttl``) and every delivery gets its own back.

    python -m examples.queue_consumer
"""

import asyncio
import os
from datetime import timedelta
from typing import Any

from asgi_idempotency import KeyReused, Once, SQLStore

store = SQLStore(os.environ.get("IDEMPOTENCY_DATABASE_URL", "sqlite+aiosqlite:///./refunds.db"))
# wait: a delivery that finds its twin still running waits for the twin's result.
once = Once(store, namespace="refunds", ttl=timedelta(days=1), wait=timedelta(seconds=30))
issued: list[str] = []  # stands in for the payment provider's ledger


@once(key=lambda msg: msg["id"])
async def issue_refund(msg: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(0.2)  # stands in for the call to the payment provider
    issued.append(msg["order"])
    return {"refund_id": f"rf-{msg['order']}", "amount_p": msg["amount_p"]}


async def worker(name: str, queue: "asyncio.Queue[dict[str, Any]]") -> None:
    while True:
        msg = await queue.get()
        try:
            result = await issue_refund(msg)
        except KeyReused:
            # Another message under the same id: a producer bug. Dead-letter it.
            print(f"{name}: {msg['id']} reuses an id with other content")
        else:
            print(f"{name}: {msg['id']} -> {result['refund_id']}")
        # Acknowledge. A failure (an exception) would not be acknowledged here: the
        # guard released the key, and the broker's redelivery runs the refund again.
        queue.task_done()


async def main() -> list[str]:
    await store.create_all()  # development; `asgi-idempotency migrate` in production
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for msg in [
        {"id": "msg-1", "order": "A-88214", "amount_p": 4500},
        {"id": "msg-2", "order": "A-88215", "amount_p": 1250},
    ]:
        queue.put_nowait(msg)
        queue.put_nowait(dict(msg))  # delivered again
    workers = [asyncio.create_task(worker(f"worker-{n}", queue)) for n in (1, 2)]
    await queue.join()
    for task in workers:
        task.cancel()
    await store.close()
    print(f"refunds issued: {issued}")
    return issued


if __name__ == "__main__":
    asyncio.run(main())

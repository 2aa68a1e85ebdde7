"""A RabbitMQ consumer (aio-pika) that issues each refund once, however often it is delivered.

python -m examples.rabbitmq_consumer
"""

import asyncio
import json
import os
from datetime import timedelta
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.integrations.rabbitmq import RabbitMQGuard, Undecodable

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
# Names of this example's own: its queue (declared, never deleted), its namespace and
# its SQLite file. The other examples use theirs, so each issues its own refunds.
QUEUE = os.environ.get("REFUNDS_QUEUE", "asgi-idempotency-example-rabbitmq")
DATABASE_URL = "sqlite+aiosqlite:///./rabbitmq_example.db"
store = SQLStore(os.environ.get("IDEMPOTENCY_DATABASE_URL", DATABASE_URL))
# The lease must be shorter than RabbitMQ's consumer_timeout (30 minutes by default).
once = Once(store, ttl=timedelta(days=1), lease=timedelta(seconds=30))
issued: list[str] = []  # stands in for the payment provider's ledger
dead_letters: list[str] = []


async def dead_letter(message: AbstractIncomingMessage, error: BaseException) -> None:
    # Called once per message the guard cannot run (KeyReused: its id was used before
    # with another body; Undecodable) or gave up on (its attempts spent).
    dead_letters.append(f"{message.message_id}: {error!r}")  # e.g. a parking queue


guard = RabbitMQGuard(
    once, namespace="example.rabbitmq.refunds", on_exhausted=dead_letter, max_attempts=3
)


async def issue_refund(message: AbstractIncomingMessage) -> dict[str, Any]:
    try:
        order = json.loads(message.body)["order"]
    except (ValueError, KeyError) as exc:  # fails the same on every delivery: no retry
        raise Undecodable("not a refund") from exc
    issued.append(order)
    return {"refund_id": f"rf-{order}"}


async def main() -> list[str]:
    await store.create_all()  # development; `asgi-idempotency migrate` in production
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1)
        # A quorum queue: it counts deliveries (x-delivery-count), so attempts are bounded.
        queue = await channel.declare_queue(
            QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
        )
        # msg-1 is published twice under one message_id (a publisher's retry): one refund.
        # msg-3 is not a refund: handed to dead_letter once, acknowledged, never retried.
        refunds = [("msg-1", b'{"order": "A-88214"}'), ("msg-2", b'{"order": "A-88215"}')]
        for message_id, body in [*refunds, refunds[0], ("msg-3", b"not json")]:
            message = aio_pika.Message(body, message_id=message_id)
            await channel.default_exchange.publish(message, routing_key=QUEUE)
        settled = asyncio.Semaphore(0)
        handle = guard(issue_refund)

        async def consume(message: AbstractIncomingMessage) -> None:
            await handle(message)  # runs, or replays; acknowledges either way
            settled.release()

        tag = await queue.consume(consume)
        for _ in range(4):
            await settled.acquire()
        await queue.cancel(tag)
    await store.close()
    print(f"dead letters: {dead_letters}")
    print(f"refunds issued: {issued}")
    return issued


if __name__ == "__main__":
    asyncio.run(main())

"""A NATS JetStream consumer (nats-py) that issues each refund once, however often delivered.

python -m examples.nats_consumer
"""

import asyncio
import json
import os
from datetime import timedelta
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.integrations.nats import JetStreamGuard

NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
STREAM = os.environ.get("REFUNDS_STREAM", "REFUNDS")
ACK_WAIT = timedelta(seconds=30)
store = SQLStore(os.environ.get("IDEMPOTENCY_DATABASE_URL", "sqlite+aiosqlite:///./refunds.db"))
# The lease must be shorter than the consumer's ack_wait: a redelivery after a crash
# comes after ack_wait, and the dead consumer's claim must have lapsed by then.
once = Once(store, ttl=timedelta(days=1), lease=timedelta(seconds=10))
issued: list[str] = []  # stands in for the payment provider's ledger


async def dead_letter(msg: Msg, error: BaseException) -> None:
    print(f"dead letter: {msg.headers}: {error}")  # e.g. publish to a parking subject


guard = JetStreamGuard(
    once, namespace="refunds", ack_wait=ACK_WAIT, on_exhausted=dead_letter, max_attempts=3
)


async def issue_refund(msg: Msg) -> dict[str, Any]:
    order = json.loads(msg.data)["order"]
    issued.append(order)
    return {"refund_id": f"rf-{order}"}


async def main() -> list[str]:
    await store.create_all()  # development; `asgi-idempotency migrate` in production
    client = await nats.connect(NATS_URL)
    js = client.jetstream()
    await js.add_stream(name=STREAM, subjects=[f"{STREAM}.>"])
    config = ConsumerConfig(
        durable_name="refunders", ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ACK_WAIT.total_seconds(), max_deliver=-1,
    )  # fmt: skip
    await js.add_consumer(STREAM, config)
    await guard.check(js, STREAM, "refunders")  # the server's ack_wait against the lease
    # msg-1 is published twice: JetStream itself keeps one (it deduplicates by Nats-Msg-Id
    # within its duplicate window); a redelivery of it, after a crash, is the guard's.
    for msg_id, order in [("msg-1", "A-88214"), ("msg-2", "A-88215"), ("msg-1", "A-88214")]:
        body = json.dumps({"order": order}).encode()
        await js.publish(f"{STREAM}.new", body, headers={"Nats-Msg-Id": msg_id})
    subscription = await js.pull_subscribe_bind("refunders", STREAM)
    handle = guard(issue_refund)
    for msg in await subscription.fetch(2):
        await handle(msg)  # runs, or replays (a redelivery); acknowledges either way
    await js.delete_stream(STREAM)
    await client.close()
    await store.close()
    print(f"refunds issued: {issued}")
    return issued


if __name__ == "__main__":
    asyncio.run(main())

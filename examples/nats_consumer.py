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
from nats.js.errors import NotFoundError

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.integrations.nats import JetStreamGuard, Undecodable

NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
# Names of this example's own: its stream (deleted at the end only if this run created
# it), its namespace and its SQLite file, so each example issues its own refunds.
STREAM = os.environ.get("REFUNDS_STREAM", "ASGI_IDEMPOTENCY_EXAMPLE_NATS")
ACK_WAIT = timedelta(seconds=30)
DATABASE_URL = "sqlite+aiosqlite:///./nats_example.db"
store = SQLStore(os.environ.get("IDEMPOTENCY_DATABASE_URL", DATABASE_URL))
# The lease must be shorter than the consumer's ack_wait: a redelivery after a crash
# comes after ack_wait, and the dead consumer's claim must have lapsed by then.
once = Once(store, ttl=timedelta(days=1), lease=timedelta(seconds=10))
issued: list[str] = []  # stands in for the payment provider's ledger
dead_letters: list[str] = []


async def dead_letter(msg: Msg, error: BaseException) -> None:
    # Called once per message the guard cannot run (KeyReused: its id was used before
    # with another body; Undecodable) or gave up on (its attempts spent).
    dead_letters.append(f"{(msg.headers or {}).get('Nats-Msg-Id')}: {error!r}")


guard = JetStreamGuard(
    once, namespace="example.nats.refunds", ack_wait=ACK_WAIT, on_exhausted=dead_letter,
    max_attempts=3,
)  # fmt: skip


async def issue_refund(msg: Msg) -> dict[str, Any]:
    try:
        order = json.loads(msg.data)["order"]
    except (ValueError, KeyError) as exc:  # fails the same on every delivery: no retry
        raise Undecodable("not a refund") from exc
    issued.append(order)
    return {"refund_id": f"rf-{order}"}


async def main() -> list[str]:
    await store.create_all()  # development; `asgi-idempotency migrate` in production
    client = await nats.connect(NATS_URL)
    js = client.jetstream()
    try:
        await js.stream_info(STREAM)
        created = False
    except NotFoundError:
        await js.add_stream(name=STREAM, subjects=[f"{STREAM}.>"])
        created = True
    config = ConsumerConfig(
        durable_name="refunders", ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ACK_WAIT.total_seconds(), max_deliver=-1,
    )  # fmt: skip
    await js.add_consumer(STREAM, config)
    await guard.check(js, STREAM, "refunders")  # the server's ack_wait against the lease
    # msg-1 is published twice: JetStream itself keeps one (it deduplicates by Nats-Msg-Id
    # within its duplicate window); a redelivery of it, after a crash, is the guard's.
    # msg-3 is not a refund: handed to dead_letter once, acknowledged, never retried.
    refunds = [("msg-1", b'{"order": "A-88214"}'), ("msg-2", b'{"order": "A-88215"}')]
    for msg_id, body in [*refunds, refunds[0], ("msg-3", b"not json")]:
        await js.publish(f"{STREAM}.new", body, headers={"Nats-Msg-Id": msg_id})
    subscription = await js.pull_subscribe_bind("refunders", STREAM)
    handle = guard(issue_refund)
    for msg in await subscription.fetch(3):
        await handle(msg)  # runs, or replays (a redelivery); acknowledges either way
    if created:
        await js.delete_stream(STREAM)  # only a stream this run created
    await client.close()
    await store.close()
    print(f"dead letters: {dead_letters}")
    print(f"refunds issued: {issued}")
    return issued


if __name__ == "__main__":
    asyncio.run(main())

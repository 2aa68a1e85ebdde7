"""A RabbitMQ consumer process for the broker tests: ``python -m tests.brokers.rabbitmq_consumer``.

Configured by its environment: ``AMQP_URL``, ``QUEUE``, ``DATABASE_URL`` (Postgres: the
guard's records and the effects), ``NAME``; ``GUARDED=0`` for the unguarded baseline;
``LEASE`` seconds; ``MAX_ATTEMPTS``; what the handler does, and ``DEAD_LETTER``:
:mod:`tests.brokers.behaviour`.
Prints ``consuming`` once it consumes, ``acked`` after each acknowledgement.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.integrations.rabbitmq import RabbitMQGuard
from tests.brokers.behaviour import (
    DB,
    NAME,
    behave,
    behave_in,
    crash_before_ack,
    dead_letter,
    decode,
    handing_off,
    listen,
    transactional,
)
from tests.brokers.effects import ensure_table

ENV = os.environ
QUEUE = ENV["QUEUE"]


class CrashingGuard(RabbitMQGuard):
    """Dies, by a real SIGKILL, after the outcome is recorded and before the ack."""

    async def _acknowledge(self, message: AbstractIncomingMessage, *, reject: bool = False) -> None:
        crash_before_ack()
        await super()._acknowledge(message, reject=reject)
        print("acked", flush=True)


async def handle(message: AbstractIncomingMessage) -> str:
    decode(message.body)
    return await behave(QUEUE)


async def handle_in_transaction(message: AbstractIncomingMessage, *, session: Any) -> str:
    decode(message.body)
    return await behave_in(session, QUEUE)


async def hand_off(message: AbstractIncomingMessage, error: BaseException) -> None:
    await dead_letter(QUEUE, error)


async def unguarded(message: AbstractIncomingMessage) -> None:
    await behave(QUEUE)
    crash_before_ack()
    await message.ack()


async def main() -> None:
    listen()
    await ensure_table(DB)
    lease = timedelta(seconds=float(ENV.get("LEASE", "3")))
    once = Once(SQLStore(DB), lease=lease, retry_after=0.2)
    guard = CrashingGuard(
        once,
        namespace=f"test.{QUEUE}",
        on_exhausted=hand_off if handing_off() else None,
        max_attempts=int(ENV.get("MAX_ATTEMPTS", "3")),
        requeue_delay=0.2,
        transactional=transactional(),
    )
    connection = await aio_pika.connect(
        ENV["AMQP_URL"], client_properties={"connection_name": f"{QUEUE}:{NAME}"}
    )
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1)
        queue = await channel.get_queue(QUEUE)
        handler = handle_in_transaction if transactional() else handle
        callback: Any = guard(handler) if ENV.get("GUARDED", "1") == "1" else unguarded
        await queue.consume(callback)
        print("consuming", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())

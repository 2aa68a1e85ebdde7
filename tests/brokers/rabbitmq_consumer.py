"""A RabbitMQ consumer process for the broker tests: ``python -m tests.brokers.rabbitmq_consumer``.

Configured by its environment: ``AMQP_URL``, ``QUEUE``, ``DATABASE_URL`` (Postgres: the
guard's records and the effects), ``NAME``; ``GUARDED=0`` for the unguarded baseline;
``BEHAVE`` one of ``effect`` (default), ``block`` (records ``started`` and hangs, to be
killed), ``slow`` (records ``started``, runs on until the process gets SIGUSR1),
``fail`` (raises); ``CRASH=before_ack`` SIGKILLs the process itself where it would
acknowledge, after the outcome is recorded; ``LEASE`` seconds; ``MAX_ATTEMPTS``.
Prints ``consuming`` once it consumes.
"""

from __future__ import annotations

import asyncio
import os
import signal
from datetime import timedelta
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.integrations.rabbitmq import RabbitMQGuard
from tests.brokers.effects import record

ENV = os.environ
QUEUE, DB, NAME = ENV["QUEUE"], ENV["DATABASE_URL"], ENV["NAME"]
BEHAVE = ENV.get("BEHAVE", "effect")
CRASH = ENV.get("CRASH", "")
GO = asyncio.Event()  # set by SIGUSR1: a slow handler's downstream call returns


def crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class CrashingGuard(RabbitMQGuard):
    """Dies, by a real SIGKILL, after the outcome is recorded and before the ack."""

    async def _acknowledge(self, message: AbstractIncomingMessage) -> None:
        if CRASH == "before_ack":
            crash()
        await super()._acknowledge(message)
        print("acked", flush=True)


async def handle(message: AbstractIncomingMessage) -> str:
    if BEHAVE == "block":
        await record(DB, QUEUE, "started", NAME)
        await asyncio.Event().wait()  # a slow downstream call: killed meanwhile
    if BEHAVE == "slow":  # outlives the consumer timeout: runs on until GATE exists
        await record(DB, QUEUE, "started", NAME)
        await GO.wait()
    if BEHAVE == "fail":
        await record(DB, QUEUE, "attempt", NAME)
        raise RuntimeError("the downstream refused")
    await record(DB, QUEUE, "effect", NAME)
    return NAME


async def dead_letter(message: AbstractIncomingMessage, error: BaseException) -> None:
    await record(DB, QUEUE, "exhausted", NAME)


async def unguarded(message: AbstractIncomingMessage) -> None:
    await handle(message)
    if CRASH == "before_ack":
        crash()
    await message.ack()


async def main() -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, GO.set)
    store = SQLStore(DB)
    once = Once(store, lease=timedelta(seconds=float(ENV.get("LEASE", "3"))), retry_after=0.2)
    guard = CrashingGuard(
        once,
        namespace=f"test.{QUEUE}",
        on_exhausted=dead_letter,
        max_attempts=int(ENV.get("MAX_ATTEMPTS", "3")),
        requeue_delay=0.2,
    )
    connection = await aio_pika.connect(
        ENV["AMQP_URL"], client_properties={"connection_name": f"{QUEUE}:{NAME}"}
    )
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1)
        queue = await channel.get_queue(QUEUE)
        callback: Any = guard(handle) if ENV.get("GUARDED", "1") == "1" else unguarded
        await queue.consume(callback)
        print("consuming", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())

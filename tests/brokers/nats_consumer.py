"""A JetStream consumer process for the broker tests: ``python -m tests.brokers.nats_consumer``.

Configured by its environment: ``NATS_URL``, ``STREAM`` (its durable pull consumer is
``workers``), ``DATABASE_URL`` (Postgres: the guard's records and the effects), ``NAME``;
``GUARDED=0`` for the unguarded baseline; ``LEASE`` and ``ACK_WAIT`` seconds;
``MAX_ATTEMPTS``; what the handler does, and ``DEAD_LETTER``:
:mod:`tests.brokers.behaviour`. Prints
``consuming`` once it consumes, ``acked`` after each acknowledgement or termination;
records each delivery it is given under the run ``<STREAM>/deliveries``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import nats
import nats.errors
from nats.aio.msg import Msg

from asgi_idempotency import MissingMessageId, Once, SQLStore
from asgi_idempotency.integrations.nats import JetStreamGuard
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
from tests.brokers.effects import ensure_table, record

ENV = os.environ
STREAM = ENV["STREAM"]


class CrashingGuard(JetStreamGuard):
    """Dies, by a real SIGKILL, after the outcome is recorded and before the ack."""

    async def _acknowledge(self, msg: Msg, *, terminate: bool = False) -> None:
        crash_before_ack()
        await super()._acknowledge(msg, terminate=terminate)
        print("acked", flush=True)


async def handle(msg: Msg) -> str:
    decode(msg.data)
    return await behave(STREAM)


async def handle_in_transaction(msg: Msg, *, session: Any) -> str:
    decode(msg.data)
    return await behave_in(session, STREAM)


async def hand_off(msg: Msg, error: BaseException) -> None:
    await dead_letter(STREAM, error)


async def unguarded(msg: Msg) -> None:
    await behave(STREAM)
    crash_before_ack()
    await msg.ack()


async def main() -> None:
    listen()
    await ensure_table(DB)
    lease = timedelta(seconds=float(ENV.get("LEASE", "1")))
    once = Once(SQLStore(DB), lease=lease, retry_after=0.2)
    guard = CrashingGuard(
        once,
        namespace=f"test.{STREAM}",
        ack_wait=timedelta(seconds=float(ENV.get("ACK_WAIT", "2"))),
        on_exhausted=hand_off if handing_off() else None,
        max_attempts=int(ENV.get("MAX_ATTEMPTS", "3")),
        nak_delay=0.2,
        transactional=transactional(),
    )
    client = await nats.connect(ENV["NATS_URL"])
    js = client.jetstream()
    await guard.check(js, STREAM, "workers")
    subscription = await js.pull_subscribe_bind("workers", STREAM)
    callback: Callable[[Msg], Awaitable[None]] = (
        guard(handle_in_transaction if transactional() else handle)
        if ENV.get("GUARDED", "1") == "1"
        else unguarded
    )
    print("consuming", flush=True)
    while True:
        try:
            messages = await subscription.fetch(1, timeout=1)
        except nats.errors.TimeoutError:
            continue
        for msg in messages:
            # Every delivery this consumer is given, as a row of a run of its own.
            await record(DB, f"{STREAM}/deliveries", "delivery", NAME)
            try:
                await callback(msg)
            except MissingMessageId:
                logging.exception("refused")  # as a push subscription's callback error is


if __name__ == "__main__":
    asyncio.run(main())

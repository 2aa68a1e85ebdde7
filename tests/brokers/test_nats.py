"""The JetStream preset on a real NATS server, with real consumer processes and SIGKILLs.

Each test creates a stream of its own with a durable pull consumer ``workers``
(``ack_wait`` 2 s, unlimited deliveries), runs consumers from
``tests/brokers/nats_consumer.py``, counts effects in Postgres, and deletes the
stream afterwards.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from asgi_idempotency import MemoryStore, Once
from asgi_idempotency.integrations.nats import JetStreamGuard
from tests.brokers.effects import counted, until, who
from tests.brokers.processes import Consumer, running
from tests.conftest import worker_name

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.postgres, pytest.mark.slow]

ACK_WAIT = 2.0


async def create_stream(nats_url: str, name: str, max_deliver: int = -1) -> None:
    client = await nats.connect(nats_url)
    try:
        js = client.jetstream()
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        await js.add_consumer(
            name,
            ConsumerConfig(
                durable_name="workers", ack_policy=AckPolicy.EXPLICIT,
                ack_wait=ACK_WAIT, max_deliver=max_deliver,
            ),
        )  # fmt: skip
    finally:
        await client.close()


async def delete_stream(nats_url: str, name: str) -> None:
    client = await nats.connect(nats_url)
    try:
        await client.jetstream().delete_stream(name)
    finally:
        await client.close()


@pytest.fixture
async def stream(nats_url: str) -> AsyncIterator[str]:
    """A stream of this test's own (and its consumer), deleted afterwards."""
    name = worker_name("idem-test", sep="-")
    await create_stream(nats_url, name)
    try:
        yield name
    finally:
        await delete_stream(nats_url, name)


async def publish(nats_url: str, stream: str, msg_id: str | None, data: bytes = b"{}") -> None:
    client = await nats.connect(nats_url)
    try:
        headers = None if msg_id is None else {"Nats-Msg-Id": msg_id}
        await client.jetstream().publish(f"{stream}.refunds", data, headers=headers)
    finally:
        await client.close()


async def pending(nats_url: str, stream: str) -> tuple[int, int]:
    """The consumer's (messages not yet delivered, deliveries not yet acknowledged),
    once both are 0 or after 10 s: an ack is a publish the server takes in its time."""
    client = await nats.connect(nats_url)
    try:
        for _ in range(100):
            info = await client.jetstream().consumer_info(stream, "workers")
            counts = int(info.num_pending or 0), int(info.num_ack_pending or 0)
            if counts == (0, 0):
                break
            await asyncio.sleep(0.1)
        return counts
    finally:
        await client.close()


def start(
    started: list[Consumer], tmp_path: Path, nats_url: str, stream: str, pg_url: str,
    name: str, **env: str,
) -> Consumer:  # fmt: skip
    consumer = Consumer(
        "tests.brokers.nats_consumer",
        {"NATS_URL": nats_url, "STREAM": stream, "DATABASE_URL": pg_url, "NAME": name, **env},
        tmp_path / f"{stream}-{name}.log",
    )
    started.append(consumer)
    consumer.wait_for("consuming")
    return consumer


async def test_killed_after_the_effect_before_the_ack_runs_twice_unguarded_once_guarded(
    nats_url: str, pg_url: str, tmp_path: Path
) -> None:
    """The consumer dies between its effect and its ack; JetStream redelivers after ack_wait."""
    effects: dict[str, int] = {}
    for guarded in ("0", "1"):
        run = worker_name("idem-test", sep="-")
        await create_stream(nats_url, run)
        try:
            with running() as started:
                first = start(
                    started, tmp_path, nats_url, run, pg_url, "first",
                    GUARDED=guarded, CRASH="before_ack",
                )  # fmt: skip
                await publish(nats_url, run, "msg-7f3a", b'{"order": "A-88214"}')
                assert first.wait_dead() == -9  # SIGKILLed itself before acknowledging
                second = start(started, tmp_path, nats_url, run, pg_url, "second", GUARDED=guarded)
                if guarded == "1":
                    second.wait_for("acked")  # the redelivery: replayed, then acknowledged
                else:
                    await until(pg_url, run, "effect", 2)
                    await asyncio.sleep(0.5)  # its ack on the wire before the kill
                effects[guarded] = (await counted(pg_url, run)).get("effect", 0)
                assert await pending(nats_url, run) == (0, 0)  # acknowledged in the end
        finally:
            await delete_stream(nats_url, run)
    assert effects == {"0": 2, "1": 1}


async def test_killed_mid_handler_the_redelivery_takes_over(
    nats_url: str, pg_url: str, stream: str, tmp_path: Path
) -> None:
    """Killed while its handler runs: redelivered after ack_wait, by when the dead
    consumer's claim (lease 1 s) has lapsed, so the redelivery runs it at once."""
    with running() as started:
        first = start(started, tmp_path, nats_url, stream, pg_url, "first", BEHAVE="block")
        await publish(nats_url, stream, "msg-1")
        assert (await until(pg_url, stream, "started", 1)).get("started") == 1
        first.kill()
        second = start(started, tmp_path, nats_url, stream, pg_url, "second")
        second.wait_for("acked")
        assert await pending(nats_url, stream) == (0, 0)
    assert await counted(pg_url, stream) == {"started": 1, "effect": 1}


async def test_a_consumer_slower_than_ack_wait_is_not_run_twice(
    nats_url: str, pg_url: str, stream: str, tmp_path: Path
) -> None:
    """The handler takes three times ack_wait while a second consumer polls the same
    durable consumer: it is kept in progress, never run by the second."""
    with running() as started:
        first = start(started, tmp_path, nats_url, stream, pg_url, "first", BEHAVE="slow")
        start(started, tmp_path, nats_url, stream, pg_url, "second")
        await publish(nats_url, stream, "msg-4")
        assert (await until(pg_url, stream, "started", 1)).get("started") == 1
        await asyncio.sleep(3 * ACK_WAIT)
        first.proc.send_signal(signal.SIGUSR1)  # its downstream call returns
        first.wait_for("acked")
        assert await pending(nats_url, stream) == (0, 0)
    assert await counted(pg_url, stream) == {"started": 1, "effect": 1}
    assert await who(pg_url, stream, "effect") == ["first"]
    # Kept in progress: never redelivered, to the second consumer or anyone.
    assert await who(pg_url, f"{stream}/deliveries", "delivery") == ["first"]


async def test_an_exhausted_message_reaches_the_hand_off_once(
    nats_url: str, pg_url: str, stream: str, tmp_path: Path
) -> None:
    """Three failing attempts, then the hand-off; the consumer dies before terminating
    the message, and the redelivery replays the hand-off instead of calling it again."""
    with running() as started:
        first = start(
            started, tmp_path, nats_url, stream, pg_url, "first",
            BEHAVE="fail", CRASH="before_ack", MAX_ATTEMPTS="3",
        )  # fmt: skip
        await publish(nats_url, stream, "msg-2")
        assert first.wait_dead() == -9  # after the hand-off, before its termination
        second = start(
            started, tmp_path, nats_url, stream, pg_url, "second",
            BEHAVE="fail", MAX_ATTEMPTS="3",
        )  # fmt: skip
        second.wait_for("acked")
        assert await pending(nats_url, stream) == (0, 0)
    assert await counted(pg_url, stream) == {"attempt": 3, "exhausted": 1}


async def test_a_message_without_an_id_is_refused_not_run(
    nats_url: str, pg_url: str, stream: str, tmp_path: Path
) -> None:
    with running() as started:
        consumer = start(started, tmp_path, nats_url, stream, pg_url, "only")
        await publish(nats_url, stream, None)
        await publish(nats_url, stream, "msg-3")
        consumer.wait_for("acked")  # the second; the first was terminated, not run
        assert await pending(nats_url, stream) == (0, 0)
    assert await counted(pg_url, stream) == {"effect": 1}


async def dead_letter(msg: object, error: BaseException) -> None: ...


async def test_the_lease_is_checked_against_ack_wait_at_construction_and_startup(
    nats_url: str, stream: str
) -> None:
    long = Once(MemoryStore(), lease=timedelta(seconds=ACK_WAIT))
    with pytest.raises(ValueError, match="shorter than the broker's ack_wait"):
        JetStreamGuard(
            long, namespace="refunds", ack_wait=timedelta(seconds=2), on_exhausted=dead_letter
        )
    once = Once(MemoryStore(), lease=timedelta(seconds=1))
    # Stated 5 s, but the server's consumer says 2 s: fine (1 s < 2 s).
    stated = JetStreamGuard(
        once, namespace="refunds", ack_wait=timedelta(seconds=5), on_exhausted=dead_letter
    )
    client = await nats.connect(nats_url)
    try:
        js = client.jetstream()
        await stated.check(js, stream, "workers")
        # A lease of 3 s stated against 5 s passes construction; the server's 2 s does not.
        wrong = JetStreamGuard(
            Once(MemoryStore(), lease=timedelta(seconds=3)), namespace="refunds",
            ack_wait=timedelta(seconds=5), on_exhausted=dead_letter,
        )  # fmt: skip
        with pytest.raises(ValueError, match="ack_wait"):
            await wrong.check(js, stream, "workers")
        await js.add_consumer(
            stream, ConsumerConfig(durable_name="few", ack_wait=ACK_WAIT, max_deliver=3)
        )
        with pytest.raises(ValueError, match="max_deliver=3"):
            await stated.check(js, stream, "few")  # max_attempts 5
    finally:
        await client.close()

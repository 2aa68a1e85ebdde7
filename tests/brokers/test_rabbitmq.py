"""The RabbitMQ preset on a real RabbitMQ, with real consumer processes and real SIGKILLs.

Each test declares a quorum queue of its own (quorum queues count deliveries in
``x-delivery-count``), runs consumers from ``tests/brokers/rabbitmq_consumer.py``,
counts effects in Postgres, and deletes its queue afterwards.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import aio_pika
import kombu.connection
import pytest

from asgi_idempotency import MemoryStore, Once
from asgi_idempotency.integrations.rabbitmq import RabbitMQGuard
from tests.brokers.effects import counted, until, who
from tests.brokers.processes import Consumer, running
from tests.conftest import worker_name

pytestmark = [pytest.mark.anyio, pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
async def queue_name(amqp_url: str) -> AsyncIterator[str]:
    """A quorum queue of this test's own, deleted afterwards."""
    name = worker_name("idem-test", sep="-")
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
        try:
            yield name
        finally:
            await channel.queue_delete(name)


async def publish(amqp_url: str, queue: str, message_id: str, body: bytes) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        message = aio_pika.Message(body, message_id=message_id)
        await channel.default_exchange.publish(message, routing_key=queue)


async def ready_count(amqp_url: str, queue: str) -> int:
    """Messages ready in ``queue`` (unacknowledged ones are back once their consumer is gone)."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        count = declared.declaration_result.message_count
        return int(count or 0)


def consumer_env(amqp_url: str, queue: str, pg_url: str, name: str, **env: str) -> dict[str, str]:
    return {"AMQP_URL": amqp_url, "QUEUE": queue, "DATABASE_URL": pg_url, "NAME": name, **env}


def start(
    started: list[Consumer], tmp_path: Path, amqp_url: str, queue: str, pg_url: str,
    name: str, **env: str,
) -> Consumer:  # fmt: skip
    consumer = Consumer(
        "tests.brokers.rabbitmq_consumer",
        consumer_env(amqp_url, queue, pg_url, name, **env),
        tmp_path / f"{queue}-{name}.log",
    )
    started.append(consumer)
    consumer.wait_for("consuming")
    return consumer


@pytest.mark.parametrize("kind", ["quorum", "classic"])
async def test_killed_after_the_effect_before_the_ack_runs_twice_unguarded_once_guarded(
    amqp_url: str, pg_url: str, queue_name: str, tmp_path: Path, kind: str
) -> None:
    """The consumer dies between its effect and its ack; RabbitMQ redelivers (a classic
    queue, which counts no deliveries, replays the redelivery as a quorum queue does)."""
    effects: dict[str, int] = {}
    for guarded in ("0", "1"):
        run = f"{queue_name}-{guarded}"
        async with _queue(amqp_url, run, kind):
            with running() as started:
                first = start(
                    started, tmp_path, amqp_url, run, pg_url, "first",
                    GUARDED=guarded, CRASH="before_ack",
                )  # fmt: skip
                await publish(amqp_url, run, "msg-7f3a", b'{"order": "A-88214"}')
                assert first.wait_dead() == -9  # SIGKILLed itself before acknowledging
                second = start(started, tmp_path, amqp_url, run, pg_url, "second", GUARDED=guarded)
                if guarded == "1":
                    second.wait_for("acked")  # the redelivery: replayed, then acknowledged
                else:
                    await until(pg_url, run, "effect", 2)
                    await asyncio.sleep(0.5)  # its ack on the wire before the kill
            got = await counted(pg_url, run)
            effects[guarded] = got.get("effect", 0)
            assert "exhausted" not in got  # a replay, not a hand-off
            assert await ready_count(amqp_url, run) == 0  # acknowledged in the end
    assert effects == {"0": 2, "1": 1}


async def test_killed_mid_handler_the_redelivery_takes_over_after_the_lease(
    amqp_url: str, pg_url: str, queue_name: str, tmp_path: Path
) -> None:
    """Killed while its handler runs: the redelivery waits out the dead claim, then runs."""
    with running() as started:
        first = start(started, tmp_path, amqp_url, queue_name, pg_url, "first", BEHAVE="block")
        await publish(amqp_url, queue_name, "msg-1", b"{}")
        assert (await until(pg_url, queue_name, "started", 1)).get("started") == 1
        first.kill()
        second = start(started, tmp_path, amqp_url, queue_name, pg_url, "second", LEASE="3")
        second.wait_for("acked", timeout=90)
    assert await counted(pg_url, queue_name) == {"started": 1, "effect": 1}
    assert await ready_count(amqp_url, queue_name) == 0


def close_connection(name: str) -> None:
    """Close a consumer's connection from the broker's side, as its consumer timeout does:
    the channel closes under the running handler and its message is requeued."""
    listed = subprocess.run(
        ["rabbitmqctl", "-s", "list_connections", "pid", "client_properties"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    named = f'{{"connection_name","{name}"}}'
    pids = [line.split("\t")[0] for line in listed.splitlines() if named in line]
    assert len(pids) == 1, listed
    subprocess.run(
        ["rabbitmqctl", "-q", "close_connection", pids[0], "consumer timeout (test)"],
        capture_output=True, timeout=60, check=True,
    )  # fmt: skip


async def test_a_consumer_slower_than_the_consumer_timeout_is_not_run_twice(
    amqp_url: str, pg_url: str, queue_name: str, tmp_path: Path
) -> None:
    """The broker takes the message from a slow consumer and redelivers it while the
    first still runs: the redelivery waits for (or requeues behind) the first's claim,
    renewed meanwhile, and replays its result once it is recorded."""
    with running() as started:
        first = start(
            started, tmp_path, amqp_url, queue_name, pg_url, "first",
            BEHAVE="slow", LEASE="1",
        )  # fmt: skip
        await publish(amqp_url, queue_name, "msg-4", b"{}")
        assert (await until(pg_url, queue_name, "started", 1)).get("started") == 1
        await asyncio.to_thread(close_connection, f"{queue_name}:first")
        second = start(started, tmp_path, amqp_url, queue_name, pg_url, "second", LEASE="1")
        await asyncio.sleep(3)  # three of the first's leases: renewed, never taken over
        first.proc.send_signal(signal.SIGUSR1)  # its downstream call returns
        second.wait_for("acked")
    assert await counted(pg_url, queue_name) == {"started": 1, "effect": 1}
    assert await who(pg_url, queue_name, "effect") == ["first"]  # the slow one finished it
    assert await ready_count(amqp_url, queue_name) == 0


async def test_an_exhausted_message_reaches_the_hand_off_once(
    amqp_url: str, pg_url: str, queue_name: str, tmp_path: Path
) -> None:
    """Three failing attempts, then the hand-off; the consumer dies before acking it, and
    the next delivery replays the hand-off instead of calling it again."""
    with running() as started:
        first = start(
            started, tmp_path, amqp_url, queue_name, pg_url, "first",
            BEHAVE="fail", CRASH="before_ack", MAX_ATTEMPTS="3",
        )  # fmt: skip
        await publish(amqp_url, queue_name, "msg-2", b"{}")
        assert first.wait_dead() == -9  # after the hand-off, before its ack
        second = start(
            started, tmp_path, amqp_url, queue_name, pg_url, "second",
            BEHAVE="fail", MAX_ATTEMPTS="3",
        )  # fmt: skip
        second.wait_for("acked")
    assert await counted(pg_url, queue_name) == {"attempt": 3, "exhausted": 1}
    assert await ready_count(amqp_url, queue_name) == 0


async def test_a_message_without_an_id_is_refused_not_run(
    amqp_url: str, pg_url: str, queue_name: str, tmp_path: Path
) -> None:
    with running() as started:
        consumer = start(started, tmp_path, amqp_url, queue_name, pg_url, "only")
        # aio-pika (aiormq) gives every message it publishes a random id: kombu does not.
        with kombu.connection.Connection(amqp_url) as connection:
            connection.Producer().publish(b"{}", routing_key=queue_name)
        await publish(amqp_url, queue_name, "msg-3", b"{}")
        consumer.wait_for("acked")  # the second; the first was rejected, not requeued
    assert await counted(pg_url, queue_name) == {"effect": 1}
    assert await ready_count(amqp_url, queue_name) == 0


async def test_an_id_reused_with_another_body_is_rejected_not_run(
    amqp_url: str, pg_url: str, queue_name: str, tmp_path: Path
) -> None:
    with running() as started:
        consumer = start(started, tmp_path, amqp_url, queue_name, pg_url, "only")
        await publish(amqp_url, queue_name, "msg-5", b'{"order": "A-1"}')
        consumer.wait_for("acked")
        await publish(amqp_url, queue_name, "msg-5", b'{"order": "A-2"}')  # a producer bug
        await publish(amqp_url, queue_name, "msg-6", b"{}")
        consumer.wait_for("acked")  # msg-6; the reused id was rejected, not requeued
    assert await counted(pg_url, queue_name) == {"effect": 2}
    assert await ready_count(amqp_url, queue_name) == 0


def test_a_lease_not_shorter_than_the_consumer_timeout_is_refused() -> None:
    async def dead_letter(message: object, error: BaseException) -> None: ...

    once = Once(MemoryStore(), lease=timedelta(minutes=30))
    with pytest.raises(ValueError, match="shorter than the broker's consumer_timeout"):
        RabbitMQGuard(once, namespace="refunds", on_exhausted=dead_letter)
    short = Once(MemoryStore(), lease=timedelta(seconds=30))
    RabbitMQGuard(short, namespace="refunds", on_exhausted=dead_letter)
    with pytest.raises(ValueError, match="consumer_timeout"):
        RabbitMQGuard(
            short, namespace="refunds", on_exhausted=dead_letter,
            consumer_timeout=timedelta(seconds=10),
        )  # fmt: skip


class _queue:
    """A queue named ``name`` of ``kind`` (quorum or classic), deleted on exit."""

    def __init__(self, amqp_url: str, name: str, kind: str = "quorum") -> None:
        self.amqp_url, self.name, self.kind = amqp_url, name, kind

    async def __aenter__(self) -> str:
        connection = await aio_pika.connect(self.amqp_url)
        async with connection:
            channel = await connection.channel()
            kind = {"x-queue-type": self.kind}
            await channel.declare_queue(self.name, durable=True, arguments=dict(kind))
        return self.name

    async def __aexit__(self, *exc: object) -> None:
        connection = await aio_pika.connect(self.amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(self.name)

"""The broker examples run against the real brokers, as printed in docs/guide/brokers.md.

Each example runs twice in a fresh directory, on its SQLite default, with a queue or
stream of the test's own: the first run issues each refund once for all its deliveries,
and hands its message that is not a refund to its dead letter once; the second (the same
message ids) only replays. The examples use names of their own (queue or stream,
namespace, SQLite file), so run one after another in one directory each issues its own
refunds; none deletes a queue or stream it did not create. The page prints each file
whole.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import aio_pika
import pytest

from tests.brokers.processes import ROOT, Consumer
from tests.conftest import worker_name
from tests.project.docs_text import docs_text

pytestmark = [pytest.mark.slow]


def run_python(args: list[str], cwd: Path, env: dict[str, str]) -> list[str]:
    """``python -W error ARGS`` in ``cwd``, as a user runs it; its output's lines."""
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    full.pop("IDEMPOTENCY_DATABASE_URL", None)  # the examples' own default, as printed
    done = subprocess.run(
        [sys.executable, "-W", "error", *args],
        cwd=cwd, env=full, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def last(lines: list[str], label: str) -> object:
    assert lines[-1].startswith(label), lines
    return ast.literal_eval(lines[-1].removeprefix(label))


@pytest.mark.parametrize("name", ["rabbitmq_consumer", "nats_consumer", "celery_tasks"])
def test_the_page_prints_the_example_whole(name: str) -> None:
    assert (ROOT / "examples" / f"{name}.py").read_text() in docs_text()


def dead_letters(lines: list[str]) -> object:
    return last(lines[:-1], "dead letters: ")


NOT_A_REFUND = ["msg-3: Undecodable('not a refund')"]


def test_the_examples_use_names_of_their_own() -> None:
    """Default queue or stream, namespace and SQLite file: one of each per example, none
    named as a user's own might be (``refunds``, ``REFUNDS``); and no example deletes a
    queue, or a stream it did not create."""
    texts = {
        name: (ROOT / "examples" / f"{name}.py").read_text()
        for name in ("rabbitmq_consumer", "nats_consumer", "celery_tasks")
    }
    for pattern in (
        r'os\.environ\.get\("REFUNDS_(?:QUEUE|STREAM)", "([^"]+)"\)',
        r'namespace="([^"]+)"|guard\.task\(name="([^"]+)"',
        r"sqlite\+aiosqlite:///\./([^\"]+)",
    ):
        found = [
            "".join(m.groups("")) for text in texts.values() for m in re.finditer(pattern, text)
        ]
        assert len(found) == 3, (pattern, found)
        assert len(set(found)) == 3, found
        assert not {"refunds", "REFUNDS", "refunds.db"} & set(found), found
    for text in texts.values():
        assert "queue_delete" not in text
        assert ".delete(" not in text
    nats_text = texts["nats_consumer"]
    assert nats_text.count("delete_stream(") == 1
    assert "    if created:\n        await js.delete_stream(STREAM)" in nats_text


@pytest.mark.rabbitmq
def test_the_rabbitmq_example_issues_once_and_a_second_run_replays(
    amqp_url: str, tmp_path: Path
) -> None:
    queue = f"idem-example-{uuid.uuid4().hex[:12]}"
    env = {"AMQP_URL": amqp_url, "REFUNDS_QUEUE": queue}
    try:
        first = run_python(["-m", "examples.rabbitmq_consumer"], tmp_path, env)
        again = run_python(["-m", "examples.rabbitmq_consumer"], tmp_path, env)
    finally:
        delete_queue(amqp_url, queue)
    assert last(first, "refunds issued: ") == ["A-88214", "A-88215"]
    assert dead_letters(first) == NOT_A_REFUND
    assert last(again, "refunds issued: ") == []
    assert dead_letters(again) == []  # handed off once: the second run replays it


@pytest.mark.nats
def test_the_nats_example_issues_once_and_a_second_run_replays(
    nats_url: str, tmp_path: Path
) -> None:
    env = {"NATS_URL": nats_url, "REFUNDS_STREAM": worker_name("idem-example", sep="-")}
    first = run_python(["-m", "examples.nats_consumer"], tmp_path, env)
    again = run_python(["-m", "examples.nats_consumer"], tmp_path, env)
    assert last(first, "refunds issued: ") == ["A-88214", "A-88215"]
    assert dead_letters(first) == NOT_A_REFUND
    assert last(again, "refunds issued: ") == []
    assert dead_letters(again) == []


@pytest.mark.rabbitmq
@pytest.mark.nats
def test_the_examples_run_one_after_another_each_issue_their_refunds(
    amqp_url: str, nats_url: str, tmp_path: Path
) -> None:
    """In one directory, as a reader tries them: neither replays the other's records."""
    queue = f"idem-example-{uuid.uuid4().hex[:12]}"
    stream = f"idem-example-{uuid.uuid4().hex[:12]}"
    try:
        rabbit = run_python(
            ["-m", "examples.rabbitmq_consumer"], tmp_path,
            {"AMQP_URL": amqp_url, "REFUNDS_QUEUE": queue},
        )  # fmt: skip
    finally:
        delete_queue(amqp_url, queue)
    nats = run_python(
        ["-m", "examples.nats_consumer"], tmp_path, {"NATS_URL": nats_url, "REFUNDS_STREAM": stream}
    )
    assert last(rabbit, "refunds issued: ") == ["A-88214", "A-88215"]
    assert last(nats, "refunds issued: ") == ["A-88214", "A-88215"]
    assert dead_letters(nats) == NOT_A_REFUND


def delete_queue(amqp_url: str, queue: str) -> None:
    """Delete the test's own queue (the example leaves its queue in place)."""

    async def delete() -> None:
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(queue)

    asyncio.run(delete())


@pytest.mark.rabbitmq
@pytest.mark.anyio
async def test_the_celery_example_issues_once_and_a_second_run_replays(
    amqp_url: str, tmp_path: Path
) -> None:
    queue = worker_name("idem-example", sep="-")
    env = {"AMQP_URL": amqp_url, "REFUNDS_QUEUE": queue}
    worker = Consumer(
        "celery", env, tmp_path / "worker.log",
        args=("-A", "examples.celery_tasks", "worker", "--pool=solo", "-l", "warning"),
        cwd=tmp_path,
    )  # fmt: skip
    try:
        first = run_python(["-m", "examples.celery_tasks"], tmp_path, env)
        again = run_python(["-m", "examples.celery_tasks"], tmp_path, env)
    finally:
        worker.kill()
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(queue)
            await channel.exchange_delete(queue)
    result = {"refund_id": "rf-A-88214", "amount_p": 4500}
    assert last(first, "results: ") == last(again, "results: ") == [result, result]
    assert (tmp_path / "celery_issued.txt").read_text() == "A-88214\n"  # issued once in all

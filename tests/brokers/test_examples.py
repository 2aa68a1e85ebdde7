"""The broker examples run against the real brokers, as printed in docs/guide/brokers.md.

Each example runs twice in a fresh directory, on its SQLite default, with a queue or
stream of the test's own: the first run issues each refund once for all its deliveries,
the second (the same message ids) only replays. The page prints each file whole.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
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


@pytest.mark.rabbitmq
def test_the_rabbitmq_example_issues_once_and_a_second_run_replays(
    amqp_url: str, tmp_path: Path
) -> None:
    env = {"AMQP_URL": amqp_url, "REFUNDS_QUEUE": worker_name("idem-example", sep="-")}
    first = run_python(["-m", "examples.rabbitmq_consumer"], tmp_path, env)
    again = run_python(["-m", "examples.rabbitmq_consumer"], tmp_path, env)
    assert last(first, "refunds issued: ") == ["A-88214", "A-88215"]
    assert last(again, "refunds issued: ") == []


@pytest.mark.nats
def test_the_nats_example_issues_once_and_a_second_run_replays(
    nats_url: str, tmp_path: Path
) -> None:
    env = {"NATS_URL": nats_url, "REFUNDS_STREAM": worker_name("idem-example", sep="-")}
    first = run_python(["-m", "examples.nats_consumer"], tmp_path, env)
    again = run_python(["-m", "examples.nats_consumer"], tmp_path, env)
    assert last(first, "refunds issued: ") == ["A-88214", "A-88215"]
    assert last(again, "refunds issued: ") == []


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
    assert (tmp_path / "issued.txt").read_text() == "A-88214\n"  # issued once in all

"""A Celery app for the broker tests: ``celery -A tests.brokers.celery_app worker ...``.

Configured by its environment: ``AMQP_URL``, ``QUEUE`` (the tasks' queue, and the run
its effects are counted under), ``DATABASE_URL`` (Postgres: the guard's records and the
effects), ``NAME``; ``LEASE`` seconds; ``MAX_RETRIES``; what a task body does, and
``DEAD_LETTER``: :mod:`tests.brokers.behaviour`. ``CRASH=before_ack`` SIGKILLs the
worker after a task has finished (succeeded, or failed after its hand-off) and before
Celery acknowledges it.
The worker prints ``consuming`` once ready; each task that finishes otherwise records
a ``done`` row (its consumer column ``NAME:STATE``).
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

from celery import Celery, Task
from celery.signals import task_postrun, worker_ready

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.integrations.celery import CeleryGuard
from tests.brokers.behaviour import DB, NAME, behave, crash_before_ack, dead_letter, handing_off
from tests.brokers.effects import record

ENV = os.environ
QUEUE = ENV["QUEUE"]

app = Celery("idempotency-tests", broker=ENV["AMQP_URL"])
app.conf.update(
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_redirect_stdouts=False,  # "consuming" on stdout, where the test reads it
)
once = Once(SQLStore(DB), lease=timedelta(seconds=float(ENV.get("LEASE", "3"))), retry_after=0.2)


def hand_off(task: Task[Any, Any], error: BaseException) -> None:
    asyncio.run(dead_letter(QUEUE, error))


guard = CeleryGuard(once, app, on_exhausted=hand_off if handing_off() else None, retry_delay=0.2)


@guard.task(name="tests.refund", max_retries=int(ENV.get("MAX_RETRIES", "2")))
def refund(order: str) -> str:
    return asyncio.run(behave(QUEUE))


@app.task(name="tests.plain_refund", bind=True, acks_late=True, reject_on_worker_lost=True)
def plain_refund(self: Task[Any, Any], order: str) -> str:
    return asyncio.run(behave(QUEUE))


@worker_ready.connect
def ready(**_: Any) -> None:
    print("consuming", flush=True)


@task_postrun.connect
def finished(state: str | None = None, **_: Any) -> None:
    # Not RETRY: a retry is a new message. IGNORED: a reused id's, handed off.
    if state in ("SUCCESS", "FAILURE", "REJECTED", "IGNORED"):
        crash_before_ack()
        asyncio.run(record(DB, QUEUE, "done", f"{NAME}:{state}"))

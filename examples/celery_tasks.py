"""Celery tasks (on RabbitMQ) whose refunds are issued once per task id.

A worker runs the tasks; this module's ``__main__`` sends them and waits for the results:

    celery -A examples.celery_tasks worker --pool=solo &
    python -m examples.celery_tasks
"""

import asyncio
import os
from datetime import timedelta
from typing import Any

from celery import Celery, Task

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.integrations.celery import CeleryGuard

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
app = Celery("example-refunds", broker=AMQP_URL, backend="rpc://")
# Names of this example's own: its queue (Celery declares it), its task name (the
# namespace of its keys), its SQLite file and ledger, so each example issues its own.
app.conf.task_default_queue = os.environ.get("REFUNDS_QUEUE", "asgi-idempotency-example-celery")
app.conf.worker_prefetch_multiplier = 1  # a worker holds one unacknowledged task at a time
DATABASE_URL = "sqlite+aiosqlite:///./celery_example.db"
store = SQLStore(os.environ.get("IDEMPOTENCY_DATABASE_URL", DATABASE_URL))
# The lease must be shorter than RabbitMQ's consumer_timeout (30 minutes by default).
once = Once(store, ttl=timedelta(days=1), lease=timedelta(seconds=30))


def dead_letter(task: Task[Any, Any], error: BaseException) -> None:
    # Called once per task the guard cannot run (KeyReused: its id was used before with
    # other arguments; Undecodable) or gave up on (its retries spent).
    print(f"dead letter: {task.request.id}: {error!r}")  # e.g. a row in a parking table


guard = CeleryGuard(once, app, on_exhausted=dead_letter)


@guard.task(name="example.celery.refunds", max_retries=3)  # acks_late, reject_on_worker_lost
def issue_refund(order: str, amount_p: int) -> dict[str, Any]:
    with open("celery_issued.txt", "a") as ledger:  # stands in for the payment provider
        ledger.write(f"{order}\n")
    return {"refund_id": f"rf-{order}", "amount_p": amount_p}


async def prepare() -> None:
    await store.create_all()  # development; `asgi-idempotency migrate` in production
    await store.close()


def main() -> list[dict[str, Any]]:
    asyncio.run(prepare())
    # One task id per decision (the order's refund): sent twice, it is issued once.
    sent = [
        issue_refund.apply_async(args=["A-88214", 4500], task_id="refund-A-88214"),
        issue_refund.apply_async(args=["A-88214", 4500], task_id="refund-A-88214"),
    ]
    results = [result.get(timeout=60) for result in sent]
    print(f"results: {results}")
    return results


if __name__ == "__main__":
    main()

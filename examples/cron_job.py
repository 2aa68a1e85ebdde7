"""A nightly job that runs once per slot, though two schedulers fire it.

Two hosts run the same schedule for availability, or a scheduler catches up on a
slot it thinks it missed: the job's key is its name and its slot time, so every
firing of one slot after the first gets the first one's result, and the job runs
once per slot. A synchronous job, called from plain threads.

    python -m examples.cron_job
"""

import asyncio
import os
import threading
from datetime import UTC, datetime, timedelta

from asgi_idempotency import InProgress, Once, SQLStore

store = SQLStore(os.environ.get("IDEMPOTENCY_DATABASE_URL", "sqlite+aiosqlite:///./jobs.db"))
# A namespace of its own: the default (module and name) differs under `python -m`.
once = Once(store, namespace="jobs", ttl=timedelta(days=2), lease=timedelta(minutes=1))
runs: list[str] = []  # stands in for the report the job writes


@once(key=lambda slot: f"nightly-report:{slot}")
def nightly_report(slot: str) -> dict[str, str]:
    runs.append(slot)
    return {"slot": slot, "written_by": threading.current_thread().name}


def scheduler(slot: str) -> None:
    me = threading.current_thread().name
    try:
        report = nightly_report(slot)
    except InProgress as busy:
        # The other scheduler is at it now: nothing to do for this slot.
        print(f"{me}: {slot} is running elsewhere (retry in {busy.retry_after:.1f} s)")
    else:
        print(f"{me}: {slot} done, report written by {report['written_by']}")


def main() -> list[str]:
    asyncio.run(store.create_all())  # development; `asgi-idempotency migrate` in production
    today = datetime.now(UTC).replace(hour=2, minute=0, second=0, microsecond=0)
    slot = today.isoformat()  # the slot both schedulers fire: 02:00 UTC today
    schedulers = [threading.Thread(target=scheduler, args=(slot,), name=n) for n in "AB"]
    for thread in schedulers:
        thread.start()
    for thread in schedulers:
        thread.join()
    once.close()  # the guard's own event loop, which sync calls use
    print(f"runs: {runs}")
    return runs


if __name__ == "__main__":
    main()

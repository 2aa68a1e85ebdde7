"""One process of ``test_sqlite_storm``: claim keys on a shared SQLite file, print what it got.

``python -m tests.stores._sqlite_storm_worker URL NAME SHARED OWN``: prints ``ready``,
connects, waits for a line on stdin, then claims the ``SHARED`` keys every process claims and
``OWN`` keys of its own, 24 at a time, completing each key it claimed with its name
as the body; prints one JSON line: outcomes per key and any errors.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import uuid
from datetime import UTC, datetime, timedelta

from asgi_idempotency import SQLStore
from asgi_idempotency.core.lifecycle import ClaimOutcome, claim
from asgi_idempotency.stores.base import StoredResponse


async def main(url: str, name: str, shared: int, own: int) -> None:
    store = SQLStore(url)
    now = datetime.now(UTC)
    keys = [f"shared-{i}" for i in range(shared)] + [f"own-{name}-{i}" for i in range(own)]
    random.shuffle(keys)
    outcomes: dict[str, str] = {}
    errors: list[str] = []
    sem = asyncio.Semaphore(24)

    async def one(key: str) -> None:
        token = uuid.uuid4().hex
        async with sem:
            try:
                got = await claim(
                    store, key, "h", token,
                    now=now, lease=timedelta(seconds=60),
                    ttl=timedelta(hours=1),
                )  # fmt: skip
                outcomes[key] = got.outcome.value
                if got.outcome is ClaimOutcome.CLAIMED:
                    response = StoredResponse(201, (), name.encode())
                    done = await store.complete(
                        key, token, response, now=now, ttl=timedelta(hours=1)
                    )
                    if not done:
                        errors.append(f"{key}: complete found no claim")
            except Exception as exc:
                errors.append(f"{key}: {exc!r}")

    try:
        await one(f"warm-{name}")  # connected before the start line
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await asyncio.gather(*(one(k) for k in keys))
    finally:
        await store.close()
    print(json.dumps({"outcomes": outcomes, "errors": errors}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))

"""The batcher's ``inline=`` option (the Redis store's pipelines use it): a request that
finds the batcher idle goes alone from its caller's task; what arrives meanwhile queues
and leaves as one batch in the batcher's task, as without the option."""

from __future__ import annotations

import asyncio

import pytest

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.batching import Batcher

pytestmark = pytest.mark.anyio


async def test_a_lone_request_runs_inline_and_arrivals_queue_behind_it() -> None:
    release = asyncio.Event()
    tasks: list[asyncio.Task[object] | None] = []
    batches: list[list[int]] = []

    async def alone(request: int) -> int:
        tasks.append(asyncio.current_task())
        await release.wait()
        return request * 10

    async def run(batch: list[int]) -> list[int]:
        batches.append(batch)
        return [r * 10 for r in batch]

    batcher: Batcher[int, int] = Batcher(run, key=lambda r: r, inline=alone)
    first = asyncio.create_task(batcher.submit(1))
    await asyncio.sleep(0)
    assert tasks == [first]  # sent from its own task, at once
    rest = [asyncio.create_task(batcher.submit(n)) for n in (2, 3, 4)]
    await asyncio.sleep(0)
    assert batches == []  # queued while the lone one is in flight
    release.set()
    assert await asyncio.gather(first, *rest) == [10, 20, 30, 40]
    assert batches == [[2, 3, 4]]  # then together, in arrival order
    assert (batcher.stats.statements, batcher.stats.operations) == (2, 4)
    assert await batcher.submit(5) == 50  # idle again: inline
    assert len(tasks) == 2


async def test_inline_failures_are_store_errors_or_bugs_as_in_a_batch() -> None:
    async def down(request: int) -> int:
        raise StoreError("ConnectionError: refused")

    async def bug(request: int) -> int:
        raise KeyError("ours")

    async def run(batch: list[int]) -> list[int]:
        return batch

    with pytest.raises(StoreError, match="refused"):
        await Batcher(run, key=lambda r: r, inline=down).submit(1)
    with pytest.raises(RuntimeError, match="KeyError") as raised:
        await Batcher(run, key=lambda r: r, inline=bug).submit(1)
    assert isinstance(raised.value.__cause__, KeyError)


async def test_without_inline_every_request_goes_by_run() -> None:
    seen: list[list[int]] = []

    async def run(batch: list[int]) -> list[int]:
        seen.append(batch)
        return batch

    assert await Batcher(run, key=lambda r: r).submit(7) == 7
    assert seen == [[7]]


async def test_a_cancelled_inline_request_still_lets_the_queue_go() -> None:
    """Cancelling the request that runs inline cancels its own statement (as without
    batching); the requests queued behind it are sent all the same."""
    started = asyncio.Event()

    async def alone(request: int) -> int:
        started.set()
        await asyncio.Event().wait()  # never answers
        raise AssertionError

    async def run(batch: list[int]) -> list[int]:
        return [r * 10 for r in batch]

    batcher: Batcher[int, int] = Batcher(run, key=lambda r: r, inline=alone)
    first = asyncio.create_task(batcher.submit(1))
    await started.wait()
    rest = [asyncio.create_task(batcher.submit(n)) for n in (2, 3)]
    await asyncio.sleep(0)
    first.cancel()
    assert await asyncio.gather(*rest) == [20, 30]
    with pytest.raises(asyncio.CancelledError):
        await first

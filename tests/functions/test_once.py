"""The function guard (:class:`Once`) on every store, through the one lifecycle.

A storm of one key runs once; a replay does not run; other arguments raise
``KeyReused``; an exception releases the key; sync functions from plain threads
behave as async ones; a holder SIGKILLed mid-call is taken over after its lease,
exactly once, by another process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from asgi_idempotency import (
    InProgress,
    KeyReused,
    MemoryStore,
    Once,
    OnceError,
    RecordStatus,
    SQLStore,
    StoreError,
)
from asgi_idempotency.core.errors import IdempotencyError
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.functions.once import record_key
from asgi_idempotency.stores.base import Store, utcnow

from ..conftest import emptied
from . import once_holder

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
STORM = 50
POLL = 0.02  # retry_after here: waiters poll often, so the tests wait little
LONG = timedelta(seconds=30)  # a wait no passing test comes near
MSG = {"id": "msg-7f3a", "order": "A-88214", "amount_p": 4500}
REFUND = {"refund": "A-88214", "amount_p": 4500}


async def until(condition: Callable[[], Awaitable[bool]], within: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds."""
    deadline = asyncio.get_running_loop().time() + within
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(POLL)


async def served_here(store: Store) -> None:
    """Let ``store`` take this loop as its own before a guard's loop takes it over.

    The fixture empties SQL tables through ``store.engine`` directly, which leaves a
    connection of this loop in the engine's pool without the store knowing of any loop;
    a store that has served a loop hands its pool over when the next loop comes.
    """
    await store.get(record_key("-", "-"))


def in_threads(fn: Callable[[], Any], n: int) -> list[Any]:
    """Call ``fn`` from ``n`` plain threads (no event loop) released together; the
    results, exceptions in their place."""
    start = threading.Barrier(n)

    def one() -> Any:
        start.wait()
        try:
            return fn()
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: one(), range(n)))


# --- async functions ----------------------------------------------------------------


async def test_a_storm_of_one_key_runs_once_the_rest_are_told_in_progress(store: Store) -> None:
    once = Once(store, namespace="storm", retry_after=POLL)
    runs, gate = 0, asyncio.Event()
    refused: list[InProgress] = []
    all_refused = asyncio.Event()

    @once(key=lambda msg: msg["id"])
    async def handle(msg: dict[str, Any]) -> dict[str, Any]:
        nonlocal runs
        runs += 1
        await gate.wait()
        return {"refund": msg["order"], "amount_p": msg["amount_p"]}

    async def attempt() -> dict[str, Any]:
        try:
            return await handle(MSG)
        except InProgress as exc:
            refused.append(exc)
            if len(refused) == STORM - 1:
                all_refused.set()
            raise

    tasks = [asyncio.create_task(attempt()) for _ in range(STORM)]
    await asyncio.wait_for(all_refused.wait(), 30)
    assert runs == 1
    gate.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert [o for o in outcomes if not isinstance(o, InProgress)] == [REFUND]
    # Never past the holder's lease (30 s), and no longer than the short interval.
    assert all(0 < exc.retry_after <= POLL for exc in refused)
    assert await handle(dict(MSG)) == REFUND  # a replay: the stored result
    assert runs == 1


async def test_a_storm_that_waits_gets_the_one_result(store: Store) -> None:
    once = Once(store, namespace="storm-wait", wait=LONG, retry_after=POLL)
    runs, entered, gate = 0, asyncio.Event(), asyncio.Event()

    @once(key=lambda msg: msg["id"])
    async def handle(msg: dict[str, Any]) -> dict[str, Any]:
        nonlocal runs
        runs += 1
        entered.set()
        await gate.wait()
        return {"refund": msg["order"], "amount_p": msg["amount_p"]}

    tasks = [asyncio.create_task(handle(MSG)) for _ in range(STORM)]
    await asyncio.wait_for(entered.wait(), 30)
    await asyncio.sleep(5 * POLL)  # the others are polling the held key by now
    gate.set()
    assert await asyncio.gather(*tasks) == [REFUND] * STORM
    assert runs == 1


async def test_other_arguments_or_another_function_raise_key_reused(store: Store) -> None:
    once = Once(store, namespace="refunds")
    runs: list[str] = []

    async def issue_refund(order: str, amount_p: float, currency: str = "GBP") -> dict[str, Any]:
        runs.append(order)
        return {"refund": order, "amount_p": amount_p, "currency": currency}

    async def cancel_order(order: str, amount_p: float, currency: str = "GBP") -> dict[str, Any]:
        runs.append("cancel")
        return {}

    first = await once.call("refund:A-88214", issue_refund, order="A-88214", amount_p=4500)
    # The same call spelt otherwise (positional, the default given, 4500.0): a replay.
    same = await once.call("refund:A-88214", issue_refund, "A-88214", 4500.0, currency="GBP")
    assert same == first == {"refund": "A-88214", "amount_p": 4500, "currency": "GBP"}
    with pytest.raises(KeyReused) as reused:
        await once.call("refund:A-88214", issue_refund, order="A-88214", amount_p=4501)
    with pytest.raises(KeyReused):
        await once.call("refund:A-88214", cancel_order, order="A-88214", amount_p=4500)
    assert runs == ["A-88214"]
    assert isinstance(reused.value, OnceError)
    assert not isinstance(reused.value, IdempotencyError)  # not an HTTP answer
    assert "refund:A-88214" not in str(reused.value)  # the key's digest, never the key


async def test_an_exception_releases_the_key_and_the_next_call_runs(store: Store) -> None:
    once = Once(store, namespace="flaky")
    attempts = 0

    @once(key=lambda order: f"refund:{order}")
    async def refund(order: str) -> dict[str, Any]:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("payment provider answered 503")
        return {"refund": order, "attempt": attempts}

    with pytest.raises(RuntimeError, match="503"):
        await refund("A-1")
    assert await store.get(record_key("flaky", "refund:A-1")) is None  # released
    assert await refund("A-1") == {"refund": "A-1", "attempt": 2}
    assert await refund("A-1") == {"refund": "A-1", "attempt": 2}
    assert attempts == 2


async def test_default_namespaces_keep_two_functions_apart(store: Store) -> None:
    once = Once(store)
    ran: list[str] = []

    @once(key=lambda n: str(n))
    async def ship(n: int) -> str:
        ran.append("ship")
        return "shipped"

    @once(key=lambda n: str(n))
    async def bill(n: int) -> str:
        ran.append("bill")
        return "billed"

    assert [await ship(1), await bill(1), await ship(1), await bill(1)] == [
        "shipped", "billed", "shipped", "billed",
    ]  # fmt: skip
    assert ran == ["ship", "bill"]


async def test_the_lease_is_renewed_while_the_function_runs(store: Store) -> None:
    lease = timedelta(milliseconds=600)
    once = Once(store, namespace="slow", lease=lease, retry_after=POLL)
    entered, gate = asyncio.Event(), asyncio.Event()
    key = record_key("slow", "job-1")

    @once(key=lambda: "job-1")
    async def slow() -> str:
        entered.set()
        await gate.wait()
        return "done"

    task = asyncio.create_task(slow())
    await asyncio.wait_for(entered.wait(), 30)
    first = await store.get(key)
    assert first is not None

    async def renewed_past_the_first_lease() -> bool:
        now = await store.get(key)
        return now is not None and now.locked_until > first.locked_until + lease

    await until(renewed_past_the_first_lease)
    assert utcnow() > first.locked_until  # the first lease is over, the claim is not
    with pytest.raises(InProgress):
        await slow()
    gate.set()
    assert await task == "done"


async def test_a_store_that_fails_raises_store_error_and_nothing_runs(refused_url: str) -> None:
    port = refused_url.rsplit(":", 1)[1]
    store = SQLStore(f"postgresql+asyncpg://postgres@127.0.0.1:{port}/none")
    once = Once(store, namespace="down")
    ran: list[int] = []

    async def effect(n: int) -> int:
        ran.append(n)
        return n

    def sync_effect(n: int) -> int:
        ran.append(n)
        return n

    try:
        with pytest.raises(StoreError):
            await once.call("k", effect, 1)
        with pytest.raises(StoreError):
            await asyncio.to_thread(once.call_sync, "k", sync_effect, 2)
    finally:
        once.close()
        await store.close()
    assert ran == []


# --- sync functions, from plain threads ----------------------------------------------


async def test_a_sync_storm_from_plain_threads_runs_once(store: Store) -> None:
    await served_here(store)
    once = Once(store, namespace="sync-storm", retry_after=POLL)
    runs, lock = 0, threading.Lock()
    gate, refused_all = threading.Event(), threading.Event()
    refused: list[InProgress] = []

    @once(key=lambda order, amount_p: f"refund:{order}")
    def refund(order: str, amount_p: int) -> dict[str, Any]:
        nonlocal runs
        with lock:
            runs += 1
        assert gate.wait(30)
        return {"refund": order, "amount_p": amount_p}

    def attempt() -> dict[str, Any]:
        try:
            return refund("A-88214", 4500)
        except InProgress as exc:
            with lock:
                refused.append(exc)
                if len(refused) == STORM - 1:
                    refused_all.set()
            raise

    def open_gate() -> None:  # once every other thread has been refused
        if refused_all.wait(30):
            gate.set()

    def storm() -> list[Any]:
        with ThreadPoolExecutor(1) as opener:
            opener.submit(open_gate)
            return in_threads(attempt, STORM)

    try:
        outcomes = await asyncio.to_thread(storm)
        assert runs == 1
        assert [o for o in outcomes if not isinstance(o, InProgress)] == [REFUND]
        assert len(refused) == STORM - 1
        assert await asyncio.to_thread(refund, "A-88214", 4500) == REFUND  # a replay
        assert runs == 1
    finally:
        once.close()


async def test_sync_waiting_threads_get_the_result_and_async_calls_share_the_loop(
    store: Store,
) -> None:
    await served_here(store)
    once = Once(store, namespace="sync-wait", wait=LONG, retry_after=POLL)
    runs, lock, entered, gate = 0, threading.Lock(), threading.Event(), threading.Event()

    @once(key=lambda order: f"refund:{order}")
    def refund(order: str) -> dict[str, Any]:
        nonlocal runs
        with lock:
            runs += 1
        entered.set()
        assert gate.wait(30)
        return {"refund": order}

    def open_gate() -> None:  # once the others have had time to find the key held
        if entered.wait(30):
            gate.wait(5 * POLL)
            gate.set()

    def storm() -> list[Any]:
        with ThreadPoolExecutor(1) as opener:
            opener.submit(open_gate)
            return in_threads(lambda: refund("A-1"), 8)

    async def refund_async(order: str) -> dict[str, Any]:
        raise AssertionError("a replay must not run")

    try:
        assert await asyncio.to_thread(storm) == [{"refund": "A-1"}] * 8
        assert runs == 1
        # An async call on this guard now goes through the guard's own loop too.
        with pytest.raises(KeyReused):  # another function, the same namespace and key
            await once.call("refund:A-1", refund_async, "A-1")
    finally:
        once.close()


async def test_a_sync_exception_releases_the_key(store: Store) -> None:
    await served_here(store)
    once = Once(store, namespace="sync-flaky")
    attempts: list[int] = []

    def flaky(n: int) -> int:
        attempts.append(n)
        if len(attempts) == 1:
            raise ConnectionError("downstream reset")
        return n * 2

    def calls() -> list[Any]:
        out: list[Any] = []
        for _ in range(3):
            try:
                out.append(once.call_sync("job", flaky, 21))
            except ConnectionError as exc:
                out.append(exc)
        return out

    try:
        first, second, third = await asyncio.to_thread(calls)
    finally:
        once.close()
    assert isinstance(first, ConnectionError)
    assert second == third == 42
    assert attempts == [21, 21]


# --- cancellation, codecs, keys, logs -----------------------------------------------


async def test_a_cancelled_call_keeps_its_claim_until_the_lease_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="asgi_idempotency")
    lease = timedelta(milliseconds=300)
    store = MemoryStore()
    once = Once(store, namespace="cancel", lease=lease, retry_after=POLL)
    entered = asyncio.Event()
    runs = 0

    @once(key=lambda secret: f"key-{secret}")
    async def charge(secret: str) -> str:
        nonlocal runs
        runs += 1
        entered.set()
        await asyncio.sleep(3600 if runs == 1 else 0)
        return "charged"

    task = asyncio.create_task(charge("s3cr3t-argument"))
    await asyncio.wait_for(entered.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(InProgress) as early:
        await charge("s3cr3t-argument")
    await asyncio.sleep(lease.total_seconds() + POLL)
    assert await charge("s3cr3t-argument") == "charged"  # taken over after the lease
    assert runs == 2
    events = [getattr(r, "event", None) for r in caplog.records]
    assert "idempotency.cancelled" in events
    assert "idempotency.takeover" in events
    assert "s3cr3t" not in caplog.text
    assert "s3cr3t" not in str(early.value)


async def test_a_codec_stores_other_types_and_every_call_returns_its_round_trip() -> None:
    class Stamps:
        def dumps(self, value: Any, /) -> bytes:
            return value.isoformat().encode()  # type: ignore[no-any-return]  # a datetime

        def loads(self, data: bytes, /) -> Any:
            return datetime.fromisoformat(data.decode())

    once = Once(MemoryStore(), namespace="stamps", codec=Stamps())
    at = datetime(2026, 12, 4, 18, 0)

    async def stamp() -> datetime:
        return at

    assert await once.call("nightly:2026-12-04", stamp) == at
    assert await once.call("nightly:2026-12-04", stamp) == at
    # orjson's default: a tuple comes back a list, on the first call as on a replay.
    plain = Once(MemoryStore(), namespace="tuples")

    async def pair() -> tuple[int, int]:
        return (1, 2)

    result: object = await plain.call("p", pair)
    assert result == [1, 2]


async def test_arguments_and_keys_are_checked_before_anything_is_claimed() -> None:
    store = MemoryStore()
    once = Once(store, namespace="checks")

    async def at(when: object) -> None: ...

    with pytest.raises(ValueError, match="canonical JSON"):
        await once.call("k", at, datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="non-empty"):
        await once.call("", at, "2026-01-01")
    not_a_str: Any = lambda when: 42  # noqa: E731  # typed, it would not be a key function
    with pytest.raises(TypeError, match="a key is a str"):
        await once(key=not_a_str)(at)("2026-01-01")
    with pytest.raises(TypeError):
        Once(store, wait=5)  # type: ignore[arg-type]  # a bare number: seconds or ms?
    with pytest.raises(ValueError, match="exceeds ttl"):
        Once(store, ttl=timedelta(seconds=1), lease=timedelta(seconds=2))
    assert await store.find("", limit=10) == []


def test_function_records_never_share_a_key_with_requests() -> None:
    for space, key in [("alice", "k"), ("", "k"), ("refunds", "a\x00b"), ("h1:x", "y")]:
        assert record_key(space, key) != scoped_key(space, key)
        assert record_key(space, key) != scoped_key(space, key, "example.com")
    assert record_key("a:b", "c") != record_key("a", "b:c")


# --- a holder killed mid-call, in another process ------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_holder_sigkilled_mid_call_is_taken_over_after_its_lease_exactly_once(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url: str = request.getfixturevalue("sqlite_url" if kind == "sqlite" else "pg_url")
    effects = tmp_path / "effects"
    key = record_key(once_holder.NAMESPACE, "charge:A-1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    # One store instance per event loop: the probe on the test's, the guard on its own.
    async with emptied(SQLStore(url)) as probe, emptied(SQLStore(url)) as guarded_store:
        await served_here(guarded_store)
        holder = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.functions.once_holder",
            url,
            str(effects),
            cwd=ROOT,
            env=env,
        )
        try:

            async def holding() -> bool:
                record = await probe.get(key)
                return effects.exists() and record is not None

            await until(holding, within=30)
            held = await probe.get(key)
            assert held is not None

            async def renewed() -> bool:  # a live holder renews its one-second lease
                record = await probe.get(key)
                return record is not None and record.locked_until > held.locked_until

            await until(renewed)
        finally:
            holder.send_signal(signal.SIGKILL)
            await holder.wait()
        assert holder.returncode == -signal.SIGKILL
        abandoned = await probe.get(key)
        assert abandoned is not None
        assert abandoned.status is RecordStatus.IN_PROGRESS

        once = once_holder.make_once(guarded_store, retry_after=POLL)
        at_once = once_holder.guarded(once)
        waiting = once_holder.guarded(once, wait=timedelta(seconds=10))
        try:
            early = await asyncio.to_thread(in_threads, lambda: at_once("A-1", str(effects)), 1)
            assert utcnow() < abandoned.locked_until  # answered inside the dead holder's lease
            racers = await asyncio.to_thread(in_threads, lambda: waiting("A-1", str(effects)), 10)
        finally:
            once.close()
        done = await probe.get(key)

    assert isinstance(early[0], InProgress)
    assert racers == [{"order": "A-1", "status": "charged"}] * 10
    # The holder's effect, then exactly one take-over's.
    assert effects.read_text() == "A-1\nA-1\n"
    assert done is not None
    assert done.status is RecordStatus.COMPLETED

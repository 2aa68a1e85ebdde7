"""Natural batching (``SQLStore(batching=True)``): every guarantee of one request per statement.

The batcher alone (no database) for its rules, then the Postgres store: the same key
twice in one batch, take-overs and mismatches inside a batch, a failing statement,
a cancelled waiter, the batch bound, and round trips counted on the wire.

To hold a batch in flight deterministically, a test inserts one of its keys in an
open transaction: the batch's INSERT waits on that row until the transaction ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection

from asgi_idempotency import ClaimOutcome, RecordStatus, SQLStore, StoredResponse
from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.lifecycle import Claim
from asgi_idempotency.stores.base import NewClaim, utcnow
from asgi_idempotency.stores.batching import Batcher
from asgi_idempotency.stores.sql.postgres_batched import _FIELDS, BatchingPostgresDriver
from asgi_idempotency.stores.sql.statements import PG_BATCHED
from tests.conftest import truncate
from tests.helpers import pgwire
from tests.stores.test_round_trips import _proxied

pytestmark = pytest.mark.anyio

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)
TTL = timedelta(hours=24)
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id":1}')


def tok() -> str:
    return uuid.uuid4().hex


def k(name: str) -> str:
    """A 64-character key, as the middleware's scoped keys are (sha256 hex)."""
    return hashlib.sha256(name.encode()).hexdigest()


async def claim(
    store: SQLStore,
    key: str,
    h: str = "h1",
    token: str | None = None,
    now: datetime = T0,
    orphaned: Callable[[NewClaim], object] | None = None,
    lease: timedelta = LEASE,
) -> Claim:
    return await lifecycle.claim(
        store, key, h, token or tok(), now=now, lease=lease, ttl=TTL,
        orphaned=orphaned,
    )  # fmt: skip


def driver(store: SQLStore) -> BatchingPostgresDriver:
    d = store._driver
    assert isinstance(d, BatchingPostgresDriver)
    return d


# ---------------------------------------------------------------------------------------
# The batcher alone.


class FakeStatement:
    """A ``run`` for :class:`Batcher` that records each batch and returns when released."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: Exception | None = None

    async def __call__(self, batch: list[str]) -> list[str]:
        self.batches.append(list(batch))
        await self.gate.wait()
        fail, self.fail = self.fail, None  # one statement fails
        if fail is not None:
            raise fail
        return [f"ok:{r}" for r in batch]


def key_of(request: str) -> str:
    return request.split("#")[0]  # "a#2" is a second operation on key "a"


async def test_one_request_at_a_time_is_sent_at_once_alone() -> None:
    run = FakeStatement()
    batcher: Batcher[str, str] = Batcher(run, key=key_of)
    for name in ("a", "b", "c"):
        assert await batcher.submit(name) == f"ok:{name}"
    assert run.batches == [["a"], ["b"], ["c"]]
    assert batcher.stats.statements == 3
    assert batcher.stats.per_statement == 1.0


async def test_what_queues_during_a_statement_goes_as_the_next_one() -> None:
    run = FakeStatement()
    run.gate.clear()
    batcher: Batcher[str, str] = Batcher(run, key=key_of)
    first = asyncio.ensure_future(batcher.submit("a"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert run.batches == [["a"]]  # in flight
    rest = [asyncio.ensure_future(batcher.submit(n)) for n in ("b", "c", "d")]
    await asyncio.sleep(0)
    run.gate.set()
    assert await first == "ok:a"
    assert await asyncio.gather(*rest) == ["ok:b", "ok:c", "ok:d"]
    assert run.batches == [["a"], ["b", "c", "d"]]
    assert batcher.stats.largest == 3


async def test_the_same_key_twice_waits_for_the_next_statement_in_order() -> None:
    run = FakeStatement()
    batcher: Batcher[str, str] = Batcher(run, key=key_of)
    answers = await asyncio.gather(*(batcher.submit(n) for n in ("a", "b", "a#2", "c", "a#3")))
    assert answers == ["ok:a", "ok:b", "ok:a#2", "ok:c", "ok:a#3"]
    assert run.batches == [["a", "b", "c"], ["a#2"], ["a#3"]]


async def test_the_batch_size_is_bounded() -> None:
    run = FakeStatement()
    batcher: Batcher[str, str] = Batcher(run, key=key_of, max_size=4)
    answers = await asyncio.gather(*(batcher.submit(str(i)) for i in range(10)))
    assert answers == [f"ok:{i}" for i in range(10)]
    assert [len(b) for b in run.batches] == [4, 4, 2]
    assert batcher.stats.largest == 4


async def test_the_payload_per_statement_is_bounded_but_a_large_request_still_goes() -> None:
    run = FakeStatement()
    batcher: Batcher[str, str] = Batcher(run, key=key_of, size=len, max_bytes=4)
    await asyncio.gather(*(batcher.submit(n) for n in ("aa", "bb", "cc", "dddddd", "e")))
    assert run.batches == [["aa", "bb"], ["cc"], ["dddddd"], ["e"]]


async def test_a_failing_statement_fails_every_request_it_carried_and_only_those() -> None:
    run = FakeStatement()
    run.gate.clear()
    batcher: Batcher[str, str] = Batcher(run, key=key_of)
    first = [asyncio.ensure_future(batcher.submit(n)) for n in ("a", "b", "c")]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    later = asyncio.ensure_future(batcher.submit("d"))
    await asyncio.sleep(0)
    run.fail = StoreError("ConnectionError: gone")
    run.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*first, return_exceptions=True), 5)
    assert all(isinstance(r, StoreError) for r in results)
    assert len({id(r) for r in results}) == 3  # each waiter raises its own exception
    assert await later == "ok:d"


async def test_a_bug_in_the_statement_is_a_bug_for_its_waiters_not_an_outage() -> None:
    run = FakeStatement()
    run.fail = RuntimeError("bug")
    batcher: Batcher[str, str] = Batcher(run, key=key_of)
    with pytest.raises(RuntimeError, match="bug") as raised:
        await batcher.submit("a")
    assert not isinstance(raised.value, StoreError)  # a logged 500, not a 503


async def test_a_cancelled_waiter_cancels_nothing_else_and_its_answer_is_an_orphan() -> None:
    run = FakeStatement()
    run.gate.clear()
    orphans: list[tuple[str, str]] = []
    batcher: Batcher[str, str] = Batcher(
        run, key=key_of, orphan=lambda r, a: orphans.append((r, a))
    )
    tasks = [asyncio.ensure_future(batcher.submit(n)) for n in ("a", "b", "c")]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    queued = asyncio.ensure_future(batcher.submit("d"))  # for the next statement
    await asyncio.sleep(0)
    tasks[1].cancel()
    queued.cancel()
    await asyncio.sleep(0)
    run.gate.set()
    assert await tasks[0] == "ok:a"
    assert await tasks[2] == "ok:c"
    with pytest.raises(asyncio.CancelledError):
        await tasks[1]
    await asyncio.sleep(0)
    assert orphans == [("b", "ok:b")]
    assert run.batches == [["a", "b", "c"]]  # "d" was cancelled before it was sent


async def test_a_closed_batcher_refuses_and_lets_the_last_statement_finish() -> None:
    run = FakeStatement()
    run.gate.clear()
    batcher: Batcher[str, str] = Batcher(run, key=key_of)
    inflight = asyncio.ensure_future(batcher.submit("a"))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(batcher.close())
    await asyncio.sleep(0)
    with pytest.raises(StoreError, match="closed"):
        await batcher.submit("b")
    run.gate.set()
    await closing
    assert await inflight == "ok:a"


def test_the_statements_parameters_are_the_fields_the_driver_sends() -> None:
    for name, fields in _FIELDS.items():
        *arrays, lock_wait = PG_BATCHED[name].names
        columns = [n.split("_", 1)[1] for n in arrays]
        expected = [f.removeprefix("where_").replace("now", "created_at") for f in fields]
        assert columns == expected, name
        assert lock_wait == "lock_timeout", name


# ---------------------------------------------------------------------------------------
# The Postgres store, batching.

pg = pytest.mark.postgres


@pytest.fixture
async def batched(pg_url: str) -> AsyncIterator[SQLStore]:
    store = SQLStore(pg_url, batching=True)
    # These tests hold a batch in flight with a row lock (holding): a batch waits for it
    # rather than ask its requests again alone (test_batching_safety.py tests that).
    driver(store).lock_wait = store._command_timeout
    # They are about batches: a request alone goes through the batcher too, rather than
    # run its statement in its own task.
    driver(store).alone_inline = False
    await truncate(store)
    try:
        yield store
    finally:
        await store.close()


@asynccontextmanager
async def holding(store: SQLStore, key: str) -> AsyncIterator[AsyncConnection]:
    """An uncommitted insert of ``key``: a batch claiming it waits until this ends."""
    async with store.engine.connect() as conn:
        await conn.begin()
        await conn.execute(
            text(
                "INSERT INTO idempotency_records (key, request_hash, status, token, "
                "created_at, locked_until, expires_at) "
                "VALUES (:k, 'blocker', 'in_progress', 'blocker', now(), now(), now())"
            ),
            {"k": key},
        )
        yield conn
        await conn.rollback()


async def in_flight(store: SQLStore, statements: int = 1) -> None:
    """Until the claim batcher has sent ``statements`` statements."""
    for _ in range(500):
        if driver(store).stats["claim"].statements >= statements:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("no batch went out")


async def keys_in_table(store: SQLStore) -> set[str]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(text("SELECT key FROM idempotency_records"))
        return {r[0] for r in rows}


@pg
async def test_batched_store_answers_many_claims_from_few_statements(batched: SQLStore) -> None:
    results = await asyncio.gather(*(claim(batched, k(f"m{i}")) for i in range(64)))
    assert {r.outcome for r in results} == {ClaimOutcome.CLAIMED}
    stats = driver(batched).stats["claim"]
    assert stats.operations == 64
    assert stats.statements < 64


@pg
async def test_the_same_key_twice_in_one_batch_one_wins_the_other_gets_409(
    batched: SQLStore,
) -> None:
    # Everything below queues while the first statement waits on the held row, so it
    # is one batch: the repeated key goes into the statement once, and its repeats are
    # answered with the first one's fresh row (what a statement just after would read).
    async with holding(batched, k("held")):
        blocked = asyncio.ensure_future(claim(batched, k("held")))
        await in_flight(batched)
        same = [asyncio.ensure_future(claim(batched, k("dup"))) for _ in range(5)]
        others = [asyncio.ensure_future(claim(batched, k(f"o{i}"))) for i in range(5)]
        await asyncio.sleep(0.05)
    assert (await blocked).outcome is ClaimOutcome.CLAIMED  # the blocker rolled back
    outcomes = [(await t).outcome for t in same]
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 4
    assert {(await t).outcome for t in others} == {ClaimOutcome.CLAIMED}
    stats = driver(batched).stats["claim"]
    assert stats.statements == 2
    assert stats.largest == 10  # the second batch: five "dup" and the five others
    record = await batched.get(k("dup"))
    assert record is not None
    assert record.status is RecordStatus.IN_PROGRESS
    for t in same:  # each loser was shown the winner's row, not some other
        if t.result().outcome is ClaimOutcome.IN_PROGRESS:
            seen = t.result().record
            assert seen is not None
            assert seen._replace(read_at=None) == record._replace(read_at=None)


@pg
async def test_a_storm_of_one_key_is_one_statement_with_one_winner(batched: SQLStore) -> None:
    # Alone in its batch, the key goes as the one-row statement; its repeats share it.
    results = await asyncio.gather(*(claim(batched, k("storm")) for _ in range(40)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 39
    assert driver(batched).stats["claim"].statements == 1


@pg
async def test_the_same_key_with_another_body_in_one_batch_is_a_mismatch(
    batched: SQLStore,
) -> None:
    async with holding(batched, k("held")):
        blocked = asyncio.ensure_future(claim(batched, k("held")))
        await in_flight(batched)
        first = asyncio.ensure_future(claim(batched, k("dup2"), h="h1"))
        other = asyncio.ensure_future(claim(batched, k("dup2"), h="h2"))
        fresh = asyncio.ensure_future(claim(batched, k("fresh2")))
        await asyncio.sleep(0.05)
    await blocked
    assert (await first).outcome is ClaimOutcome.CLAIMED
    assert (await other).outcome is ClaimOutcome.MISMATCH
    assert (await fresh).outcome is ClaimOutcome.CLAIMED


@pg
async def test_take_over_and_expiry_inside_a_batch_stay_conditional_and_fenced(
    batched: SQLStore,
) -> None:
    # Postgres decides leases and expiry on its own clock: a short lease, run out for real.
    short = timedelta(seconds=1)
    old = tok()
    await claim(batched, k("abandoned"), token=old, lease=short)
    done = tok()
    await claim(batched, k("expired"), token=done, lease=short)
    assert await batched.complete(k("expired"), done, RESPONSE, now=T0, ttl=short)
    await asyncio.sleep(short.total_seconds() + 0.2)
    later = utcnow()
    # One batch: three claimants race for the abandoned row, one claims the expired key,
    # one claims a fresh key.
    results = await asyncio.gather(
        *(claim(batched, k("abandoned"), now=later) for _ in range(3)),
        claim(batched, k("expired"), h="other", now=later),
        claim(batched, k("fresh"), now=later),
    )
    outcomes = [r.outcome for r in results]
    assert outcomes[:3].count(ClaimOutcome.TAKEN_OVER) == 1
    assert outcomes[:3].count(ClaimOutcome.IN_PROGRESS) == 2
    assert outcomes[3:] == [ClaimOutcome.CLAIMED, ClaimOutcome.CLAIMED]
    # The old owner wakes up: fenced row by row inside batches of several (each of its
    # operations shares its statement with live owners' operations on other keys).
    new_owner = await batched.get(k("abandoned"))
    assert new_owner is not None
    assert new_owner.token != old
    owners = {name: tok() for name in ("o1", "o2", "o3")}
    for name, t in owners.items():
        await claim(batched, k(name), token=t, now=later)
    stats = driver(batched).stats
    sent = {kind: stats[kind].statements for kind in ("complete", "renew", "release")}
    stale, renewed, released, *live = await asyncio.gather(
        batched.complete(k("abandoned"), old, RESPONSE, now=later, ttl=TTL),
        batched.renew(k("abandoned"), old, now=later, lease=2 * LEASE),
        batched.release(k("abandoned"), old),
        batched.complete(k("o1"), owners["o1"], RESPONSE, now=later, ttl=TTL),
        batched.renew(k("o2"), owners["o2"], now=later, lease=2 * LEASE),
        batched.release(k("o3"), owners["o3"]),
    )
    assert (stale, renewed, released) == (False, False, False)
    assert live == [True, True, True]
    for kind, before in sent.items():  # one two-row statement each
        assert stats[kind].statements == before + 1, kind
        assert stats[kind].largest >= 2, kind
    kept = await batched.get(k("abandoned"))
    assert kept is not None
    assert kept._replace(read_at=None) == new_owner._replace(read_at=None)
    assert await batched.complete(k("abandoned"), new_owner.token, RESPONSE, now=later, ttl=TTL)


@pg
async def test_mismatch_replay_and_409_inside_one_batch(batched: SQLStore) -> None:
    done = tok()
    await claim(batched, k("done"), token=done)
    await batched.complete(k("done"), done, RESPONSE, now=T0, ttl=TTL)
    await claim(batched, k("running"))
    async with holding(batched, k("held")):
        blocked = asyncio.ensure_future(claim(batched, k("held")))
        await in_flight(batched)
        batch = [
            asyncio.ensure_future(claim(batched, k("done"), h="h2")),  # 422
            asyncio.ensure_future(claim(batched, k("done"))),  # replay
            asyncio.ensure_future(claim(batched, k("running"), h="h2")),  # 422
            asyncio.ensure_future(claim(batched, k("running"))),  # 409
            asyncio.ensure_future(claim(batched, k("new"))),
        ]
        await asyncio.sleep(0.05)
    await blocked
    outcomes = [(await t).outcome for t in batch]
    assert outcomes == [
        ClaimOutcome.MISMATCH,
        ClaimOutcome.COMPLETED,
        ClaimOutcome.MISMATCH,
        ClaimOutcome.IN_PROGRESS,
        ClaimOutcome.CLAIMED,
    ]
    replay = (await batch[1]).record
    assert replay is not None
    assert replay.response == RESPONSE


@pg
async def test_a_failing_statement_fails_its_whole_batch_and_leaves_no_row(
    batched: SQLStore,
) -> None:
    # A key too long for the column makes the one INSERT of its batch fail: every claim
    # in that batch gets StoreError (the 503 path), and none of their rows exists.
    async with holding(batched, k("held")):
        blocked = asyncio.ensure_future(claim(batched, k("held")))
        await in_flight(batched)
        doomed = [asyncio.ensure_future(claim(batched, k(f"d{i}"))) for i in range(5)]
        doomed.append(asyncio.ensure_future(claim(batched, "x" * 65)))
        await asyncio.sleep(0.05)
    await blocked
    results = await asyncio.wait_for(asyncio.gather(*doomed, return_exceptions=True), 10)
    assert all(isinstance(r, StoreError) for r in results), results
    assert "value too long" in str(results[0])
    assert await keys_in_table(batched) == {k("held")}
    # The store goes on: the next batch is sent and answered.
    assert (await claim(batched, k("d0"))).outcome is ClaimOutcome.CLAIMED


@pg
async def test_a_failing_completion_batch_fails_every_completion_in_it(
    batched: SQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = [tok() for _ in range(3)]
    for i, t in enumerate(tokens):
        await claim(batched, k(f"c{i}"), token=t)
    inner = driver(batched).inner
    real = inner._run

    async def broken(op: Callable[[Any], Any]) -> Any:
        raise StoreError("ConnectionResetError: injected")

    monkeypatch.setattr(inner, "_run", broken)
    completions = asyncio.gather(
        *(batched.complete(k(f"c{i}"), t, RESPONSE, now=T0, ttl=TTL) for i, t in enumerate(tokens)),
        return_exceptions=True,
    )
    results = await asyncio.wait_for(completions, 10)
    assert all(isinstance(r, StoreError) for r in results)
    monkeypatch.setattr(inner, "_run", real)
    for i in range(3):  # nothing was completed: still in progress, still their owners'
        record = await batched.get(k(f"c{i}"))
        assert record is not None
        assert record.status is RecordStatus.IN_PROGRESS


@pg
async def test_a_cancelled_claimer_cancels_nothing_else_and_its_row_is_released(
    batched: SQLStore,
) -> None:
    released: list[asyncio.Task[bool]] = []

    def orphans(new: NewClaim) -> None:  # as the responder wires it
        released.append(asyncio.ensure_future(lifecycle.release_orphan(batched, new)))

    async with holding(batched, k("held")):
        blocked = asyncio.ensure_future(claim(batched, k("held")))
        await in_flight(batched)
        tasks = [
            asyncio.ensure_future(claim(batched, k(f"w{i}"), orphaned=orphans)) for i in range(4)
        ]
        await in_flight(batched, 1)
        await asyncio.sleep(0.05)
        tasks[1].cancel()  # its batch is queued or in flight: neither is cancelled
        await asyncio.sleep(0.01)
    assert (await blocked).outcome is ClaimOutcome.CLAIMED
    for i in (0, 2, 3):
        assert (await tasks[i]).outcome is ClaimOutcome.CLAIMED
    with pytest.raises(asyncio.CancelledError):
        await tasks[1]
    # Its insert may have committed for nobody: it is released (token-fenced), never
    # left owned until its lease ends, and a retry claims the key at once.
    for _ in range(100):
        if k("w1") not in await keys_in_table(batched):
            break
        await asyncio.sleep(0.01)
    assert k("w1") not in await keys_in_table(batched)
    assert (await claim(batched, k("w1"))).outcome is ClaimOutcome.CLAIMED


@pg
async def test_a_cancelled_claimer_in_flight_has_its_inserted_row_released(
    batched: SQLStore,
) -> None:
    # The cancelled claim is in the statement that waits: its insert commits after its
    # waiter is gone, and the orphan release (lifecycle.release_orphan, wired as the
    # responder wires it) removes it, once that statement has ended.
    released: list[asyncio.Task[bool]] = []

    def orphans(new: NewClaim) -> None:
        released.append(asyncio.ensure_future(lifecycle.release_orphan(batched, new)))

    async with holding(batched, k("held")):
        victim = asyncio.ensure_future(claim(batched, k("victim"), orphaned=orphans))
        other = asyncio.ensure_future(claim(batched, k("other")))
        blocked = asyncio.ensure_future(claim(batched, k("held")))
        await in_flight(batched)
        victim.cancel()
        await asyncio.sleep(0.01)
    assert (await blocked).outcome is ClaimOutcome.CLAIMED
    assert (await other).outcome is ClaimOutcome.CLAIMED
    with pytest.raises(asyncio.CancelledError):
        await victim
    assert [await task for task in released] == [True]
    assert await keys_in_table(batched) == {k("held"), k("other")}
    assert driver(batched).stats["release"].operations == 1


@pg
async def test_the_batch_size_bound_is_respected(pg_url: str) -> None:
    store = SQLStore(pg_url, batching=True)
    await truncate(store)
    await store._driver.close()
    store._driver = BatchingPostgresDriver(
        store.engine, limit=5, timeout=5.0, max_batch=4, lock_wait=5.0
    )
    driver(store).alone_inline = False
    try:
        async with holding(store, k("held")):
            blocked = asyncio.ensure_future(claim(store, k("held")))
            await in_flight(store)
            tasks = [asyncio.ensure_future(claim(store, k(f"b{i}"))) for i in range(10)]
            await asyncio.sleep(0.05)
        await blocked
        assert {(await t).outcome for t in tasks} == {ClaimOutcome.CLAIMED}
        stats = driver(store).stats["claim"]
        assert stats.largest == 4
        assert stats.statements == 1 + 3  # the held one, then 4 + 4 + 2
    finally:
        await store.close()


# ---------------------------------------------------------------------------------------
# Round trips on the wire: never more per request than without batching.


@pytest.fixture
async def wire(pg_url: str) -> AsyncIterator[pgwire.WireCounter]:
    url = make_url(pg_url)
    async with pgwire.WireCounter(url.host or "127.0.0.1", url.port or 5432) as counter:
        yield counter


@pytest.fixture
async def proxied_batched(pg_url: str, wire: pgwire.WireCounter) -> AsyncIterator[SQLStore]:
    # One hot-path connection: every statement is prepared on it in the warm-up.
    store = SQLStore(_proxied(pg_url, wire.port), pool_size=1, batching=True)
    try:
        yield store
    finally:
        await store.close()


@pg
async def test_round_trips_under_load_are_amortised_below_todays(
    batched: SQLStore,
    proxied_batched: SQLStore,
    wire: pgwire.WireCounter,
    tiny: Any,
    record_property: Callable[[str, object], None],
) -> None:
    store = proxied_batched
    n = 64
    app = tiny(store)
    report: dict[str, dict[str, float]] = {}
    async with app.client() as c:
        # Warm-up: every batched statement is prepared (and its array types looked up)
        # once per connection, on its first batch of more than one request.
        for body in ({"a": 0}, {"a": 0}, {"a": -1}):
            warm = [
                c.post("/pay", json=body, headers={"Idempotency-Key": f"w{i}"}) for i in range(8)
            ]
            await asyncio.gather(*warm)
        await asyncio.sleep(0.05)

        async def burst(name: str, keys: list[str], body: dict[str, Any]) -> list[int]:
            wire.reset()
            before = {kind: s.statements for kind, s in driver(store).stats.items()}
            before_ops = {kind: s.operations for kind, s in driver(store).stats.items()}
            responses = await asyncio.gather(
                *(c.post("/pay", json=body, headers={"Idempotency-Key": key}) for key in keys)
            )
            await asyncio.sleep(0.05)
            trips = wire.reset()
            stats = driver(store).stats
            statements = sum(s.statements - before[kind] for kind, s in stats.items())
            ops = sum(s.operations - before_ops[kind] for kind, s in stats.items())
            assert len(trips) == statements  # one round trip per statement, no more
            report[name] = {
                "requests": len(keys),
                "round_trips": len(trips),
                "per_request": len(trips) / len(keys),
                "operations_per_statement": ops / statements,
            }
            return [r.status_code for r in responses]

        fresh = [f"load-{i}" for i in range(n)]
        assert await burst("fresh", fresh, {"a": 1}) == [201] * n
        assert await burst("replay", fresh, {"a": 1}) == [201] * n
        assert await burst("mismatch_422", fresh, {"a": 2}) == [422] * n
        # Duplicates of one in-flight key: they share one row of one statement.
        held = {"Idempotency-Key": "held-409"}
        first = asyncio.ensure_future(c.post("/pay", json={"wait": True}, headers=held))
        await asyncio.wait_for(app.entered.wait(), 5)
        assert await burst("in_flight_409", ["held-409"] * n, {"wait": True}) == [409] * n
        app.gate.set()
        assert (await first).status_code == 201
    record_property("batching", report)
    print(f"\nround trips under load ({n} concurrent requests): {report}")
    assert report["fresh"]["per_request"] <= 2
    for name in ("replay", "mismatch_422", "in_flight_409"):
        assert report[name]["per_request"] <= 1, name
    # Under load a statement carries more than one request: the point of batching.
    assert report["fresh"]["operations_per_statement"] > 1


@pg
@pytest.mark.parametrize("inline", [True, False], ids=["in-its-own-task", "through-the-batcher"])
async def test_one_request_at_a_time_costs_one_round_trip_per_operation(
    batched: SQLStore, proxied_batched: SQLStore, wire: pgwire.WireCounter, inline: bool
) -> None:
    # A lone request's statement is the one-row statement, whether it runs in its own
    # task (the default) or through the batcher (when it arrives behind another).
    store = proxied_batched
    driver(store).alone_inline = inline
    for i in range(3):  # warm-up: connect and prepare
        token = tok()
        await claim(store, k(f"warm-{i}"), token=token)
        await store.complete(k(f"warm-{i}"), token, RESPONSE, now=T0, ttl=TTL)
    wire.reset()
    for i in range(5):
        token = tok()
        assert (await claim(store, k(f"one-{i}"), token=token)).outcome is ClaimOutcome.CLAIMED
        assert await store.complete(k(f"one-{i}"), token, RESPONSE, now=T0, ttl=TTL)
    assert len(wire.reset()) == 2 * 5

"""Batching on Postgres, tried adversarially: what one request per statement never suffered.

Each test here broke the batched store once (issue 26): a key held by an open
transaction, a statement given up on that committed later, batches locking rows in
their own orders, dead pooled connections, and cancellations at every point of a
claim's life. Real Postgres throughout: lock holders are real second connections
(asyncpg), dead connections are ``pg_terminate_backend``, and faults on the wire come
from a loopback proxy (:mod:`tests.helpers.pgfaults`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from asgi_idempotency import ClaimOutcome, RecordStatus, SQLStore
from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.core.lifecycle import Claim
from asgi_idempotency.stores.base import NewClaim
from tests.conftest import emptied
from tests.helpers.pgfaults import FaultProxy
from tests.stores.test_batching import LEASE, RESPONSE, TTL, driver, k, tok

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

# Short, so that a test that waits for it fails fast; long against a lock wait.
COMMAND_TIMEOUT = 3.0


def now() -> datetime:
    return datetime.now(UTC)


async def claim(
    store: SQLStore,
    key: str,
    h: str = "h1",
    token: str | None = None,
    orphaned: Callable[[NewClaim], object] | None = None,
    lease: timedelta = LEASE,
) -> Claim:
    t = now()
    return await lifecycle.claim(
        store, key, h, token or tok(), now=t, lease=lease, ttl=TTL,
        orphaned=orphaned,
    )  # fmt: skip


def dsn(pg_url: str) -> str:
    return make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)


def proxied(pg_url: str, port: int) -> str:
    url = make_url(pg_url).set(host="127.0.0.1", port=port, query={"ssl": "disable"})
    return url.render_as_string(hide_password=False)


def batched_store(url: str, **kwargs: Any) -> AbstractAsyncContextManager[SQLStore]:
    kwargs.setdefault("command_timeout", COMMAND_TIMEOUT)
    return emptied(SQLStore(url, batching=kwargs.pop("batching", True), **kwargs))


@pytest.fixture
async def batched(pg_url: str) -> AsyncIterator[SQLStore]:
    async with batched_store(pg_url) as store:
        yield store


@asynccontextmanager
async def connection(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn(pg_url))
    try:
        yield conn
    finally:
        await conn.close()


INSERT_HELD = (
    "INSERT INTO idempotency_records (key, request_hash, status, token, created_at, "
    "locked_until, expires_at) VALUES ($1, 'holder', 'in_progress', 'holder', now(), "
    "now() + interval '1 hour', now() + interval '1 day')"
)


async def rows(pg_url: str) -> dict[str, tuple[str, str]]:
    """Every committed row: key -> (status, token), read on a connection of its own."""
    async with connection(pg_url) as conn:
        found = await conn.fetch("SELECT key, status, token FROM idempotency_records")
    return {r["key"]: (r["status"], r["token"]) for r in found}


async def timed(coro: Awaitable[Any]) -> tuple[float, Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        result = await coro
    except StoreError as exc:
        result = exc
    return loop.time() - start, result


# ---------------------------------------------------------------------------------------
# 1. A key held by an open transaction answers its own request 409; the rest goes on.


async def _claims_around(store: SQLStore, held: str, position: str) -> list[tuple[str, float, Any]]:
    """Claims of ``held`` and of a dozen free keys at once: (key, seconds, answer) each."""
    others = [k(f"free{i}") for i in range(12)]
    keys = [held, *others] if position == "alone" else [*others[:6], held, *others[6:]]
    results = await asyncio.gather(*(timed(claim(store, key)) for key in keys))
    return [(key, t, r) for key, (t, r) in zip(keys, results, strict=True)]


def _check_only_the_held_key_waits(results: list[tuple[str, float, Any]], held: str) -> None:
    outcomes = {key: r.outcome if isinstance(r, Claim) else r for key, _, r in results}
    assert outcomes.pop(held) is ClaimOutcome.IN_PROGRESS  # 409: in progress by definition
    assert set(outcomes.values()) == {ClaimOutcome.CLAIMED}, outcomes
    # Nobody waited for the command timeout: a held row costs a lock wait, not a stall.
    assert max(t for _, t, _ in results) < COMMAND_TIMEOUT / 3, [t for _, t, _ in results]


@pytest.mark.parametrize("position", ["alone", "in-a-batch"])
async def test_a_key_held_by_the_apps_transaction_answers_409_and_the_rest_goes_on(
    pg_url: str, batched: SQLStore, position: str
) -> None:
    held = k("held-by-app")
    async with connection(pg_url) as app, app.transaction():
        await app.execute(INSERT_HELD, held)  # uncommitted: the app's transaction holds it
        results = await _claims_around(batched, held, position)
    _check_only_the_held_key_waits(results, held)


async def test_a_key_held_by_a_transactional_request_answers_409_and_the_rest_goes_on(
    batched: SQLStore,
) -> None:
    held = k("held-by-tx")
    t = now()
    async with batched.transaction() as tx:
        mine = await lifecycle.claim(tx, held, "h1", tok(), now=t, lease=LEASE, ttl=TTL)
        assert mine.outcome is ClaimOutcome.CLAIMED  # its row is uncommitted, its lock held
        results = await _claims_around(batched, held, "in-a-batch")
    _check_only_the_held_key_waits(results, held)


async def test_a_completion_whose_row_is_locked_waits_alone(pg_url: str, batched: SQLStore) -> None:
    tokens = {k(f"c{i}"): tok() for i in range(10)}
    for key, token in tokens.items():
        assert (await claim(batched, key, token=token)).owned
    held = k("c3")
    async with connection(pg_url) as app:
        tx = app.transaction()
        await tx.start()
        await app.execute("SELECT 1 FROM idempotency_records WHERE key = $1 FOR UPDATE", held)
        completions = {
            key: asyncio.ensure_future(
                timed(batched.complete(key, t, RESPONSE, now=now(), ttl=TTL))
            )
            for key, t in tokens.items()
        }
        others = [f for key, f in completions.items() if key != held]
        done = await asyncio.wait_for(asyncio.gather(*others), COMMAND_TIMEOUT * 2)
        assert [r for _, r in done] == [True] * 9
        assert max(t for t, _ in done) < COMMAND_TIMEOUT / 3, [t for t, _ in done]
        assert not completions[held].done()  # it waits for the row, and only it
        await tx.rollback()
    _, result = await completions[held]
    assert result is True
    assert {s for s, _ in (await rows(pg_url)).values()} == {RecordStatus.COMPLETED.value}


# ---------------------------------------------------------------------------------------
# 2. A statement the store gave up on (503) never commits behind the client's back.

SLOW_TRIGGER = """
CREATE OR REPLACE FUNCTION idem_test_slow_insert() RETURNS trigger AS $$
BEGIN
    IF NEW.request_hash = 'slow' THEN PERFORM pg_sleep(%s); END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER idem_test_slow BEFORE INSERT ON idempotency_records
    FOR EACH ROW EXECUTE FUNCTION idem_test_slow_insert();
"""


@asynccontextmanager
async def slow_inserts(pg_url: str, seconds: float) -> AsyncIterator[None]:
    """Inserts of rows with request_hash 'slow' take ``seconds`` (a stalled server, say)."""
    async with connection(pg_url) as conn:
        await conn.execute(SLOW_TRIGGER % seconds)
    try:
        yield
    finally:
        async with connection(pg_url) as conn:
            await conn.execute(
                "DROP TRIGGER idem_test_slow ON idempotency_records;"
                "DROP FUNCTION idem_test_slow_insert()"
            )


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "per-request"])
async def test_a_claim_answered_503_never_commits_later(pg_url: str, batching: bool) -> None:
    # The store gives up at command_timeout and answers 503; the driver's cancel request
    # is lost on the way (the proxy drops it, as a late one would be). The statement must
    # not commit afterwards: the retries would get 409 for a lease, nothing having run.
    url = make_url(pg_url)
    timeout = 1.0
    async with FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        proxy.drop_cancels = True
        async with (
            batched_store(proxied(pg_url, proxy.port), command_timeout=timeout,
                          batching=batching) as store,
            slow_inserts(pg_url, timeout * 2),
        ):  # fmt: skip
            keys = [k("slow"), *(k(f"s{i}") for i in range(4))]
            results = await asyncio.gather(
                *(
                    timed(claim(store, key, "slow" if i == 0 else "h1"))
                    for i, key in enumerate(keys)
                )
            )
            slow_answer = results[0][1]
            assert isinstance(slow_answer, StoreError), slow_answer
            await asyncio.sleep(timeout * 2.5)  # past the stalled insert's end
            left = await rows(pg_url)
            # Every request that got 503 finds its key free on retry.
            for key, (_, answer) in zip(keys, results, strict=True):
                if isinstance(answer, StoreError):
                    assert key not in left, "a 503'd claim committed after its answer"


# ---------------------------------------------------------------------------------------
# 3. Batches of renewals and completions never deadlock each other.


async def test_a_batch_locks_its_rows_in_key_order_whatever_its_order(
    pg_url: str, batched: SQLStore
) -> None:
    # Three rows, inserted (so laid out) in descending key order; a renewal batch lists
    # them in that order too, and a lock holder keeps the middle one. A batch locking
    # in its array's or the table's order takes the last key first and waits on the
    # middle one; two such batches in opposite orders deadlock. In key order it takes
    # the first key and waits: no cycle is possible.
    low, mid, high = "0" * 64, "8" * 64, "f" * 64
    tokens = {key: tok() for key in (high, mid, low)}
    for key, token in tokens.items():
        assert (await claim(batched, key, token=token)).owned
    d = driver(batched)
    d.lock_wait = COMMAND_TIMEOUT  # long enough to look at the locks it holds meanwhile
    lease_us = LEASE // timedelta(microseconds=1)
    batch = [
        {"where_key": key, "where_token": t, "lease_us": lease_us} for key, t in tokens.items()
    ]
    async with connection(pg_url) as holder, connection(pg_url) as probe:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT 1 FROM idempotency_records WHERE key = $1 FOR UPDATE", mid)
        renewing = asyncio.ensure_future(d._fenced["renew"]._run(batch))
        for _ in range(200):  # until the batch waits on the held row
            waiting = await probe.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
            if waiting:
                break
            await asyncio.sleep(0.01)
        assert waiting, "the batch never waited on the held row"
        async with probe.transaction():
            free = await probe.fetch(
                "SELECT key FROM idempotency_records WHERE key = ANY($1::text[]) "
                "FOR UPDATE SKIP LOCKED",
                [low, high],
            )
        await tx.rollback()
        assert await renewing == [1, 1, 1]
    assert {r["key"] for r in free} == {high}, "the batch locked its rows out of key order"


async def test_renewals_and_completions_in_opposite_orders_never_deadlock(pg_url: str) -> None:
    async with batched_store(pg_url) as one, batched_store(pg_url) as two:
        tokens = {k(f"d{i:02}"): tok() for i in range(48)}
        for key, token in tokens.items():
            assert (await claim(one, key, token=token)).owned
        ordered = sorted(tokens.items())
        failures: list[BaseException] = []

        async def renew(store: SQLStore, items: Sequence[tuple[str, str]], lease: timedelta) -> Any:
            answers = await asyncio.gather(
                *(store.renew(key, t, now=now(), lease=lease) for key, t in items),
                return_exceptions=True,
            )
            failures.extend(a for a in answers if isinstance(a, BaseException))
            assert all(a is True for a in answers if not isinstance(a, BaseException))

        for round_ in range(12):
            lease = LEASE + timedelta(seconds=round_)
            await asyncio.gather(renew(one, ordered, lease), renew(two, ordered[::-1], lease))
        # Completions of every key against renewals of every key, in opposite orders.
        done = await asyncio.gather(
            *(one.complete(key, t, RESPONSE, now=now(), ttl=TTL) for key, t in ordered),
            *(two.renew(key, t, now=now(), lease=LEASE * 2) for key, t in ordered[::-1]),
            return_exceptions=True,
        )
        failures.extend(a for a in done if isinstance(a, BaseException))
        assert failures == []
        assert done[: len(ordered)] == [True] * len(ordered)  # every completion landed


# ---------------------------------------------------------------------------------------
# 4. Dead pooled connections cost nobody an answer.


async def _terminate_others(pg_url: str) -> int:
    async with connection(pg_url) as admin:
        return int(
            await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )


async def test_completions_after_the_server_closed_idle_connections_all_land(
    pg_url: str, batched: SQLStore
) -> None:
    tokens = {k(f"p{i}"): tok() for i in range(16)}
    # Warm the hot path: several connections checked out and idle in the driver.
    await asyncio.gather(*(claim(batched, key, token=t) for key, t in tokens.items()))
    await asyncio.gather(
        *(batched.renew(key, t, now=now(), lease=LEASE) for key, t in tokens.items())
    )
    assert await _terminate_others(pg_url) >= 1
    await asyncio.sleep(0.2)  # the driver has read each connection's end
    answers = await asyncio.gather(
        *(batched.complete(key, t, RESPONSE, now=now(), ttl=TTL) for key, t in tokens.items()),
        return_exceptions=True,
    )
    assert answers == [True] * len(tokens)


async def test_a_batch_cut_on_a_broken_connection_is_retried_once_without_losing_anyone(
    pg_url: str,
) -> None:
    url = make_url(pg_url)
    async with (
        FaultProxy(url.host or "127.0.0.1", url.port or 5432) as proxy,
        batched_store(proxied(pg_url, proxy.port)) as store,
    ):
        tokens = {k(f"r{i}"): tok() for i in range(8)}
        await asyncio.gather(*(claim(store, k(f"warm{i}")) for i in range(8)))  # prepared
        proxy.cut_after("unnest")  # the next batched statement lands, its answer is lost
        answers = await asyncio.gather(
            *(claim(store, key, token=t) for key, t in tokens.items()), return_exceptions=True
        )
        assert proxy.cuts == 1
        # The retry met the rows its first attempt committed: still theirs (CLAIMED),
        # never a 409 for their own request.
        assert [a.outcome if isinstance(a, Claim) else a for a in answers] == [
            ClaimOutcome.CLAIMED
        ] * len(tokens)
        # And a lone one-row claim, cut the same way.
        proxy.cut_after("INSERT")
        alone = await claim(store, k("alone"))
        assert proxy.cuts == 2
        assert alone.outcome is ClaimOutcome.CLAIMED
        # Completions cut after landing: the retry changes nothing, and answers True
        # (completed by their own token), never False (a lost claim, logged as such).
        proxy.cut_after("unnest")
        done = await asyncio.gather(
            *(store.complete(key, t, RESPONSE, now=now(), ttl=TTL) for key, t in tokens.items()),
            return_exceptions=True,
        )
        assert proxy.cuts == 3
        assert done == [True] * len(tokens)
        assert {s for key, (s, _) in (await rows(pg_url)).items() if key in tokens} == {
            RecordStatus.COMPLETED.value
        }
        # A lone completion, sent in its own task, cut the same way.
        token = tok()
        assert (await claim(store, k("lone"), token=token)).owned
        proxy.cut_after("UPDATE")
        assert await store.complete(k("lone"), token, RESPONSE, now=now(), ttl=TTL) is True
        assert proxy.cuts == 4


# ---------------------------------------------------------------------------------------
# 5. A cancelled request's claim never stays stuck; one release path frees it.


class Released:
    """The responder's wiring of ``orphaned``: release_orphan in a task of its own."""

    def __init__(self, store: SQLStore) -> None:
        self.store = store
        self.tasks: list[asyncio.Task[bool]] = []

    def __call__(self, new: NewClaim) -> None:
        self.tasks.append(asyncio.ensure_future(lifecycle.release_orphan(self.store, new)))

    async def settle(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _cancelled_at(
    store: SQLStore, key: str, cancel: Callable[[asyncio.Task[Claim]], Awaitable[None]]
) -> tuple[Claim | None, Released]:
    released = Released(store)
    task = asyncio.ensure_future(claim(store, key, orphaned=released))
    await cancel(task)
    try:
        got: Claim | None = await task
    except asyncio.CancelledError:
        got = None
    await released.settle()
    return got, released


def _passes(n: int) -> Callable[[asyncio.Task[Claim]], Awaitable[None]]:
    async def cancel(task: asyncio.Task[Claim]) -> None:
        for _ in range(n):
            await asyncio.sleep(0)
        task.cancel()

    return cancel


def _after(seconds: float) -> Callable[[asyncio.Task[Claim]], Awaitable[None]]:
    async def cancel(task: asyncio.Task[Claim]) -> None:
        await asyncio.sleep(seconds)
        task.cancel()

    return cancel


@pytest.mark.parametrize("inline", [True, False], ids=["default", "everything-batched"])
async def test_a_claim_cancelled_at_any_point_of_its_life_is_never_left_claimed(
    pg_url: str, batched: SQLStore, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    d = driver(batched)
    d.alone_inline = inline
    run = d._claims._run
    hooks: list[Callable[[], None]] = []

    async def observed(batch: list[dict[str, Any]]) -> Sequence[Any]:
        answers = await run(batch)
        for hook in hooks:
            hook()
        hooks.clear()
        return answers

    monkeypatch.setattr(d._claims, "_run", observed)

    def at_answer(one_pass_later: bool) -> Callable[[asyncio.Task[Claim]], Awaitable[None]]:
        async def cancel(task: asyncio.Task[Claim]) -> None:
            loop = asyncio.get_running_loop()

            # As the statement's answers arrive: before they are handed out, or one loop
            # pass after (the waiter's wake-up is then already scheduled).
            def hook() -> None:
                if one_pass_later:
                    loop.call_soon(task.cancel)
                else:
                    task.cancel()

            hooks.append(hook)

        return cancel

    points: list[tuple[str, Callable[[asyncio.Task[Claim]], Awaitable[None]]]] = [
        *((f"pass{n}", _passes(n)) for n in range(8)),
        *((f"{ms}ms", _after(ms / 1000)) for ms in (0.2, 0.5, 1, 2, 4)),
        ("at the answer", at_answer(False)),
        ("a pass after the answer", at_answer(True)),
    ]
    for name, point in points:
        for crowd in (0, 5):  # alone, and among other claims in one batch
            key = k(f"cancel-{name}-{crowd}")
            others = [
                asyncio.ensure_future(claim(batched, k(f"o-{name}-{i}"))) for i in range(crowd)
            ]
            got, _ = await _cancelled_at(batched, key, point)
            await asyncio.gather(*others)
            record = await batched.get(key)
            if got is None:  # cancelled: nothing ran, so nothing may hold the key
                assert record is None, f"{name}/{crowd}: the key stays claimed"
            else:  # the claim was the caller's before the cancellation landed
                assert got.owned
                assert record is not None


@pytest.mark.parametrize("inline", [True, False], ids=["alone", "in-the-batcher"])
async def test_a_claim_cancelled_in_flight_is_released_once_after_it_landed(
    pg_url: str, batched: SQLStore, inline: bool
) -> None:
    # The claim's statement outlives every retry of a time-based release (a short lease
    # and a stalled insert): the one release path must still free it, with one release.
    # Alone, the statement runs in the request's task and is cut off by its
    # cancellation while the server goes on with it; in the batcher it is not cut off.
    d = driver(batched)
    d.alone_inline = inline
    async with slow_inserts(pg_url, 0.9):
        released = Released(batched)
        lease = timedelta(seconds=1)  # release_orphan's retries span 0.7 s of it
        victim = asyncio.ensure_future(
            claim(batched, k("victim"), "slow", orphaned=released, lease=lease)
        )
        for _ in range(200):
            if d.stats["claim"].statements:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        await released.settle()
        await asyncio.sleep(1.0)  # past the stalled insert: whatever was to land, landed
    assert await batched.get(k("victim")) is None
    assert [t.result() for t in released.tasks] == [True]
    # One release path: one release statement, not one per mechanism.
    assert d.stats["release"].operations == 1

"""The store contract: the pytest tests every store passes, ours and anyone's.

Subclass :class:`StoreContract` in a test module, under a name pytest collects
(``Test…``), and override its ``store`` fixture to yield an *empty* store (the tests
use fixed keys); pytest runs every contract test on it, on asyncio through anyio's
pytest plugin::

    class TestMyStore(StoreContract):
        @pytest.fixture
        async def store(self) -> AsyncIterator[Store]:
            opened = MyStore(...)
            yield opened
            await opened.close()

What it pins: one owner per key (concurrent claims and take-overs have one winner);
``complete``, ``release`` and ``renew`` fenced by the claim's token; completing a
completed row answers False; ``replace`` a compare-and-swap on the row as read; renewal
moves the lease and never lets retention end before it; an ``insert`` meeting its own
token never answers another owner's row; expiry and ``prune``; the regenerated-key
detector working through the store's ``insert``.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from asgi_idempotency import ClaimOutcome, RecordStatus, StoredResponse, lifecycle
from asgi_idempotency.lifecycle import Claim
from asgi_idempotency.regenerated import RegeneratedKeys
from asgi_idempotency.stores.base import (
    BUSY,
    NewClaim,
    Store,
    StoreTransaction,
    TransactionalStore,
)

__all__ = ["Claimant", "StoreContract"]


class Claimant:
    """Claims made as the middleware makes them: on the store, or in a transaction of it.

    In the transactional mode an owned claim keeps its transaction (and the key's
    lock) open until :meth:`complete` commits it or :meth:`release` rolls it back.
    """

    def __init__(self, store: Store, *, transactional: bool) -> None:
        self.store = store
        self.transactional = transactional
        self._held: dict[str, tuple[AsyncExitStack, StoreTransaction]] = {}

    async def claim(
        self, key: str, request_hash: str, token: str, *, now: datetime,
        locked_until: datetime, expires_at: datetime,
    ) -> Claim:  # fmt: skip
        times: dict[str, Any] = {"now": now, "locked_until": locked_until, "expires_at": expires_at}
        if not self.transactional:
            return await lifecycle.claim(self.store, key, request_hash, token, **times)
        assert isinstance(self.store, TransactionalStore)
        stack = AsyncExitStack()
        tx = await stack.enter_async_context(self.store.transaction())
        try:
            claim = await lifecycle.claim(tx, key, request_hash, token, **times)
        except BaseException:
            await stack.aclose()
            raise
        if claim.owned:
            self._held[token] = (stack, tx)
        else:
            await stack.aclose()
        return claim

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, expires_at: datetime
    ) -> bool:
        if not self.transactional:
            return await self.store.complete(key, token, response, expires_at=expires_at)
        stack, tx = self._held.pop(token)
        async with stack:
            await tx.commit(key, token, response, expires_at=expires_at)
        return True

    async def release(self, key: str, token: str) -> bool:
        if not self.transactional:
            return await self.store.release(key, token)
        stack, _ = self._held.pop(token)
        await stack.aclose()  # leaving without commit rolls the claim back
        return True

    async def close(self) -> None:
        for stack, _ in self._held.values():
            await stack.aclose()
        self._held.clear()


T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)
TTL = timedelta(hours=24)
RESPONSE = StoredResponse(
    201, ((b"content-type", b"application/json"), (b"x-a", b"\xff\x00bytes")), b'{"id":1}\x00\xff'
)


def tok() -> str:
    return uuid.uuid4().hex


async def claim(
    store: Store, key: str = "k" * 64, h: str = "h1", token: str | None = None, now: datetime = T0
) -> lifecycle.Claim:
    return await lifecycle.claim(
        store, key, h, token or tok(), now=now, locked_until=now + LEASE, expires_at=now + TTL
    )


async def test_first_claim_wins_then_in_progress(store: Store) -> None:
    assert (await claim(store)).outcome is ClaimOutcome.CLAIMED
    again = await claim(store)
    assert again.outcome is ClaimOutcome.IN_PROGRESS
    assert again.record is not None
    assert again.record.locked_until == T0 + LEASE


async def test_mismatch_is_checked_before_status(store: Store) -> None:
    await claim(store, h="h1")
    assert (await claim(store, h="h2")).outcome is ClaimOutcome.MISMATCH


async def test_complete_then_replay_returns_identical_response(store: Store) -> None:
    t = tok()
    await claim(store, token=t)
    assert await store.complete("k" * 64, t, RESPONSE, expires_at=T0 + TTL)
    replay = await claim(store)
    assert replay.outcome is ClaimOutcome.COMPLETED
    assert replay.record is not None
    assert replay.record.status is RecordStatus.COMPLETED
    assert replay.record.response == RESPONSE
    assert (await claim(store, h="other")).outcome is ClaimOutcome.MISMATCH


async def test_completing_a_completed_row_answers_false_and_changes_nothing(
    store: Store,
) -> None:
    """Only an in-progress row owned by the token completes: a second completion, even
    by the owner's own token, finds a completed row and answers False, as SQL's update
    (which matches ``status = 'in_progress'`` only) does."""
    t = tok()
    await claim(store, token=t)
    assert await store.complete("k" * 64, t, RESPONSE, expires_at=T0 + TTL)
    other = StoredResponse(500, (), b"second")
    assert not await store.complete("k" * 64, t, other, expires_at=T0 + 2 * TTL)
    assert not await store.complete("k" * 64, tok(), other, expires_at=T0 + 2 * TTL)
    record = await store.get("k" * 64)
    assert record is not None
    assert (record.status, record.token, record.response, record.expires_at) == (
        RecordStatus.COMPLETED, t, RESPONSE, T0 + TTL,
    )  # fmt: skip


async def test_release_lets_a_retry_claim_again(store: Store) -> None:
    t = tok()
    await claim(store, token=t)
    assert await store.release("k" * 64, t)
    assert (await claim(store)).outcome is ClaimOutcome.CLAIMED


async def test_wrong_token_can_neither_complete_release_nor_renew(store: Store) -> None:
    await claim(store)
    stranger = tok()
    assert not await store.complete("k" * 64, stranger, RESPONSE, expires_at=T0 + TTL)
    assert not await store.release("k" * 64, stranger)
    assert not await store.renew("k" * 64, stranger, locked_until=T0 + 2 * LEASE)
    record = await store.get("k" * 64)
    assert record is not None
    assert record.status is RecordStatus.IN_PROGRESS


async def test_abandoned_claim_is_taken_over_and_the_old_owner_is_fenced(store: Store) -> None:
    old = tok()
    await claim(store, token=old)
    later = T0 + LEASE + timedelta(seconds=1)
    new = tok()
    assert (await claim(store, token=new, now=later)).outcome is ClaimOutcome.TAKEN_OVER
    # The first owner wakes up: it must not overwrite or delete the new owner's row.
    assert not await store.complete("k" * 64, old, RESPONSE, expires_at=later + TTL)
    assert not await store.release("k" * 64, old)
    assert await store.complete("k" * 64, new, RESPONSE, expires_at=later + TTL)


async def test_abandoned_claim_with_other_body_is_a_mismatch(store: Store) -> None:
    await claim(store, h="h1")
    later = T0 + LEASE + timedelta(seconds=1)
    assert (await claim(store, h="h2", now=later)).outcome is ClaimOutcome.MISMATCH


async def test_renew_keeps_a_live_claim(store: Store) -> None:
    t = tok()
    await claim(store, token=t)
    assert await store.renew("k" * 64, t, locked_until=T0 + 3 * LEASE)
    later = T0 + 2 * LEASE
    assert (await claim(store, now=later)).outcome is ClaimOutcome.IN_PROGRESS


async def test_expired_record_behaves_as_new_before_prune(store: Store) -> None:
    t = tok()
    await claim(store, token=t)
    await store.complete("k" * 64, t, RESPONSE, expires_at=T0 + TTL)
    after = T0 + TTL + timedelta(seconds=1)
    fresh = await claim(store, h="different", now=after)
    assert fresh.outcome is ClaimOutcome.CLAIMED


async def test_prune_deletes_only_expired_rows_in_batches(store: Store) -> None:
    for i in range(5):
        await lifecycle.claim(
            store,
            f"{i:064d}",
            "h",
            tok(),
            now=T0,
            locked_until=T0 + LEASE,
            expires_at=T0 + timedelta(minutes=i + 1),
        )
    now = T0 + timedelta(minutes=3, seconds=30)
    assert await store.prune(now=now, batch_size=2) == 2
    assert await store.prune(now=now, batch_size=2) == 1
    assert await store.prune(now=now, batch_size=2) == 0
    assert await store.get(f"{4:064d}") is not None


async def test_concurrent_claims_have_exactly_one_winner(store: Store) -> None:
    results = await asyncio.gather(*(claim(store) for _ in range(40)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 39


async def test_racing_takeovers_have_exactly_one_winner(store: Store) -> None:
    await claim(store)
    later = T0 + LEASE + timedelta(seconds=1)
    results = await asyncio.gather(*(claim(store, now=later) for _ in range(20)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(ClaimOutcome.TAKEN_OVER) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 19


# The lifecycle's outcome table, claimed both ways: on the store (every kind) and in a
# transaction of it (Postgres). The row before is written with the store's primitives.

LATER = T0 + LEASE + timedelta(seconds=1)  # past the first claim's lease
AFTER_TTL = T0 + TTL + timedelta(seconds=1)  # past the first record's retention
KEY = "k" * 64


async def seed(store: Store, row: str) -> None:
    """Leave ``KEY`` as ``row``: none, running (lease live until LATER), completed, released."""
    if row == "none":
        return
    t = tok()
    assert (await claim(store, key=KEY, h="h1", token=t)).outcome is ClaimOutcome.CLAIMED
    if row == "completed":
        assert await store.complete(KEY, t, RESPONSE, expires_at=T0 + TTL)
    elif row == "released":
        assert await store.release(KEY, t)


async def claim_as(
    claimant: Claimant, h: str = "h1", token: str | None = None, now: datetime = T0
) -> lifecycle.Claim:
    return await claimant.claim(
        KEY, h, token or tok(), now=now, locked_until=now + LEASE, expires_at=now + TTL
    )


@pytest.mark.parametrize(
    ("row", "h", "now", "expected"),
    [
        ("none", "h1", T0, ClaimOutcome.CLAIMED),
        ("released", "h1", T0, ClaimOutcome.CLAIMED),
        ("running", "h1", T0, ClaimOutcome.IN_PROGRESS),
        ("running", "h2", T0, ClaimOutcome.MISMATCH),
        ("running", "h1", LATER, ClaimOutcome.TAKEN_OVER),  # abandoned
        ("running", "h2", LATER, ClaimOutcome.MISMATCH),
        ("completed", "h1", T0, ClaimOutcome.COMPLETED),
        ("completed", "h2", T0, ClaimOutcome.MISMATCH),
        ("completed", "h2", AFTER_TTL, ClaimOutcome.CLAIMED),  # expired, not yet pruned
        ("running", "h2", AFTER_TTL, ClaimOutcome.CLAIMED),
    ],
)
async def test_outcome_table(
    claimant: Claimant, row: str, h: str, now: datetime, expected: ClaimOutcome
) -> None:
    await seed(claimant.store, row)
    t = tok()
    result = await claim_as(claimant, h=h, token=t, now=now)
    assert result.outcome is expected
    if expected is ClaimOutcome.COMPLETED:
        assert result.record is not None
        assert result.record.response == RESPONSE
    if result.owned:
        # The claim is the caller's: completing it stores exactly its response.
        assert await claimant.complete(KEY, t, RESPONSE, expires_at=now + TTL)
        stored = await claimant.store.get(KEY)
        assert stored is not None
        assert (stored.status, stored.token, stored.response) == (
            RecordStatus.COMPLETED, t, RESPONSE,
        )  # fmt: skip


async def test_owned_claim_then_release_lets_a_retry_run(claimant: Claimant) -> None:
    t = tok()
    assert (await claim_as(claimant, token=t)).outcome is ClaimOutcome.CLAIMED
    assert await claimant.release(KEY, t)
    assert await claimant.store.get(KEY) is None
    assert (await claim_as(claimant)).outcome is ClaimOutcome.CLAIMED


async def test_a_held_claim_answers_in_progress(claimant: Claimant) -> None:
    assert (await claim_as(claimant)).owned
    again = await claim_as(claimant)
    assert again.outcome is ClaimOutcome.IN_PROGRESS
    if claimant.transactional:
        assert again.record is None  # answered from the lock: the row is not committed yet
    else:
        assert again.record is not None
        assert again.record.locked_until == T0 + LEASE


async def test_concurrent_claims_either_way_have_one_winner(claimant: Claimant) -> None:
    results = await asyncio.gather(*(claim_as(claimant) for _ in range(30)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 29


async def test_concurrent_takeovers_either_way_have_one_winner(claimant: Claimant) -> None:
    await seed(claimant.store, "running")
    results = await asyncio.gather(*(claim_as(claimant, now=LATER) for _ in range(20)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(ClaimOutcome.TAKEN_OVER) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 19


# replace is a compare-and-swap on the row as read: any change in between makes it fail.


async def test_replace_fails_when_the_lease_was_renewed_after_the_read(store: Store) -> None:
    owner = tok()
    await claim(store, key=KEY, token=owner)
    seen = await store.get(KEY)
    assert seen is not None
    # The owner is alive after all: it renews between the taker's read and its swap.
    assert await store.renew(KEY, owner, locked_until=LATER + LEASE)
    taker = NewClaim(KEY, "h1", tok(), LATER, LATER + LEASE, LATER + TTL)
    assert not await store.replace(seen, taker)
    kept = await store.get(KEY)
    assert kept is not None
    assert (kept.token, kept.locked_until) == (owner, LATER + LEASE)


async def test_replace_fails_when_the_row_was_completed_or_deleted_after_the_read(
    store: Store,
) -> None:
    owner = tok()
    await claim(store, key=KEY, token=owner)
    seen = await store.get(KEY)
    assert seen is not None
    taker = NewClaim(KEY, "h1", tok(), LATER, LATER + LEASE, LATER + TTL)
    assert await store.complete(KEY, owner, RESPONSE, expires_at=T0 + TTL)
    assert not await store.replace(seen, taker)
    completed = await store.get(KEY)
    assert completed is not None
    assert await store.release(KEY, owner) is False  # completed rows are not released
    assert completed.token == owner
    # A row deleted in between: nothing to swap, and nothing is created.
    await store.prune(now=AFTER_TTL)
    assert not await store.replace(seen, taker)
    assert await store.get(KEY) is None


async def test_replace_succeeds_on_the_row_exactly_as_read(store: Store) -> None:
    await claim(store, key=KEY)
    seen = await store.get(KEY)
    assert seen is not None
    taker = NewClaim(KEY, "h1", tok(), LATER, LATER + LEASE, LATER + TTL)
    assert await store.replace(seen, taker)
    rival = NewClaim(KEY, "h1", tok(), LATER, LATER + LEASE, LATER + TTL)
    assert not await store.replace(seen, rival)  # a second taker finds the row changed
    now_owned = await store.get(KEY)
    assert now_owned is not None
    assert now_owned.token == taker.token


# A handler may outlive its ttl: while its owner renews the lease, the claim is never
# expired, to a duplicate claim or to prune, on any store.


async def test_a_renewed_claim_outliving_its_ttl_is_never_expired(store: Store) -> None:
    ttl, lease = timedelta(seconds=2), timedelta(seconds=1)
    owner = tok()
    first = await lifecycle.claim(
        store, KEY, "h1", owner, now=T0, locked_until=T0 + lease, expires_at=T0 + ttl
    )
    assert first.outcome is ClaimOutcome.CLAIMED
    # The owner renews every third of its lease, as LeaseRenewals does, until 2.4 s.
    at = T0
    while at < T0 + timedelta(seconds=2.4):
        at += lease / 3
        assert await store.renew(KEY, owner, locked_until=at + lease)
    live_until = at + lease
    duplicate = T0 + timedelta(seconds=2.5)  # past ttl, within the renewed lease
    again = await claim(store, key=KEY, h="h1", now=duplicate)
    assert again.outcome is ClaimOutcome.IN_PROGRESS
    assert (await claim(store, key=KEY, h="h2", now=duplicate)).outcome is ClaimOutcome.MISMATCH
    assert await store.count_expired(now=duplicate) == 0
    assert await store.prune(now=duplicate) == 0
    record = await store.get(KEY)
    assert record is not None
    assert record.token == owner
    assert record.expires_at >= record.locked_until == live_until
    assert lifecycle.state_of(record, duplicate) is lifecycle.RecordState.RUNNING
    # Its owner completes it: replayed for a ttl from then.
    assert await store.complete(KEY, owner, RESPONSE, expires_at=duplicate + ttl)
    assert (await claim(store, key=KEY, now=duplicate + ttl / 2)).outcome is ClaimOutcome.COMPLETED


async def test_a_claim_no_longer_renewed_expires_after_its_last_lease(store: Store) -> None:
    ttl, lease = timedelta(seconds=2), timedelta(seconds=1)
    owner = tok()
    await lifecycle.claim(
        store, KEY, "h1", owner, now=T0, locked_until=T0 + lease, expires_at=T0 + ttl
    )
    assert await store.renew(KEY, owner, locked_until=T0 + timedelta(seconds=2.5))
    # A renewal moves retention forward only: a shorter lease leaves it where it is.
    assert await store.renew(KEY, owner, locked_until=T0 + timedelta(seconds=1.5))
    record = await store.get(KEY)
    assert record is not None
    assert (record.locked_until, record.expires_at) == (
        T0 + timedelta(seconds=1.5), T0 + timedelta(seconds=2.5),
    )  # fmt: skip
    # The owner dies: once its retention is over, the key is new again and pruned.
    gone = T0 + timedelta(seconds=2.5)
    assert await store.prune(now=gone - timedelta(milliseconds=1)) == 0
    assert (await claim(store, key=KEY, h="h2", now=gone)).outcome is ClaimOutcome.CLAIMED


async def test_a_claim_is_never_written_to_expire_within_its_lease(store: Store) -> None:
    # Policy refuses lease > ttl; the lifecycle holds the rule for any caller.
    await lifecycle.claim(
        store, KEY, "h1", tok(), now=T0, locked_until=T0 + LEASE, expires_at=T0 + LEASE / 2
    )
    record = await store.get(KEY)
    assert record is not None
    assert record.expires_at == record.locked_until == T0 + LEASE
    assert await store.prune(now=T0 + LEASE * 3 / 4) == 0
    assert (await claim(store, key=KEY, now=T0 + LEASE * 3 / 4)).outcome is ClaimOutcome.IN_PROGRESS


# Records written with one token by one call: a store that retries an insert whose
# answer it lost (a dropped connection, a batch sent again) meets its own row.


async def test_an_insert_meeting_its_own_token_never_answers_another_owner(store: Store) -> None:
    new = NewClaim(KEY, "h1", tok(), T0, T0 + LEASE, T0 + TTL)
    assert await store.insert(new) is None
    again = await store.insert(new)
    # Inserted (the store recognised its first attempt), or the very row it wrote.
    assert again is not BUSY
    assert again is None or (again.token, again.request_hash) == (new.token, "h1"), again
    other = NewClaim(KEY, "h1", tok(), T0, T0 + LEASE, T0 + TTL)
    found = await store.insert(other)
    assert found is not None
    assert found is not BUSY
    assert found.token == new.token


# The regenerated-key detector writes its markers through the store's own insert: it
# must see, on every store, the same request sent under another key.


async def test_the_regenerated_key_detector_flags_a_request_under_another_key(
    store: Store,
) -> None:
    detector = RegeneratedKeys(timedelta(seconds=60))
    caller: dict[str, Any] = {"host": "shop.example", "principal": "u1", "fingerprint": "f" * 64}
    first, second, third = "1" * 64, "2" * 64, "3" * 64
    assert await detector.check(store, key=first, now=T0, **caller) is None
    # The same key again (a retry done right): nothing to say.
    assert await detector.check(store, key=first, now=T0 + timedelta(seconds=1), **caller) is None
    at = T0 + timedelta(seconds=2)
    assert await detector.check(store, key=second, now=at, **caller) == first
    assert await detector.check(store, key=third, now=at, **caller) == first
    # Another caller, or another request, is never flagged.
    other = {**caller, "principal": "u2"}
    assert await detector.check(store, key=second, now=at, **other) is None
    # Past the window a sighting starts a new one, which flags the next key.
    later = T0 + timedelta(seconds=61)
    assert await detector.check(store, key=second, now=later, **caller) is None
    assert await detector.check(store, key=third, now=later, **caller) == second


class StoreContract:
    """The store contract as pytest tests: subclass it and override ``store``.

    Every ``test_*`` function of this module is a test of the class; pytest collects
    them on a subclass whose name starts with ``Test``. Fixtures:

    - ``store`` (override it): an empty store, closed afterwards;
    - ``claimant``: claims as the middleware makes them, on ``store`` (or, with
      ``transactional = True``, in a transaction of it);
    - ``anyio_backend``: ``"asyncio"``.
    """

    pytestmark = pytest.mark.anyio

    #: Claim in transactions of the store (a :class:`TransactionalStore`).
    transactional = False

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    @pytest.fixture
    def store(self) -> Store:
        raise pytest.UsageError(  # pragma: no cover - a user's first run without the fixture
            f"{type(self).__name__} runs the store contract: override its `store` fixture "
            "to yield an empty store of yours (see asgi_idempotency.testing.StoreContract)"
        )

    @pytest.fixture
    async def claimant(self, store: Store) -> AsyncIterator[Claimant]:
        claims = Claimant(store, transactional=self.transactional)
        try:
            yield claims
        finally:
            await claims.close()


def _method(test: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """``test`` as a method of the class: the same fixtures (its signature after ``self``)
    and marks, so pytest and anyio's plugin see a coroutine method like any other."""

    async def method(self: StoreContract, /, **fixtures: Any) -> None:
        await test(**fixtures)

    signature = inspect.signature(test)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[this, *signature.parameters.values()]
    )
    method.__name__ = method.__qualname__ = test.__name__
    method.__doc__ = test.__doc__
    if hasattr(test, "pytestmark"):
        method.pytestmark = test.pytestmark  # type: ignore[attr-defined]
    return method


# Each test of the module as a test of the class: the bodies stay plain functions of
# their fixtures, as written above.
for _name, _test in list(globals().items()):
    if _name.startswith("test_") and inspect.iscoroutinefunction(_test):
        setattr(StoreContract, _name, _method(_test))
del _name, _test

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
detector working through the store's ``insert``; leases and retention decided on the
store's own clock where it declares one (``Capabilities.own_clock``).

A test that lets a lease or a ttl run out does it through :class:`StoreClock`: on a
store of one host it moves the caller's clock; on a store with a clock of its own it
waits for real time, with leases of a second.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from asgi_idempotency import ClaimOutcome, RecordStatus, StoredResponse
from asgi_idempotency.core import lifecycle
from asgi_idempotency.observability.regenerated import RegeneratedKeys
from asgi_idempotency.stores.base import (
    BUSY,
    NewClaim,
    Store,
    capabilities,
    utcnow,
)
from asgi_idempotency.testing.store_kit import (
    LEASE,
    RESPONSE,
    T0,
    TTL,
    Claimant,
    StoreClock,
    claim,
    tok,
)

__all__ = ["Claimant", "StoreClock", "StoreContract"]


async def test_first_claim_wins_then_in_progress(store: Store) -> None:
    assert (await claim(store)).outcome is ClaimOutcome.CLAIMED
    again = await claim(store)
    assert again.outcome is ClaimOutcome.IN_PROGRESS
    assert again.record is not None
    assert again.record.locked_until - again.record.created_at == LEASE


async def test_mismatch_is_checked_before_status(store: Store) -> None:
    await claim(store, h="h1")
    assert (await claim(store, h="h2")).outcome is ClaimOutcome.MISMATCH


async def test_complete_then_replay_returns_identical_response(store: Store) -> None:
    t = tok()
    await claim(store, token=t)
    assert await store.complete("k" * 64, t, RESPONSE, now=T0, ttl=TTL)
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
    assert await store.complete("k" * 64, t, RESPONSE, now=T0, ttl=TTL)
    done = await store.get("k" * 64)
    assert done is not None
    other = StoredResponse(500, (), b"second")
    assert not await store.complete("k" * 64, t, other, now=T0, ttl=2 * TTL)
    assert not await store.complete("k" * 64, tok(), other, now=T0, ttl=2 * TTL)
    record = await store.get("k" * 64)
    assert record is not None
    assert (record.status, record.token, record.response, record.expires_at) == (
        RecordStatus.COMPLETED, t, RESPONSE, done.expires_at,
    )  # fmt: skip


async def test_release_lets_a_retry_claim_again(store: Store) -> None:
    t = tok()
    await claim(store, token=t)
    assert await store.release("k" * 64, t)
    assert (await claim(store)).outcome is ClaimOutcome.CLAIMED


async def test_wrong_token_can_neither_complete_release_nor_renew(store: Store) -> None:
    await claim(store)
    stranger = tok()
    assert not await store.complete("k" * 64, stranger, RESPONSE, now=T0, ttl=TTL)
    assert not await store.release("k" * 64, stranger)
    assert not await store.renew("k" * 64, stranger, now=T0, lease=2 * LEASE)
    record = await store.get("k" * 64)
    assert record is not None
    assert record.status is RecordStatus.IN_PROGRESS


async def test_abandoned_claim_is_taken_over_and_the_old_owner_is_fenced(store: Store) -> None:
    clock = StoreClock(store)
    old = tok()
    await claim(store, token=old, now=clock.now, lease=clock.unit)
    later = await clock.past(clock.unit)
    new = tok()
    assert (await claim(store, token=new, now=later)).outcome is ClaimOutcome.TAKEN_OVER
    # The first owner wakes up: it must not overwrite or delete the new owner's row.
    assert not await store.complete("k" * 64, old, RESPONSE, now=later, ttl=TTL)
    assert not await store.release("k" * 64, old)
    assert await store.complete("k" * 64, new, RESPONSE, now=later, ttl=TTL)


async def test_abandoned_claim_with_other_body_is_a_mismatch(store: Store) -> None:
    await claim(store, h="h1")
    later = T0 + LEASE + timedelta(seconds=1)
    assert (await claim(store, h="h2", now=later)).outcome is ClaimOutcome.MISMATCH


async def test_renew_keeps_a_live_claim(store: Store) -> None:
    t = tok()
    await claim(store, token=t)
    assert await store.renew("k" * 64, t, now=T0, lease=3 * LEASE)
    later = T0 + 2 * LEASE
    assert (await claim(store, now=later)).outcome is ClaimOutcome.IN_PROGRESS


async def test_expired_record_behaves_as_new_before_prune(store: Store) -> None:
    clock = StoreClock(store)
    t = tok()
    await claim(store, token=t, now=clock.now, lease=clock.unit, ttl=clock.unit)
    await store.complete("k" * 64, t, RESPONSE, now=clock.now, ttl=clock.unit)
    after = await clock.past(clock.unit)
    fresh = await claim(store, h="different", now=after)
    assert fresh.outcome is ClaimOutcome.CLAIMED


async def test_prune_deletes_only_expired_rows_in_batches(store: Store) -> None:
    clock = StoreClock(store)
    for i in range(5):
        await lifecycle.claim(
            store,
            f"{i:064d}",
            "h",
            tok(),
            now=clock.now,
            lease=clock.unit / 2,
            ttl=clock.unit * (i + 1),
        )
    await clock.advance(clock.unit * 3.5)  # past three of the five ttls
    pruned = [await store.prune(now=clock.cutoff, batch_size=2) for _ in range(3)]
    # A store that expires records itself (Redis: the key's TTL, on the same clock and
    # ttl) got there first.
    assert pruned == ([2, 1, 0] if capabilities(store).prune else [0, 0, 0])
    assert [await store.get(f"{i:064d}") is None for i in range(5)] == [True] * 3 + [False] * 2
    assert await store.get(f"{4:064d}") is not None


async def test_concurrent_claims_have_exactly_one_winner(store: Store) -> None:
    results = await asyncio.gather(*(claim(store) for _ in range(40)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 39


async def test_racing_takeovers_have_exactly_one_winner(store: Store) -> None:
    clock = StoreClock(store)
    await claim(store, now=clock.now, lease=clock.unit)
    later = await clock.past(clock.unit)
    results = await asyncio.gather(*(claim(store, now=later) for _ in range(20)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(ClaimOutcome.TAKEN_OVER) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 19


# The lifecycle's outcome table, claimed both ways: on the store (every kind) and in a
# transaction of it (Postgres). The row before is written with the store's primitives.

LATER = T0 + LEASE + timedelta(seconds=1)  # past the first claim's lease (the caller's clock)
KEY = "k" * 64


async def seed(store: Store, row: str, clock: StoreClock) -> None:
    """Leave ``KEY`` as ``row``: none, running (a lease of one unit; retained for two),
    completed (retained for two units), released."""
    if row == "none":
        return
    t = tok()
    claimed = await claim(
        store, key=KEY, h="h1", token=t, now=clock.now, lease=clock.unit, ttl=2 * clock.unit
    )
    assert claimed.outcome is ClaimOutcome.CLAIMED
    if row == "completed":
        assert await store.complete(KEY, t, RESPONSE, now=clock.now, ttl=2 * clock.unit)
    elif row == "released":
        assert await store.release(KEY, t)


async def claim_as(
    claimant: Claimant, h: str = "h1", token: str | None = None, now: datetime = T0
) -> lifecycle.Claim:
    return await claimant.claim(KEY, h, token or tok(), now=now, lease=LEASE, ttl=TTL)


@pytest.mark.parametrize(
    ("row", "h", "when", "expected"),
    [
        ("none", "h1", "at once", ClaimOutcome.CLAIMED),
        ("released", "h1", "at once", ClaimOutcome.CLAIMED),
        ("running", "h1", "at once", ClaimOutcome.IN_PROGRESS),
        ("running", "h2", "at once", ClaimOutcome.MISMATCH),
        ("running", "h1", "after the lease", ClaimOutcome.TAKEN_OVER),  # abandoned
        ("running", "h2", "after the lease", ClaimOutcome.MISMATCH),
        ("completed", "h1", "at once", ClaimOutcome.COMPLETED),
        ("completed", "h2", "at once", ClaimOutcome.MISMATCH),
        ("completed", "h2", "after the ttl", ClaimOutcome.CLAIMED),  # expired, not yet pruned
        ("running", "h2", "after the ttl", ClaimOutcome.CLAIMED),
    ],
)
async def test_outcome_table(
    claimant: Claimant, row: str, h: str, when: str, expected: ClaimOutcome
) -> None:
    clock = StoreClock(claimant.store)
    await seed(claimant.store, row, clock)
    if when == "after the lease":
        await clock.past(clock.unit)
    elif when == "after the ttl":
        await clock.past(2 * clock.unit)
    now = clock.now
    t = tok()
    result = await claim_as(claimant, h=h, token=t, now=now)
    assert result.outcome is expected
    if expected is ClaimOutcome.COMPLETED:
        assert result.record is not None
        assert result.record.response == RESPONSE
    if result.owned:
        # The claim is the caller's: completing it stores exactly its response.
        assert await claimant.complete(KEY, t, RESPONSE, now=now, ttl=TTL)
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
        assert again.record.locked_until - again.record.created_at == LEASE


async def test_concurrent_claims_either_way_have_one_winner(claimant: Claimant) -> None:
    results = await asyncio.gather(*(claim_as(claimant) for _ in range(30)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 29


async def test_concurrent_takeovers_either_way_have_one_winner(claimant: Claimant) -> None:
    clock = StoreClock(claimant.store)
    await seed(claimant.store, "running", clock)
    later = await clock.past(clock.unit)
    results = await asyncio.gather(*(claim_as(claimant, now=later) for _ in range(20)))
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
    assert await store.renew(KEY, owner, now=LATER, lease=2 * LEASE)
    taker = NewClaim(KEY, "h1", tok(), LATER, LEASE, TTL)
    assert not await store.replace(seen, taker)
    kept = await store.get(KEY)
    assert kept is not None
    assert kept.token == owner
    assert kept.locked_until > seen.locked_until  # the renewal's


async def test_replace_fails_when_the_row_was_completed_or_deleted_after_the_read(
    store: Store,
) -> None:
    owner = tok()
    await claim(store, key=KEY, token=owner)
    seen = await store.get(KEY)
    assert seen is not None
    taker = NewClaim(KEY, "h1", tok(), LATER, LEASE, TTL)
    assert await store.complete(KEY, owner, RESPONSE, now=T0, ttl=TTL)
    assert not await store.replace(seen, taker)
    completed = await store.get(KEY)
    assert completed is not None
    assert await store.release(KEY, owner) is False  # completed rows are not released
    assert completed.token == owner
    # A row deleted in between: nothing to swap, and nothing is created.
    assert await store.prune(now=completed.expires_at) == 1
    assert not await store.replace(seen, taker)
    assert await store.get(KEY) is None


async def test_replace_succeeds_on_the_row_exactly_as_read(store: Store) -> None:
    await claim(store, key=KEY)
    seen = await store.get(KEY)
    assert seen is not None
    taker = NewClaim(KEY, "h1", tok(), LATER, LEASE, TTL)
    assert await store.replace(seen, taker)
    rival = NewClaim(KEY, "h1", tok(), LATER, LEASE, TTL)
    assert not await store.replace(seen, rival)  # a second taker finds the row changed
    now_owned = await store.get(KEY)
    assert now_owned is not None
    assert now_owned.token == taker.token


# A handler may outlive its ttl: while its owner renews the lease, the claim is never
# expired, to a duplicate claim or to prune, on any store.


async def test_a_renewed_claim_outliving_its_ttl_is_never_expired(store: Store) -> None:
    clock = StoreClock(store)
    lease = clock.unit
    ttl = 2 * lease
    owner = tok()
    first = await lifecycle.claim(store, KEY, "h1", owner, now=clock.now, lease=lease, ttl=ttl)
    assert first.outcome is ClaimOutcome.CLAIMED
    # The owner renews every third of its lease, as LeaseRenewals does, past its ttl.
    for _ in range(8):
        await clock.advance(lease / 3)
        assert await store.renew(KEY, owner, now=clock.now, lease=lease)
    duplicate = await clock.advance(lease / 10)  # past ttl, within the renewed lease
    again = await claim(store, key=KEY, h="h1", now=duplicate)
    assert again.outcome is ClaimOutcome.IN_PROGRESS
    assert (await claim(store, key=KEY, h="h2", now=duplicate)).outcome is ClaimOutcome.MISMATCH
    assert await store.count_expired(now=clock.cutoff) == 0
    assert await store.prune(now=clock.cutoff) == 0
    record = await store.get(KEY)
    assert record is not None
    assert record.token == owner
    assert record.expires_at >= record.locked_until > record.created_at + ttl
    assert lifecycle.state_of(record, duplicate) is lifecycle.RecordState.RUNNING
    # Its owner completes it: replayed for a ttl from then.
    assert await store.complete(KEY, owner, RESPONSE, now=duplicate, ttl=ttl)
    await clock.advance(ttl / 4)
    assert (await claim(store, key=KEY, now=clock.now)).outcome is ClaimOutcome.COMPLETED


async def test_a_claim_no_longer_renewed_expires_after_its_last_lease(store: Store) -> None:
    clock = StoreClock(store)
    unit = clock.unit
    owner = tok()
    await lifecycle.claim(store, KEY, "h1", owner, now=clock.now, lease=unit, ttl=2 * unit)
    assert await store.renew(KEY, owner, now=clock.now, lease=2.5 * unit)
    # A renewal moves retention forward only: a shorter lease leaves it where it is.
    assert await store.renew(KEY, owner, now=clock.now, lease=1.5 * unit)
    record = await store.get(KEY)
    assert record is not None
    # The two renewals a moment apart on a shared store's clock, at once on the caller's.
    assert timedelta(0) < record.expires_at - record.locked_until <= unit
    assert record.expires_at - record.created_at >= 2.5 * unit
    # The owner dies: once its retention is over, the key is new again and pruned.
    assert await store.prune(now=clock.cutoff) == 0
    gone = await clock.past(2.5 * unit)
    assert (await claim(store, key=KEY, h="h2", now=gone)).outcome is ClaimOutcome.CLAIMED


async def test_a_claim_is_never_written_to_expire_within_its_lease(store: Store) -> None:
    # Policy refuses lease > ttl; the lifecycle holds the rule for any caller.
    await lifecycle.claim(store, KEY, "h1", tok(), now=T0, lease=LEASE, ttl=LEASE / 2)
    record = await store.get(KEY)
    assert record is not None
    assert record.expires_at == record.locked_until == record.created_at + LEASE
    clock = StoreClock(store)
    assert await store.prune(now=None if clock.shared else T0 + LEASE * 3 / 4) == 0
    assert (await claim(store, key=KEY, now=T0 + LEASE * 3 / 4)).outcome is ClaimOutcome.IN_PROGRESS


# Whose clock decides: a shared store's own, whatever the caller's says (hosts 40 s
# apart share it); on one host, the caller's (tests/reliability/test_clock_skew.py runs
# real app servers under libfaketime).


async def test_leases_and_retention_are_decided_on_the_stores_clock(store: Store) -> None:
    clock = StoreClock(store)
    skew = timedelta(seconds=40)
    owner = tok()
    await claim(store, token=owner, now=clock.now, lease=min(2 * clock.unit, LEASE))  # < skew
    # A caller whose clock runs 40 s ahead: the claim is live on the store's clock.
    ahead = await claim(store, now=clock.now + skew)
    expected = ClaimOutcome.IN_PROGRESS if clock.shared else ClaimOutcome.TAKEN_OVER
    assert ahead.outcome is expected
    if not clock.shared:
        return  # one host: its own clock is the only one
    # The owner's clock runs 40 s behind: its renewal and completion still count from now.
    behind = utcnow() - skew
    assert await store.renew("k" * 64, owner, now=behind, lease=30 * clock.unit)
    renewed = await store.get("k" * 64)
    assert renewed is not None
    assert renewed.locked_until > utcnow() + 25 * clock.unit
    assert await store.complete("k" * 64, owner, RESPONSE, now=behind, ttl=30 * clock.unit)
    done = await store.get("k" * 64)
    assert done is not None
    assert done.expires_at > utcnow() + 25 * clock.unit
    # A claim whose lease ended on the store's clock is taken over by a caller 40 s behind.
    other = "j" * 64
    await claim(store, key=other, now=utcnow(), lease=clock.unit)
    await clock.past(clock.unit)
    late = await claim(store, key=other, now=utcnow() - skew)
    assert late.outcome is ClaimOutcome.TAKEN_OVER


# Records written with one token by one call: a store that retries an insert whose
# answer it lost (a dropped connection, a batch sent again) meets its own row.


async def test_an_insert_meeting_its_own_token_never_answers_another_owner(store: Store) -> None:
    new = NewClaim(KEY, "h1", tok(), T0, LEASE, TTL)
    assert await store.insert(new) is None
    again = await store.insert(new)
    # Inserted (the store recognised its first attempt), or the very row it wrote.
    assert again is not BUSY
    assert again is None or (again.token, again.request_hash) == (new.token, "h1"), again
    other = NewClaim(KEY, "h1", tok(), T0, LEASE, TTL)
    found = await store.insert(other)
    assert found is not None
    assert found is not BUSY
    assert found.token == new.token


# The regenerated-key detector writes its markers through the store's own insert: it
# must see, on every store, the same request sent under another key.


async def test_the_regenerated_key_detector_flags_a_request_under_another_key(
    store: Store,
) -> None:
    clock = StoreClock(store)
    window = 2 * clock.unit  # its markers expire on the store's clock, as claims do
    detector = RegeneratedKeys(window)
    caller: dict[str, Any] = {"host": "shop.example", "principal": "u1", "fingerprint": "f" * 64}
    first, second, third = "1" * 64, "2" * 64, "3" * 64
    assert await detector.check(store, key=first, now=clock.now, **caller) is None
    # The same key again (a retry done right): nothing to say.
    at = await clock.advance(clock.unit / 10)
    assert await detector.check(store, key=first, now=at, **caller) is None
    at = await clock.advance(clock.unit / 10)
    assert await detector.check(store, key=second, now=at, **caller) == first
    assert await detector.check(store, key=third, now=at, **caller) == first
    # Another caller, or another request, is never flagged.
    other = {**caller, "principal": "u2"}
    assert await detector.check(store, key=second, now=at, **other) is None
    # Past the window a sighting starts a new one, which flags the next key.
    later = await clock.past(window)
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

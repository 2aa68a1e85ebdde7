"""Each transition of a record's life, driven through the lifecycle over the fake store.

The fake (tests/helpers/scripted_store.py) says what a store answers and when it fails; the
lifecycle alone decides what that means. The store contract
(asgi_idempotency.testing.StoreContract, run by tests/stores/test_contract_every_store.py)
holds every real store to the fake's answers.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from asgi_idempotency import StoreError
from asgi_idempotency.core import lifecycle
from asgi_idempotency.core.lifecycle import ClaimOutcome
from asgi_idempotency.stores.base import BUSY, NewClaim, Record, RecordStatus, StoredResponse
from tests.helpers.scripted_store import ScriptedStore

pytestmark = pytest.mark.anyio

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SECOND = timedelta(seconds=1)
LEASE = 30 * SECOND
TTL = timedelta(hours=24)
KEY = "k" * 64
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b"{}")


def row(
    status: RecordStatus,
    *,
    h: str = "h",
    token: str = "theirs",
    locked_for: timedelta = LEASE,
    expires_in: timedelta = TTL,
) -> Record:
    response = RESPONSE if status is RecordStatus.COMPLETED else None
    return Record(KEY, h, status, token, T0 - SECOND, T0 + locked_for, T0 + expires_in, response)


async def claim(
    store: ScriptedStore, *, h: str = "h", token: str = "mine", now: datetime = T0
) -> lifecycle.Claim:
    return await lifecycle.claim(store, KEY, h, token, now=now, lease=LEASE, ttl=TTL)


async def test_no_row_is_claimed_in_one_insert() -> None:
    store = ScriptedStore()
    assert (await claim(store)).outcome is ClaimOutcome.CLAIMED
    assert store.calls == ["insert"]
    record = await store.get(KEY)
    assert record is not None
    assert (record.status, record.token) == (RecordStatus.IN_PROGRESS, "mine")


@pytest.mark.parametrize(
    ("existing", "h", "outcome"),
    [
        (row(RecordStatus.COMPLETED), "h", ClaimOutcome.COMPLETED),
        (row(RecordStatus.COMPLETED), "other", ClaimOutcome.MISMATCH),
        (row(RecordStatus.IN_PROGRESS), "h", ClaimOutcome.IN_PROGRESS),
        (row(RecordStatus.IN_PROGRESS), "other", ClaimOutcome.MISMATCH),
        # A live claim past its retention is still running (a handler outliving ttl).
        (row(RecordStatus.IN_PROGRESS, expires_in=-SECOND), "h", ClaimOutcome.IN_PROGRESS),
    ],
)
async def test_a_row_that_stays_is_answered_from_the_insert_alone(
    existing: Record, h: str, outcome: ClaimOutcome
) -> None:
    store = ScriptedStore()
    store.put(existing)
    got = await claim(store, h=h)
    assert got.outcome is outcome
    assert got.record == existing
    assert store.calls == ["insert"]
    assert await store.get(KEY) == existing  # nothing written


@pytest.mark.parametrize(
    ("existing", "h", "outcome"),
    [
        # abandoned: the owner's lease ran out; the same request takes it over
        (row(RecordStatus.IN_PROGRESS, locked_for=-SECOND), "h", ClaimOutcome.TAKEN_OVER),
        # past retention, whatever it held: behaves as absent, for any request
        (row(RecordStatus.COMPLETED, expires_in=-SECOND), "other", ClaimOutcome.CLAIMED),
        (
            row(RecordStatus.IN_PROGRESS, locked_for=-SECOND, expires_in=-SECOND),
            "other",
            ClaimOutcome.CLAIMED,
        ),
        # exactly at a deadline counts as past it
        (row(RecordStatus.IN_PROGRESS, locked_for=timedelta(0)), "h", ClaimOutcome.TAKEN_OVER),
    ],
)
async def test_a_row_that_goes_is_replaced_by_compare_and_swap(
    existing: Record, h: str, outcome: ClaimOutcome
) -> None:
    store = ScriptedStore()
    store.put(existing)
    assert (await claim(store, h=h)).outcome is outcome
    assert store.calls == ["insert", "replace"]
    record = await store.get(KEY)
    assert record is not None
    assert (record.token, record.status) == ("mine", RecordStatus.IN_PROGRESS)
    assert record.request_hash == h


async def test_a_take_over_that_loses_the_race_answers_from_the_winners_row() -> None:
    store = ScriptedStore()
    store.put(row(RecordStatus.IN_PROGRESS, locked_for=-SECOND))

    async def rival_takes_it(s: ScriptedStore) -> None:
        s.put(row(RecordStatus.IN_PROGRESS, token="rival"))

    store.before["replace"].append(rival_takes_it)
    got = await claim(store)
    assert got.outcome is ClaimOutcome.IN_PROGRESS
    assert got.record is not None
    assert got.record.token == "rival"
    assert store.calls == ["insert", "replace", "insert"]


async def test_a_row_that_keeps_changing_is_a_store_error_not_a_claim() -> None:
    store = ScriptedStore()
    store.put(row(RecordStatus.IN_PROGRESS, locked_for=-SECOND))

    async def renewed_and_abandoned_again(s: ScriptedStore) -> None:
        s.put(row(RecordStatus.IN_PROGRESS, token=str(len(s.calls)), locked_for=-SECOND))

    store.before["replace"].extend([renewed_and_abandoned_again] * lifecycle.CLAIM_ATTEMPTS)
    with pytest.raises(StoreError, match="did not settle"):
        await claim(store)
    assert store.calls.count("insert") == lifecycle.CLAIM_ATTEMPTS


async def test_a_transactions_lock_held_elsewhere_is_in_progress_without_a_row() -> None:
    class Locked(ScriptedStore):
        async def insert(self, new: NewClaim) -> Record | None:
            return BUSY  # type: ignore[return-value]  # what a StoreTransaction may answer

    got = await claim(Locked())
    assert (got.outcome, got.record) == (ClaimOutcome.IN_PROGRESS, None)


async def test_retention_never_ends_within_the_lease() -> None:
    store = ScriptedStore()
    await lifecycle.claim(store, KEY, "h", "mine", now=T0, lease=LEASE, ttl=SECOND)
    record = await store.get(KEY)
    assert record is not None
    assert record.expires_at == T0 + LEASE


async def test_a_store_failure_on_the_claim_is_raised_not_answered() -> None:
    store = ScriptedStore()
    store.fail["insert"].append(StoreError("ConnectionResetError: gone"))
    with pytest.raises(StoreError):
        await claim(store)
    assert await store.get(KEY) is None


# Complete versus release: one meaning on every store (the contract suite holds the
# real ones to these answers).


async def test_the_owner_completes_once_and_nobody_else_ever() -> None:
    store = ScriptedStore()
    await claim(store)
    assert not await store.complete(KEY, "intruder", RESPONSE, now=T0, ttl=TTL)
    assert await store.complete(KEY, "mine", RESPONSE, now=T0, ttl=TTL)
    assert not await store.complete(KEY, "mine", RESPONSE, now=T0, ttl=TTL)  # completed
    assert not await store.release(KEY, "mine")  # a stored response is never released
    assert not await store.renew(KEY, "mine", now=T0, lease=2 * LEASE)


async def test_a_claim_taken_over_is_no_longer_its_first_owners() -> None:
    store = ScriptedStore()
    await claim(store, token="first")
    later = T0 + 2 * LEASE  # first's lease is over: abandoned
    assert (await claim(store, token="second", now=later)).outcome is ClaimOutcome.TAKEN_OVER
    assert not await store.renew(KEY, "first", now=later, lease=LEASE)
    assert not await store.complete(KEY, "first", RESPONSE, now=later, ttl=TTL)
    assert not await store.release(KEY, "first")
    assert await store.release(KEY, "second")
    assert await store.get(KEY) is None


@pytest.mark.parametrize(
    ("status", "completes"),
    [(200, True), (201, True), (302, True), (400, True), (404, True), (422, True),
     (401, False), (407, False), (408, False), (409, False), (425, False), (429, False),
     (500, False), (503, False)],
)  # fmt: skip
def test_which_answers_complete_and_which_release(status: int, completes: bool) -> None:
    assert lifecycle.completes(status) is completes


# The orphaned claim: its requester went away while the claim was in flight.


async def test_a_claim_cancelled_in_flight_is_handed_over_and_released() -> None:
    store = ScriptedStore()
    answered = asyncio.Event()

    async def lands_then_hangs(s: ScriptedStore) -> None:
        new = NewClaim(KEY, "h", "mine", T0, LEASE, TTL)
        await MemorySide.insert(s, new)  # the statement landed on the server...
        answered.set()
        await asyncio.Event().wait()  # ...and its answer never reaches the caller

    store.before["insert"].append(lands_then_hangs)
    orphans: list[NewClaim] = []
    task = asyncio.create_task(
        lifecycle.claim(
            store, KEY, "h", "mine", now=T0, lease=LEASE, ttl=TTL,
            orphaned=orphans.append,
        )
    )  # fmt: skip
    await answered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(o.key, o.token, o.lease) for o in orphans] == [(KEY, "mine", LEASE)]
    assert await store.get(KEY) is not None  # held, for a requester that is gone
    assert await lifecycle.release_orphan(store, orphans[0])
    assert await store.get(KEY) is None
    assert (await claim(store, token="retry")).outcome is ClaimOutcome.CLAIMED


async def test_an_orphan_that_lands_late_is_released_when_it_lands() -> None:
    store = ScriptedStore()
    new = NewClaim(KEY, "h", "mine", T0, LEASE, TTL)

    async def the_claim_lands_now(s: ScriptedStore) -> None:
        await MemorySide.insert(s, new)

    # The first release runs before the claim's statement lands; the second after.
    store.before["release"].extend([_nothing, the_claim_lands_now])
    assert await lifecycle.release_orphan(store, new)
    assert store.calls == ["release", "release"]
    assert await store.get(KEY) is None


async def test_an_orphan_that_never_lands_costs_a_few_releases_within_its_lease() -> None:
    store = ScriptedStore()
    new = NewClaim(KEY, "h", "mine", T0, SECOND, TTL)
    assert not await lifecycle.release_orphan(store, new)
    assert store.calls == ["release"] * (1 + len(lifecycle.completion_retries(SECOND)))


async def test_an_orphan_release_the_store_keeps_failing_raises_the_last_failure() -> None:
    store = ScriptedStore()
    new = NewClaim(KEY, "h", "mine", T0, SECOND, TTL)
    attempts = 1 + len(lifecycle.completion_retries(SECOND))
    store.fail["release"].extend(StoreError(f"down {i}") for i in range(attempts))
    with pytest.raises(StoreError, match=f"down {attempts - 1}"):
        await lifecycle.release_orphan(store, new)


async def _nothing(store: ScriptedStore) -> None:
    return None


class MemorySide:
    """The fake's own write, without its script (a statement already on its way)."""

    @staticmethod
    async def insert(store: ScriptedStore, new: NewClaim) -> None:
        from asgi_idempotency.stores.memory import MemoryStore

        assert await MemoryStore.insert(store, new) is None

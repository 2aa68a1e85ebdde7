"""One contract, every store: memory, SQLite and Postgres answer the same."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from asgi_idempotency import ClaimOutcome, RecordStatus, StoredResponse, lifecycle
from asgi_idempotency.stores.base import Store

pytestmark = pytest.mark.anyio

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

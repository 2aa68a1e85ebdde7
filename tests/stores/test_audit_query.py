"""``suspected_duplicates`` on every store kind: what each claim keeps for the audit
(scope digest and route, with the claim, take-overs and completions included) and the
one grouping rule (:func:`asgi_idempotency.stores.duplicates.group_sightings`)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from asgi_idempotency import SQLStore
from asgi_idempotency.core import lifecycle
from asgi_idempotency.migrations import head, upgrade
from asgi_idempotency.stores.base import AuditableStore, Store, StoredResponse, capabilities
from asgi_idempotency.stores.duplicates import Sighting, SuspectedDuplicate, group_sightings
from tests.conftest import StoreClock, backdate

pytestmark = pytest.mark.anyio

NOW = datetime.now(UTC).replace(microsecond=0)
MIN = timedelta(minutes=1)
WINDOW = timedelta(minutes=10)
ROUTE = "/refunds/{account}"
ALICE, BOB = "a" * 64, "b" * 64  # scope digests
H, H2 = "1" * 64, "2" * 64  # fingerprints


def k(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


async def claim(
    store: Store, key: str, at: datetime, *, scope: str | None = ALICE, h: str = H,
    route: str = ROUTE, token: str | None = None,
) -> lifecycle.Claim:  # fmt: skip
    claimed = await lifecycle.claim(
        store, k(key), h, token or k(key + "t")[:32], now=at, lease=MIN,
        ttl=timedelta(days=1), scope_digest=scope, route=route,
    )  # fmt: skip
    if claimed.owned and StoreClock(store).shared:
        # A shared store writes the claim at its own time: moved to ``at`` behind it.
        record = await store.get(k(key))
        assert record is not None
        await backdate(store, k(key), record.created_at - at)
    return claimed


async def found(store: Store, since: datetime = NOW - MIN, **kw: str) -> list[SuspectedDuplicate]:
    assert capabilities(store).audit
    assert isinstance(store, AuditableStore)
    return await store.suspected_duplicates(since=since, window=WINDOW, **kw)


async def test_one_callers_request_under_several_keys_is_found_and_nothing_else(
    store: Store,
) -> None:
    for n, key in enumerate(("k1", "k2", "k3")):
        assert (await claim(store, key, NOW + n * MIN)).owned
    await claim(store, "k4", NOW, scope=BOB)  # another caller, the same request
    await claim(store, "k5", NOW, h=H2)  # the same caller, another request
    await claim(store, "k6", NOW + 30 * MIN)  # the same request, past the window
    await claim(store, "k7", NOW + MIN, scope=None)  # no scope: not an HTTP request's
    assert await found(store) == [SuspectedDuplicate(ROUTE, ALICE, H, 3, 3, NOW, NOW + 2 * MIN)]
    assert await found(store, route="/payouts/{account}") == []
    assert await found(store, route=ROUTE) != []
    # A lookback that starts after the first two leaves one request: nothing.
    assert await found(store, since=NOW + 90 * timedelta(seconds=1)) == []


async def test_completion_keeps_the_sighting_and_a_release_removes_it(store: Store) -> None:
    tokens = [k(f"t{n}")[:32] for n in range(3)]
    for n in range(3):
        await claim(store, f"c{n}", NOW + n * MIN, token=tokens[n])
    response = StoredResponse(201, ((b"content-type", b"application/json"),), b"{}")
    assert await store.complete(k("c0"), tokens[0], response, now=NOW, ttl=timedelta(days=1))
    assert await store.release(k("c1"), tokens[1])  # a 5xx: released, it did not happen
    assert await found(store) == [SuspectedDuplicate(ROUTE, ALICE, H, 2, 2, NOW, NOW + 2 * MIN)]


async def test_a_take_over_writes_the_scope_of_the_claim_that_took_it(store: Store) -> None:
    # An abandoned claim with no scope (a row from before the audit), taken over by a
    # request after its lease: the row is now that request's, scope and route included.
    await claim(store, "t0", NOW - 5 * MIN, scope=None)
    taken = await claim(store, "t0", NOW, token=k("other")[:32])
    assert taken.outcome is lifecycle.ClaimOutcome.TAKEN_OVER
    await claim(store, "t1", NOW + MIN)
    assert await found(store) == [SuspectedDuplicate(ROUTE, ALICE, H, 2, 2, NOW, NOW + MIN)]


def test_runs_chain_within_the_window_and_one_key_is_never_a_run() -> None:
    def s(key: str, minutes: int, scope: str = ALICE) -> Sighting:
        return Sighting(scope, ROUTE, H, key, NOW + minutes * MIN)

    # Gaps of 9 minutes chain into one run; 11 minutes starts another.
    chained = [s("a", 0), s("b", 9), s("c", 18), s("d", 29), s("e", 30)]
    assert group_sightings(chained, WINDOW) == [
        SuspectedDuplicate(ROUTE, ALICE, H, 3, 3, NOW, NOW + 18 * MIN),
        SuspectedDuplicate(ROUTE, ALICE, H, 2, 2, NOW + 29 * MIN, NOW + 30 * MIN),
    ]
    # One key seen twice (claimed again after a release): requests, not keys.
    assert group_sightings([s("a", 0), s("a", 1)], WINDOW) == []
    assert group_sightings([s("a", 0), s("b", 1, BOB)], WINDOW) == []
    with pytest.raises(ValueError, match="positive"):
        group_sightings([], timedelta(0))


async def test_an_sqlite_file_an_earlier_version_made_gains_the_columns_at_start(
    tmp_path: Path,
) -> None:
    # The embedded default: the app keeps its file itself, nobody runs `migrate` on it.
    url = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0002")
    store = SQLStore(url)
    try:
        await store.prepare()
        await claim(store, "o1", NOW)
        await claim(store, "o2", NOW + MIN)
        assert await found(store) == [SuspectedDuplicate(ROUTE, ALICE, H, 2, 2, NOW, NOW + MIN)]
        async with store.engine.connect() as conn:
            recorded = (
                await conn.exec_driver_sql("SELECT version_num FROM idempotency_alembic_version")
            ).scalar_one()
        assert recorded == head()
    finally:
        await store.close()

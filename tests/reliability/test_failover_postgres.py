"""A Postgres primary SIGKILLed under traffic and its synchronous standby promoted, on
the URLs users write for the pair (libpq's ``h1:p1,h2:p2`` and SQLAlchemy's
``?host=``), with ``target_session_attrs=read-write``.

Real processes from the local binaries (``tests/helpers/pg_standby.py``); the app runs
in-process, as in the other store-fault tests, so the test counts each key's handler
runs itself. The scenario and its checks: ``failover.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from asgi_idempotency import SQLStore

from ..helpers.pg_standby import PgPair, start_pair
from .failover import effect_app, run_failover
from .support import close_bounded

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.slow]

# What an HA manager (Patroni, a cloud's failover) takes to notice the dead primary and
# promote the standby: the gap the guard answers 503 through.
DETECTION = 0.5
LEASE = 5.0  # seconds: in-flight completions are retried for this long


@pytest.fixture
def pair() -> Iterator[PgPair]:
    try:
        pair = start_pair()
    except RuntimeError as exc:  # missing binaries or a failed step: say which, never skip
        pytest.fail(str(exc), pytrace=False)
    try:
        yield pair
    finally:
        pair.stop()


@pytest.mark.parametrize("form", ["libpq", "sqlalchemy"])
async def test_a_killed_primary_and_a_promoted_standby_lose_nothing_and_run_nothing_twice(
    form: str, pair: PgPair
) -> None:
    url = pair.url(form)
    store = SQLStore(url, command_timeout=2)
    await store.create_all()  # on the primary: streamed to the standby before it returns
    app, runs = effect_app(store, lease=LEASE)

    async def promote() -> float:
        await asyncio.sleep(DETECTION)
        await asyncio.to_thread(pair.standby.promote)
        return time.monotonic()

    try:
        outcome = await run_failover(app, runs, kill=pair.primary.kill, promote=promote)
    finally:
        await close_bounded(store)
    print(outcome.summary())
    outcome.check()

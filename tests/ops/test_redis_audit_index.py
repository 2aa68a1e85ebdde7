"""On Redis the audit's index lives at least as long as every record it points to.

A completion restarts its record's retention from the store's time then, later than
the claim that wrote the index entry: the entry's score and the set's TTL have to
reach past that, or the audit loses a record that is still there (on a real
redis-server, one node and a cluster).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import cast

import pytest

from asgi_idempotency.core import lifecycle
from asgi_idempotency.stores.base import StoredResponse
from asgi_idempotency.stores.redis import RedisStore

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


async def test_the_index_outlives_a_record_completed_after_its_claim(rstore: RedisStore) -> None:
    key, token = "a" * 64, "t" * 32
    lease, ttl = timedelta(seconds=2), timedelta(seconds=30)
    claimed = await lifecycle.claim(
        rstore, key, "f" * 64, token, now=datetime.now(UTC), lease=lease, ttl=ttl,
        scope_digest="c" * 64, route="/refunds",
    )  # fmt: skip
    assert claimed.owned
    await asyncio.sleep(0.2)  # the handler runs; the completion comes later than the claim
    response = StoredResponse(201, (), b"{}")
    assert await rstore.complete(key, token, response, now=datetime.now(UTC), ttl=ttl)

    record_name = rstore._key(key)
    index_name = rstore._audit_key(key)
    record_ttl = await rstore.client.pttl(record_name)
    index_ttl = await rstore.client.pttl(index_name)
    assert 0 < record_ttl <= index_ttl, (record_ttl, index_ttl)
    # The entry itself is trimmed only once past its score: never before the record's end.
    (member,) = cast(list[bytes], await rstore.client.zrange(index_name, 0, -1))
    score = await rstore.client.zscore(index_name, member)
    expires = cast(bytes, await rstore.client.hget(record_name, "e"))
    assert score is not None
    assert score >= int(expires), (score, expires)

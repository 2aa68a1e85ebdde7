"""The store contract on Redis with ``batching=False``: one command per request.

The ``store`` fixture's Redis kinds pipeline (the default); this module runs the
public contract (:class:`~asgi_idempotency.testing.StoreContract`) again on a store
that does not, so both paths of :meth:`RedisStore._run` answer the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from asgi_idempotency.stores.redis import RedisStore
from asgi_idempotency.testing import StoreContract

pytestmark = pytest.mark.redis


class TestRedisUnbatched(StoreContract):
    @pytest.fixture(params=["redis_url", "redis_cluster_url"])
    async def store(self, request: pytest.FixtureRequest) -> AsyncIterator[RedisStore]:
        opened = RedisStore(request.getfixturevalue(request.param), batching=False)
        assert not opened.capabilities.batching
        await opened.client.flushall()
        try:
            yield opened
        finally:
            await opened.close()

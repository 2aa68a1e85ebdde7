"""The store contract on Redis with ``batching=False``: one command per request.

The ``store`` fixture's Redis kinds pipeline (the default); this module runs every
contract test that takes ``store`` again, on a store that does not, so both paths of
:meth:`RedisStore._run` answer the same.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator

import pytest

from asgi_idempotency.stores.redis import RedisStore
from tests.stores import test_contract

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

for _name, _test in vars(test_contract).items():
    if _name.startswith("test_") and "store" in inspect.signature(_test).parameters:
        globals()[_name] = _test


@pytest.fixture(params=["redis_url", "redis_cluster_url"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RedisStore]:
    opened = RedisStore(request.getfixturevalue(request.param), batching=False)
    assert not opened.capabilities.batching
    await opened.client.flushall()
    try:
        yield opened
    finally:
        await opened.close()

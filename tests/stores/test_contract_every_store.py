"""One contract, every store: our stores run the public kit, not a copy of it.

:class:`asgi_idempotency.testing.StoreContract` is what users run on their own
stores; here its ``store`` fixture is every kind of ours (tests/conftest.py's
:data:`~tests.conftest.STORE_KINDS`), and Postgres runs it again with its claims
made in transactions, as the transactional mode makes them.
"""

from __future__ import annotations

import pytest

from asgi_idempotency import SQLStore
from asgi_idempotency.stores.base import Store
from asgi_idempotency.testing import StoreContract


class TestEveryStore(StoreContract):
    @pytest.fixture
    def store(self, store: Store) -> Store:
        return store  # the conftest's: every store kind, each empty


@pytest.mark.postgres
class TestPostgresTransactional(StoreContract):
    transactional = True

    @pytest.fixture
    def store(self, pg_store: SQLStore) -> Store:
        return pg_store  # emptied

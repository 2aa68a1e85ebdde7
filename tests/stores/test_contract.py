"""One contract, every store: our stores run the public kit, not a copy of it.

:class:`asgi_idempotency.testing.StoreContract` is what users run on their own
stores; here its ``store`` fixture is every kind of ours (tests/conftest.py's
:data:`~tests.conftest.STORE_KINDS`) and its ``claimant`` those kinds plus
Postgres claimed in transactions.
"""

from __future__ import annotations

import pytest

from asgi_idempotency.stores.base import Store
from asgi_idempotency.testing import Claimant, StoreContract


class TestEveryStore(StoreContract):
    @pytest.fixture
    def store(self, store: Store) -> Store:
        return store  # the conftest's: every store kind, each empty

    @pytest.fixture
    def claimant(self, claimant: Claimant) -> Claimant:
        return claimant  # the conftest's: every kind, and Postgres in transactions

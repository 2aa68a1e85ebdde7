"""The suites above the store run on one store of each family (tests/conftest.py's
APP_KINDS); every kind runs the store contract and its own tests in tests/stores."""

from __future__ import annotations

import pytest

from tests.conftest import APP_KINDS, app_store

store = pytest.fixture(params=APP_KINDS, name="store")(app_store)

"""The public contract kit as a user runs it: a test module of their own, no conftest of ours.

A store that keeps the rules passes every test; a store that breaks one fails the
test that pins it; a class that forgets its ``store`` fixture is told what to do.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from asgi_idempotency.testing import store_contract

USER_MODULE = '''
from collections.abc import AsyncIterator
from datetime import datetime

import pytest

from asgi_idempotency import MemoryStore
from asgi_idempotency.stores.base import NewClaim, Record, Store, StoredResponse
from asgi_idempotency.testing import StoreContract


class CompletesTwice(MemoryStore):
    """A bug: completes a row the token owns even when it is completed already."""

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, expires_at: datetime
    ) -> bool:
        row = self._rows.get(key)
        if row is None or row[2] != token:
            return False
        self._rows[key] = (*row[:1], "completed", *row[2:5], expires_at,
                           (response.status, response.headers, response.body))
        return True


class BlindSwap(MemoryStore):
    """A bug: replace overwrites whatever is there (no compare-and-swap)."""

    async def replace(self, expected: Record, new: NewClaim) -> bool:
        if expected.key not in self._rows:
            return False
        self._rows[expected.key] = (new.request_hash, "in_progress", new.token, new.now,
                                    new.locked_until, new.expires_at, None)
        return True


def fixture_of(kind: type[MemoryStore]):  # type: ignore[no-untyped-def]
    @pytest.fixture
    async def store(self: object) -> AsyncIterator[Store]:
        opened = kind()
        yield opened
        await opened.close()

    return store


class TestGood(StoreContract):
    store = fixture_of(MemoryStore)


class TestCompletesTwice(StoreContract):
    store = fixture_of(CompletesTwice)


class TestBlindSwap(StoreContract):
    store = fixture_of(BlindSwap)


class TestForgot(StoreContract):
    pass
'''


def test_a_users_module_runs_the_contract_and_catches_broken_stores(tmp_path: Path) -> None:
    (tmp_path / "test_user_store.py").write_text(USER_MODULE)
    report = tmp_path / "report.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-W", "error", "-p", "no:cacheprovider",
         f"--junitxml={report}", "test_user_store.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    outcomes: dict[str, dict[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        cls = case.attrib["classname"].rsplit(".", 1)[-1]
        result = next((child.tag for child in case), "passed")
        text = "".join(child.attrib.get("message", "") for child in case)
        outcomes.setdefault(cls, {})[case.attrib["name"]] = f"{result}: {text}"

    def names(cls: str) -> set[str]:  # each test once, whatever its parameters
        return {name.partition("[")[0] for name in outcomes[cls]}

    contract = {name for name in vars(store_contract) if name.startswith("test_")}
    assert names("TestGood") == names("TestForgot") == contract, done.stdout[-3000:]
    assert all(v.startswith("passed") for v in outcomes["TestGood"].values()), done.stdout[-3000:]
    broken = {
        name
        for name, outcome in outcomes["TestCompletesTwice"].items()
        if not outcome.startswith("passed")
    }
    assert "test_completing_a_completed_row_answers_false_and_changes_nothing" in broken
    swapped = {
        name for name, outcome in outcomes["TestBlindSwap"].items() if outcome.startswith("fail")
    }
    assert {
        "test_replace_fails_when_the_lease_was_renewed_after_the_read",
        "test_replace_succeeds_on_the_row_exactly_as_read",  # a second taker must lose
    } <= swapped
    forgot = outcomes["TestForgot"]
    assert all("override its `store` fixture" in outcome for outcome in forgot.values())


def test_the_testing_package_exports_what_it_names() -> None:
    import asgi_idempotency.testing as testing

    assert list(testing.__all__) == sorted(testing.__all__)
    for name in testing.__all__:
        assert getattr(testing, name) is not None
    assert testing.StoreContract is store_contract.StoreContract

"""Test helpers for apps and stores that use asgi-idempotency.

:func:`check_app` runs the conformance checks of ``asgi-idempotency check``
(:mod:`asgi_idempotency.ops.check`) in process against an ASGI app (needs httpx: the
``client`` extra); :func:`assert_conforms` fails a test with the report's table when a
check fails.

:class:`StoreContract` is the store contract as pytest tests (needs pytest): subclass
it, override its ``store`` fixture, and pytest checks your store, or one of ours on your
own database and settings, against the rules every store keeps
(:mod:`asgi_idempotency.testing.store_contract`). :class:`StoreClock` is the clock its
tests let leases run out on: the caller's, or real time on a store with its own clock.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from asgi_idempotency.testing.http_checks import (
    CheckReport,
    CheckResult,
    Outcome,
    assert_conforms,
    check_app,
)

if TYPE_CHECKING:
    from asgi_idempotency.testing.store_contract import Claimant, StoreClock, StoreContract

__all__ = [
    "CheckReport",
    "CheckResult",
    "Claimant",
    "Outcome",
    "StoreClock",
    "StoreContract",
    "assert_conforms",
    "check_app",
]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that the HTTP checks need no pytest, and after asking
    # pytest to rewrite the contract's asserts (a failure then shows the values).
    if name in ("Claimant", "StoreClock", "StoreContract"):
        module = f"{__name__}.store_contract"
        if module not in sys.modules:  # imported directly: too late to rewrite
            import pytest

            pytest.register_assert_rewrite(module, f"{__name__}.store_kit")
        from asgi_idempotency.testing import store_contract

        return getattr(store_contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Test helpers for apps that use asgi-idempotency (needs httpx: the ``client`` extra).

:func:`check_app` runs the conformance checks of ``asgi-idempotency check``
(:mod:`asgi_idempotency.ops.check`) in process against an ASGI app;
:func:`assert_conforms` fails a test with the report's table when a check fails.
"""

from __future__ import annotations

from .http_checks import CheckReport, CheckResult, Outcome, assert_conforms, check_app

__all__ = ["CheckReport", "CheckResult", "Outcome", "assert_conforms", "check_app"]

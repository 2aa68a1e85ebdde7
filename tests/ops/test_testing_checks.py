"""``asgi_idempotency.testing``: the same checks in process, against an ASGI app object."""

from __future__ import annotations

from typing import Any

import pytest

from asgi_idempotency.testing import CheckReport, Outcome, assert_conforms, check_app

from .check_apps import FLAWS, flawed, guarded

FULL: dict[str, Any] = {
    "json": {"amount": 4500},
    "headers": {"X-API-Key": "key-a"},
    "other_caller_headers": {"X-API-Key": "key-b"},
    "slow_path": "/slow-refunds",
    "fail_header": ("X-Fail", "1"),
}


@pytest.mark.anyio
async def test_our_guard_conforms_in_process() -> None:
    report = await assert_conforms(guarded, "/refunds", **FULL)
    assert isinstance(report, CheckReport)
    assert report.not_run == []
    assert report.failed == []
    assert report.result("in-flight-409").outcome is Outcome.PASS


@pytest.mark.anyio
async def test_assert_conforms_names_the_failing_check() -> None:
    options = {**FULL, "headers": {"X-API-Key": "key-a", "X-Flaws": "claim-after"}}
    with pytest.raises(AssertionError, match="storm-one-effect") as failed:
        await assert_conforms(flawed, "/refunds", **options)
    assert "failed: storm-one-effect" in str(failed.value)


@pytest.mark.anyio
@pytest.mark.parametrize(("flaw", "name"), FLAWS.items())
async def test_check_app_catches_each_flaw(flaw: str, name: str) -> None:
    options = {**FULL, "headers": {"X-API-Key": "key-a", "X-Flaws": flaw}}
    report = await check_app(flawed, "/refunds", **options)
    assert name in report.failed, report.table()


@pytest.mark.anyio
async def test_checks_without_their_input_are_not_run_not_passed() -> None:
    # hold: the 0.2 s endpoint answers well within it, too fast to overlap a duplicate.
    report = await check_app(
        guarded, "/refunds", json={"amount": 1}, headers={"X-API-Key": "key-a"}, hold=3
    )
    assert report.ok
    assert set(report.not_run) == {"other-caller", "in-flight-409", "5xx-releases-key"}
    assert not set(report.not_run) & set(report.passed)


def test_options_out_of_range_are_value_errors() -> None:
    import asyncio

    with pytest.raises(ValueError, match="storm"):
        asyncio.run(check_app(guarded, "/refunds", storm=1))


@pytest.mark.parametrize(
    ("body", "content_type", "other"),
    [
        (b'{"amount": 4500, "note": "x"}', "application/json", b'{"amount":4501,"note":"x"}'),
        (b'{"note": "x", "ok": true}', "application/json", b'{"note":"x-other","ok":true}'),
        (b'{"ok": true}', "application/json", b'{"ok":true,"idempotency_check":1}'),
        (b"[]", "application/json", b"[1]"),
        (b"a=1", "application/x-www-form-urlencoded", b"a=1&idempotency_check=1"),
        (b"raw bytes", "application/octet-stream", None),
        (b"", None, None),
    ],
)
def test_the_other_body_stays_valid_and_differs(
    body: bytes, content_type: str | None, other: bytes | None
) -> None:
    from asgi_idempotency.ops.check import derive_other_body

    assert derive_other_body(body, content_type) == other

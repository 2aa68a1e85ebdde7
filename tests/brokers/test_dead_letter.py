"""The presets' shared dead letter (integrations/_brokers.py), without a broker: called
once per message and body, logged with digests only, counted under ``.exhausted``."""

from __future__ import annotations

import logging

import pytest

from asgi_idempotency import KeyReused, MemoryStore, Once, Outcome, Undecodable
from asgi_idempotency.core.canonical import CanonicalJSONError
from asgi_idempotency.integrations._brokers import DeadLetter, body_digest, cannot_run

pytestmark = [pytest.mark.anyio]


def counts(once: Once) -> dict[tuple[str, Outcome], int]:
    return dict(once.snapshot().counts)


async def test_handed_off_once_per_key_and_body_then_replayed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    once = Once(MemoryStore())
    handed: list[tuple[str, str]] = []

    async def on_exhausted(message: str, error: BaseException) -> None:
        handed.append((message, type(error).__name__))

    dead = DeadLetter(once, "refunds", on_exhausted, otherwise="dropped")
    first, other = body_digest(b'{"order": "A-1"}'), body_digest(b'{"order": "A-2"}')
    with caplog.at_level(logging.ERROR, logger="asgi_idempotency"):
        assert await dead.hand_off("msg-1", first, "m1", KeyReused("reused"))
        assert await dead.hand_off("msg-1", first, "m1 again", KeyReused("reused"))
        # The same id with another body: a hand-off of its own, not the first's replay.
        assert await dead.hand_off("msg-1", other, "m1 other", Undecodable("not JSON"))
    assert handed == [("m1", "KeyReused"), ("m1 other", "Undecodable")]
    assert counts(once) == {
        ("refunds.exhausted", Outcome.EXECUTED): 2,
        ("refunds.exhausted", Outcome.REPLAYED): 1,
    }
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 3
    assert lines[0].startswith("idempotency.dead_letter route=refunds key_digest=")
    assert f"body_digest={first[:16]} reason=key_reused error=KeyReused" in lines[0]
    assert "reason=undecodable error=Undecodable" in lines[2]
    assert not any("msg-1" in line or "A-1" in line for line in lines)


async def test_without_on_exhausted_it_is_the_brokers_counted_as_rejected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    once = Once(MemoryStore())
    dead = DeadLetter(once, "refunds", None, otherwise="rejected without requeue")
    with caplog.at_level(logging.ERROR, logger="asgi_idempotency"):
        assert not await dead.hand_off("msg-1", body_digest(b"x"), "m", KeyReused("r"))
        assert not dead.hand_off_sync("msg-2", body_digest(b"y"), "m", RuntimeError("down"))
    assert counts(once) == {("refunds.exhausted", Outcome.REJECTED): 2}
    messages = [r.getMessage() for r in caplog.records]
    assert "reason=exhausted error=RuntimeError -- no on_exhausted: rejected" in messages[1]


async def test_a_hand_off_that_raises_is_logged_and_raised_then_called_again() -> None:
    once = Once(MemoryStore())
    calls: list[str] = []

    async def on_exhausted(message: str, error: BaseException) -> None:
        calls.append(message)
        if len(calls) == 1:
            raise ConnectionError("the parking queue is down")

    dead = DeadLetter(once, "refunds", on_exhausted, otherwise="dropped")
    with pytest.raises(ConnectionError):
        await dead.hand_off("msg-1", body_digest(b"x"), "first", KeyReused("r"))
    assert await dead.hand_off("msg-1", body_digest(b"x"), "second", KeyReused("r"))
    assert calls == ["first", "second"]


def test_what_cannot_run() -> None:
    reused, undecodable = KeyReused("r"), Undecodable("u")
    assert cannot_run(reused) is reused
    assert cannot_run(undecodable) is undecodable
    wrapped = cannot_run(CanonicalJSONError("nan has no JSON form"))
    assert isinstance(wrapped, Undecodable)
    assert isinstance(wrapped.__cause__, CanonicalJSONError)
    assert cannot_run(RuntimeError("a downstream hiccup")) is None

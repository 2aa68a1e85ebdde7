"""What the broker presets share: the checks made before a consumer starts, and the
message's fingerprint. No broker package is imported here."""

from __future__ import annotations

import hashlib
from datetime import timedelta

from asgi_idempotency.core.errors import AttemptsUnknown, MissingMessageId

__all__ = ["AttemptsUnknown", "MissingMessageId", "body_digest", "check_attempts", "check_lease"]


def body_digest(body: bytes) -> str:
    """SHA-256 hex of the message body: a reused id with another body is a producer bug."""
    return hashlib.sha256(body).hexdigest()


def check_lease(lease: timedelta, timeout: timedelta, what: str) -> None:
    """Refuse a lease the broker's own redelivery timer would outrun.

    A consumer that dies holding a claim leaves it in progress for up to one lease.
    The broker redelivers after ``timeout``: with a lease as long, the redelivery finds
    the dead holder's claim still live and cannot run it, and each redelivery spends
    an attempt of the message's budget on nothing.
    """
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ValueError(f"{what} must be a positive timedelta, got {timeout!r}")
    if lease >= timeout:
        raise ValueError(
            f"the guard's lease ({lease.total_seconds():g} s) must be shorter than the "
            f"broker's {what} ({timeout.total_seconds():g} s): a redelivery after a "
            "consumer died would find the dead consumer's claim still held. Give Once a "
            "shorter lease= (it is renewed while the handler runs)."
        )


def check_attempts(max_attempts: int) -> int:
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
    return max_attempts


def namespaced(namespace: str) -> tuple[str, str]:
    """The handler's namespace and its hand-off's (a record of their own each)."""
    if not isinstance(namespace, str) or not namespace or namespace.startswith("/"):
        raise ValueError(f"namespace must be a non-empty str not starting with '/': {namespace!r}")
    return namespace, f"{namespace}.exhausted"

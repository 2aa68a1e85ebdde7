"""What the execution core reads of a guard's policy, as a protocol: its durations.

The HTTP policy (:class:`asgi_idempotency.http.policy.Policy`) and ``Once``'s satisfy
it structurally; the core never imports them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

__all__ = ["ExecutionPolicy"]


class ExecutionPolicy(Protocol):
    """The durations one guarded execution runs under."""

    @property
    def ttl(self) -> timedelta:
        """How long a completed outcome is kept and replayed."""
        ...

    @property
    def lease(self) -> timedelta:
        """How long an in-progress claim is honoured without renewal."""
        ...

    @property
    def renew_every(self) -> float:
        """Seconds between two renewals of a running claim's lease."""
        ...

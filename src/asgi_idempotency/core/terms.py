"""How long a guarded operation holds and keeps its key: the terms every adapter runs on.

A route's :class:`~asgi_idempotency.http.policy.Policy` and a :class:`~.once.Once` both
carry these; the runner (:mod:`.execution`) reads nothing else of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

__all__ = ["DEFAULT_TTL", "LEASE_NOT_GIVEN", "ExecutionTerms", "Terms", "duration", "resolve_lease"]

DEFAULT_TTL = timedelta(hours=24)
DEFAULT_LEASE = timedelta(seconds=30)


class _LeaseNotGiven:
    """The ``lease`` default: "not given", resolved to the smaller of 30 s and ``ttl``."""

    __slots__ = ()

    def __repr__(self) -> str:  # shown in help(Policy) and help(idempotent)
        return "<the smaller of 30 s and ttl>"


# Typed as Any so that it can stand as the default of a ``timedelta`` field: the
# attribute is read as a timedelta everywhere, and validation makes sure it is one.
LEASE_NOT_GIVEN: Any = _LeaseNotGiven()


class DefaultLease(timedelta):
    """A lease resolved from the default, remembered as such.

    ``dataclasses.replace(policy, ttl=...)`` passes the resolved lease back in; it is
    derived again from the new ttl rather than read as an explicit lease that may now
    exceed it.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(timedelta(self.days, self.seconds, self.microseconds))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def duration(name: str, value: object) -> timedelta:
    """``value`` if it is a positive ``timedelta``.

    A bare number is refused rather than read as seconds: ``ttl=30`` could as well
    mean milliseconds, and a guard that keeps responses for 30 s instead of 30 min
    fails silently.
    """
    if not isinstance(value, timedelta):
        raise TypeError(
            f"{name} must be a datetime.timedelta, e.g. timedelta(seconds=30); "
            f"got {type(value).__name__} {value!r}"
            + (" (a bare number could mean seconds or milliseconds)" if _is_number(value) else "")
        )
    if value <= timedelta(0):
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def resolve_lease(ttl: timedelta, lease: object) -> timedelta:
    """The lease to hold a key with: the one given (at most ``ttl``), else the default."""
    if lease is LEASE_NOT_GIVEN or isinstance(lease, DefaultLease):
        shorter = min(DEFAULT_LEASE, ttl)
        return DefaultLease(shorter.days, shorter.seconds, shorter.microseconds)
    checked = duration("lease", lease)
    if checked > ttl:
        # The claimed row expires after ttl, so a longer lease would promise more than
        # the row keeps. Refuse rather than shorten what was asked.
        raise ValueError(
            f"lease ({checked}) exceeds ttl ({ttl}): pass lease <= ttl, or a longer ttl"
        )
    return checked


class Terms(Protocol):
    """What the runner reads of a policy: how long a record is kept and a claim held."""

    @property
    def ttl(self) -> timedelta: ...

    @property
    def lease(self) -> timedelta: ...

    @property
    def renew_every(self) -> float:
        """Seconds between lease renewals while the body runs."""
        ...


@dataclass(frozen=True, slots=True)
class ExecutionTerms:
    """:class:`Terms` as a value, validated as a route's policy is.

    Raises:
        TypeError, ValueError: ``ttl`` or ``lease`` is not a positive ``timedelta``;
            ``lease`` exceeds ``ttl``.
    """

    ttl: timedelta = DEFAULT_TTL
    lease: timedelta = LEASE_NOT_GIVEN
    renew_every: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ttl = duration("ttl", self.ttl)
        lease = resolve_lease(ttl, self.lease)
        object.__setattr__(self, "lease", lease)
        # A live holder renews every third of its lease: two renewals may fail before
        # a take-over can happen.
        object.__setattr__(self, "renew_every", lease.total_seconds() / 3)

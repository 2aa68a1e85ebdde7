"""Likely duplicates that keys could not catch: one caller, one request, several keys.

A client that mints its key inside its retry loop sends every attempt under a new key,
and each attempt runs. Its signature is in the records every worker writes: the same
scope (host and principal, as a digest), the same route and the same fingerprint under
different keys, close together in time. Stores find the candidate rows (through an
index, or a secondary structure) and hand them to :func:`group_sightings`, the one rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

__all__ = ["Sighting", "SuspectedDuplicate", "extra_keys_by_route", "group_sightings"]


class Sighting(NamedTuple):
    """One stored claim as the audit reads it (digests and the route template only)."""

    scope_digest: str
    route: str
    request_hash: str
    key: str  # the scoped key (a digest)
    created_at: datetime


@dataclass(frozen=True, slots=True)
class SuspectedDuplicate:
    """A run of one caller's identical requests to one route under different keys."""

    route: str
    scope_digest: str  # sha256 hex of (host, principal): never the principal itself
    request_hash: str  # the fingerprint the requests share
    requests: int  # rows in the run
    keys: int  # distinct keys among them (at least 2)
    first: datetime
    last: datetime
    # The run's records' keys (scoped key digests, 64 hex), oldest first: what
    # ``asgi-idempotency inspect`` takes to show each record. A listing, not part of
    # what the run is: left out of equality.
    key_digests: tuple[str, ...] = field(default=(), compare=False)


def group_sightings(sightings: Iterable[Sighting], window: timedelta) -> list[SuspectedDuplicate]:
    """Runs of sightings with one (scope, route, fingerprint), each within ``window`` of
    the one before, that hold at least two keys; most requests first.

    A run chains: requests every few minutes for an hour are one run when each gap is
    within the window. A repeat after a longer gap starts a new run, so a legitimate
    repeat (the same order placed again next week) is not reported.
    """
    if window <= timedelta(0):
        raise ValueError(f"the window must be positive: {window!r}")
    ordered = sorted(sightings, key=lambda s: (s.scope_digest, s.route, s.request_hash,
                                               s.created_at))  # fmt: skip
    found: list[SuspectedDuplicate] = []
    run: list[Sighting] = []

    def close() -> None:
        keys = tuple(dict.fromkeys(s.key for s in run))  # distinct, oldest first
        if len(keys) > 1:
            head = run[0]
            found.append(SuspectedDuplicate(head.route, head.scope_digest, head.request_hash,
                                            len(run), len(keys), head.created_at,
                                            run[-1].created_at, keys))  # fmt: skip

    for sighting in ordered:
        if run:
            last = run[-1]
            same = (last.scope_digest, last.route, last.request_hash) == (
                sighting.scope_digest, sighting.route, sighting.request_hash)  # fmt: skip
            if same and sighting.created_at - last.created_at <= window:
                run.append(sighting)
                continue
            close()
        run = [sighting]
    if run:
        close()
    found.sort(key=lambda d: (-d.requests, d.route, d.first))
    return found


def extra_keys_by_route(found: Iterable[SuspectedDuplicate]) -> dict[str, int]:
    """Per route, the requests that repeated one of the same run under another key (each
    run's keys but its first): the likely extra executions."""
    extra: dict[str, int] = {}
    for run in found:
        extra[run.route] = extra.get(run.route, 0) + run.keys - 1
    return extra

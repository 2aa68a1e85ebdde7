"""An opt-in detector for clients that mint a new key inside their retry loop.

Such a client deduplicates nothing: each attempt is a new key, so the guard sees two
different keys with identical requests and runs both. The signature is visible, though:
the same caller (host and principal) sending the same request (fingerprint) under a
different key within a short window. That is counted
(``suspected_regenerated_keys`` by route) and logged with both key digests.

It is a suspicion, not a verdict: a caller that really means to do the same thing twice
within the window looks the same. The window should be about a client's retry budget
(seconds), not a business interval.

Where it looks: in the store every worker shares, so a retry that reaches another
process or host is seen. Each request the guard runs writes a short-lived *marker* row
through the store's own atomic ``insert`` (no schema change, every store):

- its key is a digest of ("regenerated", host, principal, fingerprint), built so that
  it can never equal a request's or a function's record key;
- its ``request_hash`` holds the request's scoped key (a digest: never the raw key);
- its lease and retention both end ``window`` from now, so ``prune`` deletes it.

``insert`` answers in the one round trip: nothing there (the first sighting), a live
marker naming the same scoped key (a retry of one key: nothing to say), a live marker
naming another (the same caller sent the same request under another key: flagged),
or a marker past its window (replaced by compare-and-swap, so the window restarts).
The window runs from the first sighting, not the last.

Cost: one insert per request the handler runs for (a replay, 409 or 422 writes
nothing); a second statement only when an old marker is replaced. Nothing when off.
A failed marker write never fails the request: it is logged, and the request runs.

Marker rows are in-progress rows to the store: ``asgi-idempotency stats`` counts them
among live in-progress rows for the length of the window (about the guarded request
rate times the window), then among expired rows until pruned. They never answer a
request (no request's key can equal theirs), and a log line's ``key_digest`` names a
request's record, never a marker, so ``inspect`` finds the record.

In transactional mode the marker is written in the request's transaction: it commits
with the record, and a request rolled back leaves none.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from .lifecycle import RecordState, state_of
from .stores.base import BUSY, NewClaim

if TYPE_CHECKING:
    from .lifecycle import Claimant

__all__ = ["MARKER_TOKEN", "RegeneratedKeys", "marker_key"]

# The token of every marker row: markers are never completed, renewed or released, so
# no claim's fencing token is needed; a fixed one names them for a reader of the table.
MARKER_TOKEN = "regenerated-key-marker"


def marker_key(host: str, principal: str, fingerprint: str) -> str:
    """The marker's record key: SHA-256 of (host, principal, fingerprint), length-prefixed.

    Its material starts with ``r``, where a request's scoped key starts with a digit or
    ``h`` and a function's with ``o`` (:func:`.keys.scoped_key`, :func:`.once.record_key`),
    so a marker can never sit on a record's key, whatever the inputs.
    """
    material = f"r{len(host)}:{host}\x00{len(principal)}:{principal}\x00{fingerprint}"
    return hashlib.sha256(material.encode()).hexdigest()


class RegeneratedKeys:
    """Looks up, in the shared store, whether this caller sent this request under another key."""

    __slots__ = ("window",)

    def __init__(self, window: timedelta) -> None:
        if not isinstance(window, timedelta) or window <= timedelta(0):
            raise ValueError(f"the regenerated-key window must be a positive timedelta: {window!r}")
        self.window = window

    async def check(
        self,
        store: Claimant,
        *,
        host: str,
        principal: str,
        fingerprint: str,
        key: str,
        now: datetime,
    ) -> str | None:
        """The other scoped key this caller sent this request under within the window, if any.

        One ``insert`` on ``store``; a ``replace`` too when the marker found is past its
        window. ``key`` is the request's scoped key (a digest).

        Raises:
            StoreError: the store failed (the caller logs it and goes on).
        """
        window = self.window
        marker = NewClaim(marker_key(host, principal, fingerprint), key, MARKER_TOKEN, now,
                          window, window)  # fmt: skip
        found = await store.insert(marker)
        if found is None or found is BUSY:
            # The first sighting; or, in a transaction, another one holds the marker's
            # lock right now (a concurrent twin: missed, the count is a lower bound).
            return None
        if state_of(found, now) is RecordState.EXPIRED:
            # A sighting from before the window: this one starts a new window. Losing the
            # swap to a concurrent request means that one restarted it: nothing to add.
            await store.replace(found, marker)
            return None
        return found.request_hash if found.request_hash != key else None

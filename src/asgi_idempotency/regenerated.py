"""An opt-in detector for clients that mint a new key inside their retry loop.

Such a client deduplicates nothing: each attempt is a new key, so the guard sees two
different keys with identical requests and runs both. The signature is visible, though:
the same caller (host and principal) sending the same request (fingerprint) under a
different key within a short window. That is counted
(``suspected_regenerated_keys`` by route) and logged with both key digests.

It is a suspicion, not a verdict: a caller that really means to do the same thing twice
within the window looks the same. The window should be about a client's retry budget
(seconds), not a business interval.

Cost: in process, no store access. One dict entry (two digests and a time) per guarded
request within the window, at most ``maxsize`` entries; a retry that reaches another
worker process is not seen, so the count is a lower bound.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from datetime import timedelta

__all__ = ["RegeneratedKeys"]


class RegeneratedKeys:
    """Remembers each (caller, request) briefly; reports a second key for the same pair."""

    __slots__ = ("_seen", "maxsize", "window")

    def __init__(self, window: timedelta, *, maxsize: int = 100_000) -> None:
        if not isinstance(window, timedelta) or window <= timedelta(0):
            raise ValueError(f"the regenerated-key window must be a positive timedelta: {window!r}")
        self.window = window.total_seconds()
        self.maxsize = maxsize
        # (caller, fingerprint) -> (scoped key, monotonic time), oldest first
        self._seen: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def check(self, caller: str, fingerprint: str, key: str) -> str | None:
        """The other scoped key this caller sent this request under within the window, if any."""
        now = time.monotonic()
        entry = (caller, fingerprint)
        seen = self._seen.pop(entry, None)
        self._seen[entry] = (key, now)
        while len(self._seen) > self.maxsize:
            self._seen.popitem(last=False)
        if seen is not None and seen[0] != key and now - seen[1] <= self.window:
            return seen[0]
        return None

"""An opt-in detector for clients that mint a new key inside their retry loop.

The same caller (host and principal) sending the same request (fingerprint) under
another key within a short window is counted (``suspected_regenerated_keys``) and
logged with both key digests: a suspicion, not a verdict. The lookup is a short-lived
marker row written through the store's own atomic ``insert``, so every worker sees it;
each marker has its own token (:data:`MARKER_TOKEN` and 16 random hex digits); a failed
marker write is logged and never fails the request. How it works and what it
costs: docs/operations.md ("Keys minted inside a retry loop").
"""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timedelta

from asgi_idempotency.core.lifecycle import Claimant, sighting
from asgi_idempotency.stores.base import NewClaim

__all__ = ["MARKER_TOKEN", "RegeneratedKeys", "marker_key"]

# How every marker row's token starts, naming markers for a reader of the table. The
# rest is drawn per marker: markers are never completed, renewed or released, but a
# store may answer an insert that meets a row with its own token as inserted (its first
# attempt landed: RedisStore, the batching Postgres store), so a token shared by all
# markers made every sighting a "first" there, and nothing was ever flagged.
MARKER_TOKEN = "regenerated-key-"  # 16 characters, and 16 hex digits: the column's 32


def marker_key(host: str, principal: str, fingerprint: str, namespace: str = "") -> str:
    """The marker's record key: SHA-256 of (host, principal, fingerprint, namespace),
    length-prefixed.

    Its material starts with ``r``, where a request's scoped key starts with a digit,
    ``h`` or ``n`` and a function's with ``o`` (:func:`.keys.scoped_key`,
    :func:`.once.record_key`), so a marker can never sit on a record's key, whatever
    the inputs. Without a namespace the material is what it was before namespaces.
    """
    material = f"r{len(host)}:{host}\x00{len(principal)}:{principal}\x00{fingerprint}"
    if namespace:
        # After the fingerprint (a fixed-length digest): no other input can end there.
        material = f"{material}\x00n{len(namespace)}:{namespace}"
    return hashlib.sha256(material.encode()).hexdigest()


class RegeneratedKeys:
    """Looks up, in the shared store, whether this caller sent this request under another key."""

    __slots__ = ("namespace", "window")

    def __init__(self, window: timedelta, *, namespace: str = "") -> None:
        if not isinstance(window, timedelta) or window <= timedelta(0):
            raise ValueError(f"the regenerated-key window must be a positive timedelta: {window!r}")
        self.window = window
        # The guard's service: the same request to two services sharing a store is two
        # requests, not one sent under two keys.
        self.namespace = namespace

    def marker(self, *, host: str, principal: str, fingerprint: str, key: str,
               now: datetime) -> NewClaim:  # fmt: skip
        """The sighting this request leaves: a marker row under the caller's and the
        request's digest, holding the request's scoped key (``key``, a digest) for the
        window. The runner writes it (:meth:`.execution.Runner.sighting`)."""
        window = self.window
        token = MARKER_TOKEN + os.urandom(8).hex()
        where = marker_key(host, principal, fingerprint, self.namespace)
        return NewClaim(where, key, token, now, window, window)

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
        """The other scoped key this caller sent this request under within the window,
        if any: :meth:`marker` written through :func:`.lifecycle.sighting` on ``store``.

        Raises:
            StoreError: the store failed (the caller logs it and goes on).
        """
        marker = self.marker(host=host, principal=principal, fingerprint=fingerprint, key=key,
                             now=now)  # fmt: skip
        other = await sighting(store, marker, now)
        return other if other != key else None

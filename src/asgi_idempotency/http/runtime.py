"""What every request of one middleware shares: the runner, the app, the service's
namespace, the regenerated-key detector and the callers' scope digests."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from asgi_idempotency.core.execution import Runner
from asgi_idempotency.core.keys import scope_digest
from asgi_idempotency.http.asgi import ASGIApp
from asgi_idempotency.observability.observer import Observer
from asgi_idempotency.observability.regenerated import RegeneratedKeys
from asgi_idempotency.stores.base import Store

__all__ = ["Runtime"]


class Runtime:
    """What every request of one middleware shares: the runner (the store, the clock, the
    settings), the app, the service's namespace and the regenerated-key detector."""

    __slots__ = ("app", "namespace", "regenerated", "runner", "scopes")

    def __init__(
        self,
        app: ASGIApp,
        store: Store,
        *,
        clock: Callable[[], datetime],
        fail_open: bool,
        retry_after: float,
        observer: Observer,
        namespace: str = "",
    ) -> None:
        self.runner = Runner(
            store, clock=clock, fail_open=fail_open, retry_after=retry_after, observer=observer
        )
        self.app = app
        self.namespace = namespace  # the service's namespace in every key ("": none)
        # The opt-in regenerated-key detector (regenerated.py); None costs one check.
        self.regenerated: RegeneratedKeys | None = None
        # Scope digests by (principal, host): the audit's digest is the same for every
        # request of one caller, a sha256 not worth computing per request.
        self.scopes: dict[tuple[str, str], str] = {}

    def scope_digest(self, principal: str, host: str) -> str:
        """:func:`.keys.scope_digest` of the caller in this service's namespace, kept for
        the last :data:`_SCOPES_KEPT` callers (then forgotten all at once)."""
        scopes = self.scopes
        digest = scopes.get((principal, host))
        if digest is None:
            if len(scopes) >= _SCOPES_KEPT:
                scopes.clear()
            digest = scopes[principal, host] = scope_digest(principal, host, self.namespace)
        return digest


# Callers whose scope digest a middleware keeps (about 200 bytes each).
_SCOPES_KEPT = 4096

"""What the core tells operators through, as a protocol: the core logs, counts and
traces by calling these methods, and never imports the observability layer above it.

:class:`asgi_idempotency.observability.observer.Observer` satisfies it (structurally,
without naming it), and is what the middleware and ``Once`` pass in.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

__all__ = ["Observing"]


class Observing(Protocol):
    """The observer's methods the core calls (lease renewal, the execution core)."""

    @property
    def timing(self) -> bool:
        """Whether store calls are timed (a sink takes store latencies): the core then
        wraps each in :meth:`store_call` even when no span records."""
        ...

    def log(
        self, level: int, event: str, route: str, key: str, *, hint: str = "", **fields: Any
    ) -> None:
        """Log ``event`` (``idempotency.*``) for a call on ``route`` whose scoped key is ``key``."""
        ...

    def store_error(
        self, route: str, key: str, phase: str, exc: BaseException, **fields: Any
    ) -> None:
        """A store failure during ``phase`` (claim, complete, release ...), at ERROR."""
        ...

    def takeover(self, route: str) -> None:
        """A claim took over an abandoned one (its holder's lease ran out)."""
        ...

    def store_call(self, operation: str, span: Any) -> AbstractContextManager[Any]:
        """Around one store operation: traced as a child of ``span`` (``None``: nothing
        records), timed if :attr:`timing`."""
        ...

    def annotate(self, span: Any, /, **attributes: str | bool) -> None:
        """Set ``idempotency.<name>`` attributes on ``span`` (a recording span)."""
        ...

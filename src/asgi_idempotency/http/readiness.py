"""The store's own startup check (``PreparedStore.prepare``), and when it runs.

SQLite: create the table; Postgres: check that the migration ran. At lifespan startup
(a missing schema fails startup with the message that names the fix), else on guarded
requests until it has passed once (503 until then, checked again at most every
``retry_after`` seconds, so running ``asgi-idempotency migrate`` heals a running app).
Once it has passed, the request path pays one attribute check.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from asgi_idempotency.core.errors import SchemaMissing, StoreError, StoreUnavailable
from asgi_idempotency.http.asgi import ASGIApp, Message, Receive, Scope, Send
from asgi_idempotency.http.problems import send_problem
from asgi_idempotency.observability.metrics import Outcome
from asgi_idempotency.observability.observer import Observer
from asgi_idempotency.stores.base import PreparedStore, Store

__all__ = ["Readiness"]


class Readiness:
    """Whether one middleware's store has passed its startup check, and running it."""

    def __init__(self, store: Store, observer: Observer, retry_after: float) -> None:
        self._observer = observer
        self.retry_after = retry_after
        self._prepare: Callable[[], Awaitable[None]] | None = (
            store.prepare if isinstance(store, PreparedStore) else None
        )
        self.ready = self._prepare is None
        self._missing: SchemaMissing | None = None  # the last check's answer, if it failed
        self._checked_at = -math.inf  # monotonic time of the last failed check
        self._checking: asyncio.Event | None = None  # set when the check in flight ends

    async def ensure(self, route: str, send: Send, *, report: bool = False) -> bool:
        """Prepare the store for an app served without lifespan; ``False`` once answered 503
        (in report-only mode, ``report``: not answered, only logged and counted; the
        caller lets the app answer).

        A failed check is repeated at most every ``retry_after`` seconds, so running
        ``asgi-idempotency migrate`` heals a running app without a check per request.
        A store that cannot be reached is left to the claim, which answers (or fails
        open) as for any store error.
        """
        now = time.monotonic()
        if self._checking is not None:
            # One check at a time: a burst of first requests waits for it, rather than
            # each taking a pooled connection for a check of its own.
            await self._checking.wait()
        elif now - self._checked_at >= self.retry_after:
            self._checking = checking = asyncio.Event()
            try:
                await self._run_prepare()
            except SchemaMissing as exc:
                self._missing, self._checked_at = exc, now
            except StoreError as exc:
                self._missing, self._checked_at = None, now
                self._observer.not_ready("request", exc, now=now, route=route)
                return True
            finally:
                self._checking = None
                checking.set()
        missing = self._missing
        if self.ready or missing is None:
            return True
        self._observer.not_ready("request", missing, now=now, route=route)
        self._observer.outcome(route, Outcome.STORE_UNAVAILABLE)
        if report:
            self._observer.report(route, "", StoreUnavailable.status)
            return False
        # Always 503, fail_open or not: a missing schema is a deployment step left
        # out, not an outage, and running unguarded would hide it.
        await send_problem(send, StoreUnavailable(missing.detail, retry_after=self.retry_after))
        return False

    async def _run_prepare(self) -> None:
        assert self._prepare is not None
        await self._prepare()
        self.ready, self._missing = True, None

    async def lifespan(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's lifespan, with the store prepared once the app's own startup is done.

        After the app's startup (which may be what creates the schema, in development),
        ``prepare`` runs. A missing schema fails startup with the message that names
        the fix: the app is shut down first, so its own clean-up runs, the server gets
        ``lifespan.startup.failed``, and the :class:`SchemaMissing` is raised, as
        Starlette raises its own app's startup error (a ``TestClient``'s ``with`` raises
        it; uvicorn prints the message and exits). An unreachable store does not stop the app
        (it answers 503 until the store is back); it is logged, and the check is
        repeated on the first guarded requests.
        """
        if self.ready:
            await app(scope, receive, send)
            return
        failure: SchemaMissing | None = None
        reported = False

        async def app_receive() -> Message:
            if failure is not None:
                return {"type": "lifespan.shutdown"}
            return await receive()

        async def app_send(message: Message) -> None:
            nonlocal failure, reported
            kind = message["type"]
            if kind == "lifespan.startup.complete":
                failure = await self._prepare_at_startup()
                if failure is not None:
                    return  # the app asks for its next message and is told to shut down
            elif failure is not None and kind.startswith("lifespan.shutdown."):
                reported = True
                await send({"type": "lifespan.startup.failed", "message": failure.detail})
                return
            await send(message)

        await app(scope, app_receive, app_send)
        if failure is not None:
            if not reported:
                await send({"type": "lifespan.startup.failed", "message": failure.detail})
            raise failure

    async def _prepare_at_startup(self) -> SchemaMissing | None:
        """``None`` if the store is ready or unreachable (logged), else why startup fails."""
        try:
            await self._run_prepare()
        except SchemaMissing as exc:
            self._observer.not_ready("startup", exc, now=time.monotonic())
            return exc
        except StoreError as exc:
            self._observer.not_ready("startup", exc, now=time.monotonic())
        return None

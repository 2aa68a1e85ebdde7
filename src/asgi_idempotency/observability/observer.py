"""What the guard tells operators: one outcome count per guarded request, and log events.

Every middleware counts its outcomes in process (:class:`InMemoryMetrics`, read with
``IdempotencyMiddleware.snapshot()``) and passes each to the optional sink it was
given (Prometheus, say). Log records carry their fields twice: as ``extra`` for
structured handlers, and in the message (``event key=value ...``) for plain
``logging``. Keys appear only as the first 16 hex digits of the scoped key's digest;
bodies and stored responses never appear.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any

from asgi_idempotency.core.errors import SchemaMissing
from asgi_idempotency.observability import tracing
from asgi_idempotency.observability.metrics import InMemoryMetrics, MetricsSink, Outcome
from asgi_idempotency.observability.tracing import trace as _otel

__all__ = ["Observer", "logger", "route_to_server_log", "store_label"]

# A store that is not ready repeats its reason on every guarded request; say it again
# only when it changes or after this many seconds, not once per request.
_NOT_READY_EVERY = 60.0

logger = logging.getLogger("asgi_idempotency")

# What an operator does about a store that failed: the hint closing the message of
# store_error, and of not_ready when the database did not answer (a missing schema's
# detail names its own fix). The message is often all a reader sees ("%(message)s").
_STORE_DOWN = (
    "the idempotency store's database failed or did not answer: check that it is up "
    "and reachable from this server (host, port, credentials)"
)
_NOT_READY_DOWN = (
    "the startup check could not reach the idempotency store's database: check that it "
    "is up and reachable from this server (host, port, credentials); guarded requests "
    "get 503 until it answers"
)


class _ServerLog(logging.Handler):
    """WARNING and up of the package's logger, shown where the server shows its own lines,
    but only while nothing else would show them.

    A library leaves its log to the application; but an app served as the README shows
    (``uvicorn main:app``) configures no logging of its own: uvicorn gives handlers to
    its own loggers only, and the package's ``NullHandler`` stops Python's last resort,
    so a store's failure would be logged nowhere. Checked on every record, so an app that
    configures logging later (a root handler, or one on ``asgi_idempotency``) takes over.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        if _shown_elsewhere():
            return
        server = logging.getLogger("uvicorn.error")
        if _handlers_of(server):
            server.handle(record)  # in uvicorn's format, on its stream (stderr)
        else:
            last = logging.lastResort  # stderr, as Python shows a record nobody handles
            if last is not None:
                last.handle(record)


def _handlers_of(start: logging.Logger) -> list[logging.Handler]:
    """The handlers a record logged on ``start`` reaches, as ``Logger.callHandlers`` walks them."""
    found: list[logging.Handler] = []
    node: logging.Logger | None = start
    while node is not None:
        found += node.handlers
        node = node.parent if node.propagate else None
    return found


def _shown_elsewhere() -> bool:
    return any(not isinstance(h, (logging.NullHandler, _ServerLog)) for h in _handlers_of(logger))


def route_to_server_log() -> None:
    """Once per process: show the package's WARNING and up in the server's log (uvicorn's
    ``uvicorn.error``, else stderr) whenever the application has configured no handler
    that would show them. Called when a middleware starts."""
    if not any(isinstance(h, _ServerLog) for h in logger.handlers):
        logger.addHandler(_ServerLog())


def _line(event: str, fields: dict[str, Any], hint: str = "") -> str:
    """``event key=value ... detail=...``, on one line, then `` -- hint``.

    ``detail`` is free text (a driver's message, with spaces and maybe line breaks):
    it goes last, so the fields after it cannot be read as part of it, and its line
    breaks become spaces, so a handler printing one line per record shows all of it.
    """
    shown = [f"{name}={value}" for name, value in fields.items() if name != "detail"]
    if "detail" in fields:
        shown.append(f"detail={fields['detail']}")
    text = " ".join([event, *shown])
    if hint:
        text = f"{text} -- {hint}"
    return " ".join(text.split()) if "\n" in text or "\r" in text else text


def store_label(store: object) -> str:
    """The ``store`` label of the latency histogram: the class, and its dialect if any
    (``SQLStore/postgresql``)."""
    label = type(store).__name__
    dialect = getattr(store, "dialect", None)
    return f"{label}/{dialect}" if dialect else label


class _Timed:
    """A store call timed for the sink's latency histogram (and traced if a span records)."""

    __slots__ = ("observer", "operation", "span", "started")

    def __init__(self, observer: Observer, operation: str, span: AbstractContextManager[Any]):
        self.observer, self.operation, self.span = observer, operation, span
        self.started = 0.0

    def __enter__(self) -> None:
        self.span.__enter__()
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.started
        self.span.__exit__(*exc)  # type: ignore[arg-type]
        self.observer.store_time(self.operation, elapsed)


class Observer:
    """Counts and logs for one middleware; shared by all of its requests.

    Satisfies the core's :class:`~asgi_idempotency.core.observing.Observing`: the
    execution core and the lease renewals log, time and trace through it.
    """

    __slots__ = ("_not_ready_said", "counts", "sink", "store_label", "timing")

    def __init__(self, sink: MetricsSink | None, store_label: str = "") -> None:
        self.counts = InMemoryMetrics()
        self.sink = sink
        self.store_label = store_label
        # Store latency is measured only for a sink that takes it (observe_store).
        self.timing = callable(getattr(sink, "observe_store", None))
        self._not_ready_said: tuple[str, float] | None = None  # (message, monotonic time)

    def store_call(self, operation: str, span: Any) -> AbstractContextManager[Any]:
        """Around one store operation: a child of ``span`` (the request's recording span,
        or ``None``), timed if the sink takes store latencies; else a shared no-op."""
        inner = tracing.store_span(operation, span)
        return _Timed(self, operation, inner) if self.timing else inner

    def store_time(self, operation: str, seconds: float) -> None:
        self.sink.observe_store(operation, self.store_label, seconds)  # type: ignore[union-attr]

    def annotate(self, span: Any, /, **attributes: str | bool) -> None:
        """Set ``idempotency.<name>`` attributes on ``span`` (:func:`.tracing.annotate`):
        how the core, which imports no tracing, marks the request's span."""
        tracing.annotate(span, **attributes)

    def takeover(self, route: str) -> None:
        """A retry took over an abandoned claim (its holder's lease ran out)."""
        observe = getattr(self.sink, "observe_takeover", None)
        if observe is not None:
            observe(route)

    def outcome(self, route: str, outcome: Outcome) -> None:
        self.counts.observe(route, outcome)
        if self.sink is not None:
            self.sink.observe(route, outcome)
        # Inlined tracing.live(): a global read per outcome when no tracer is set.
        if _otel is not None and _otel._TRACER_PROVIDER is not None:
            span = tracing.recording()
            if span is not None:
                tracing.annotate(span, outcome=outcome.value, route=route)

    def counted(self, route: str, outcome: Outcome) -> None:
        """:meth:`outcome` without touching the current span: the function guard puts
        its outcome on a span of its own (:func:`.tracing.function_span`)."""
        self.counts.observe(route, outcome)
        if self.sink is not None:
            self.sink.observe(route, outcome)

    def log(
        self, level: int, event: str, route: str, key: str, *, hint: str = "", **fields: Any
    ) -> None:
        """Log ``event`` for a request on ``route`` whose scoped key is ``key``."""
        if not logger.isEnabledFor(level):
            return  # replays log at INFO: skip building the record when nobody listens
        fields = {"route": route, "key_digest": key[:16], **fields}
        logger.log(level, "%s", _line(event, fields, hint), extra={"event": event, **fields})

    def store_error(
        self, route: str, key: str, phase: str, exc: BaseException, **fields: Any
    ) -> None:
        """A store failure, at ERROR: its class and message first, so the cause is on the
        first line a user reads. Store messages name driver errors, never keys or bodies."""
        self.log(
            logging.ERROR,
            "idempotency.store_error",
            route,
            key,
            phase=phase,
            error=type(exc).__name__,
            detail=str(exc),
            hint=_STORE_DOWN,
            **fields,
        )

    def regenerated_key(self, route: str, key: str, other: str) -> None:
        """The same caller sent the same request under ``key`` and, just before, ``other``."""
        self.counts.observe_regenerated_key(route)
        observe = getattr(self.sink, "observe_regenerated_key", None)
        if observe is not None:
            observe(route)
        self.log(
            logging.WARNING, "idempotency.regenerated_key", route, key,
            other_key_digest=other[:16],
        )  # fmt: skip

    def report(self, route: str, key: str, status: int, **fields: Any) -> None:
        """Report-only mode: the answer the guard would have given (``status``), at INFO."""
        self.log(logging.INFO, "idempotency.report", route, key, would_answer=status, **fields)

    def refused(self, route: str, exc: BaseException) -> None:
        """A request the guard could not scope to a caller: a misconfiguration at ERROR
        (its detail names the fix), a request naming no caller at INFO."""
        status = getattr(exc, "status", 500)
        level = logging.ERROR if status >= 500 else logging.INFO
        if not logger.isEnabledFor(level):
            return
        fields = {"route": route, "error": type(exc).__name__, "detail": str(exc)}
        text = " ".join(f"{name}={value}" for name, value in fields.items())
        event = "idempotency.principal"
        logger.log(level, "%s %s", event, text, extra={"event": event, **fields})

    def not_ready(self, phase: str, exc: BaseException, *, now: float, route: str = "") -> None:
        """The store could not be prepared (``phase``: ``startup`` or ``request``), at ERROR.

        Logged the first time, when the reason changes, and then at most once a minute,
        so a missing schema shows on the first line a user reads without flooding the log.
        """
        said, detail = self._not_ready_said, str(exc)
        if said is not None and said[0] == detail and now - said[1] < _NOT_READY_EVERY:
            return
        self._not_ready_said = (detail, now)
        fields: dict[str, Any] = {"phase": phase, "error": type(exc).__name__, "detail": detail}
        if route:
            fields = {"route": route, **fields}
        event = "idempotency.not_ready"
        hint = "" if isinstance(exc, SchemaMissing) else _NOT_READY_DOWN
        logger.error("%s", _line(event, fields, hint), extra={"event": event, **fields})

"""OpenTelemetry: the guard's decision on the request's server span, and a child span
per store operation.

Optional: the ``otel`` extra (``opentelemetry-api`` only; the app brings its SDK and
its server instrumentation, as FastAPI services do). Without the API installed this
module does nothing at all; with it installed but no SDK configured, the current span
does not record and each hook costs one context lookup.

Attributes (on the current span, the server span of a traced request):
``idempotency.outcome`` (executed, replayed, in_progress, mismatch, ...; the values of
:class:`~.metrics.Outcome`), ``idempotency.key_digest`` (the first 16 hex digits of
the scoped key, as the logs print it; never the key), ``idempotency.taken_over``,
``idempotency.mode``, and ``http.route`` (the route template). Store spans are named
``idempotency <operation>`` (claim, complete, release) with ``db.operation.name``.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

try:
    from opentelemetry import trace
except ImportError:  # the otel extra is optional
    trace = None  # type: ignore[assignment]

__all__ = ["ENABLED", "annotate", "live", "recording", "store_span", "trace"]

ENABLED = trace is not None
# The API loads a provider named by this variable on first use: load it now, so that
# "no provider set" below stays a plain global read.
if trace is not None and "OTEL_PYTHON_TRACER_PROVIDER" in os.environ:
    trace.get_tracer_provider()


def live() -> bool:
    """Whether a tracer provider is set (else nothing can record). The request path
    inlines this test: ``tracing.trace is not None and tracing.trace._TRACER_PROVIDER``."""
    return trace is not None and trace._TRACER_PROVIDER is not None
_NOTHING: AbstractContextManager[Any] = nullcontext()
_tracer: Any = None


def _span() -> Any:
    """The current span if it records, else ``None``."""
    if trace is None or trace._TRACER_PROVIDER is None:
        # No provider set: only the API's stand-in answers, and nothing records. A
        # module global read, where a context lookup costs a dozen calls per request.
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


def recording() -> Any:
    """The current span if one records, else ``None``: looked up once per request."""
    return _span()


def annotate(span: Any = None, /, **attributes: str | bool) -> None:
    """Set ``idempotency.<name>`` attributes (``route`` as ``http.route``) on ``span``, or
    on the current span if it records."""
    if span is None:
        span = _span()
        if span is None:
            return
    for name, value in attributes.items():
        span.set_attribute("http.route" if name == "route" else f"idempotency.{name}", value)


def store_span(operation: str, parent: Any = None) -> AbstractContextManager[Any]:
    """A child span around one store operation, or a context that does nothing.

    ``parent`` is the request's recording span (:func:`recording`); ``None`` means none
    records, and nothing is looked up."""
    global _tracer
    if parent is None:
        return _NOTHING
    assert trace is not None
    if _tracer is None:
        from importlib.metadata import version

        _tracer = trace.get_tracer("asgi_idempotency", version("asgi-idempotency"))
    return _tracer.start_as_current_span(  # type: ignore[no-any-return]
        f"idempotency {operation}",
        kind=trace.SpanKind.CLIENT,
        attributes={"db.operation.name": operation},
    )

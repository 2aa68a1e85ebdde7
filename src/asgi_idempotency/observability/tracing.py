"""OpenTelemetry: the guard's decision on the request's server span, and a child span
per store operation.

Optional: the ``otel`` extra (``opentelemetry-api`` only; the app brings its SDK).
Without the API this module does nothing at all. The function guard opens a span of
its own per guarded call (``once <namespace>``), since it runs inside someone else's
span. Attributes and span names: docs/operations.md and docs/guide/once.md.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

try:
    from opentelemetry import trace
except ImportError:  # the otel extra is optional
    trace = None  # type: ignore[assignment]

__all__ = ["ENABLED", "annotate", "function_span", "live", "recording", "store_span", "trace"]

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
        span.set_attribute(_attribute(name), value)


def _attribute(name: str) -> str:
    """The span attribute for one of ours: a semantic-convention name where one exists."""
    return "http.route" if name == "route" else f"idempotency.{name}"


def _get_tracer() -> Any:
    global _tracer
    if _tracer is None:
        from importlib.metadata import version

        assert trace is not None
        _tracer = trace.get_tracer("asgi_idempotency", version("asgi-idempotency"))
    return _tracer


def store_span(operation: str, parent: Any = None) -> AbstractContextManager[Any]:
    """A child span of ``parent`` around one store operation, or a context that does nothing.

    ``parent`` is the recording span the operation belongs to (the request's, from
    :func:`recording`, or a guarded call's, from :func:`function_span`); ``None`` means
    none records, and nothing is looked up. The parent is explicit, not the current
    context: the function guard runs store calls on an event loop of its own, in
    another thread, where the caller's context is not current."""
    if parent is None:
        return _NOTHING
    assert trace is not None
    return _get_tracer().start_as_current_span(  # type: ignore[no-any-return]
        f"idempotency {operation}",
        context=trace.set_span_in_context(parent),
        kind=trace.SpanKind.CLIENT,
        attributes={"db.operation.name": operation},
    )


def function_span(namespace: str, function: str) -> AbstractContextManager[Any]:
    """A span of its own around one call of a guarded function, child of the current
    span if there is one; a context that does nothing (entering it gives ``None``) when
    no tracer provider is set.

    Entering it gives the span, which may not record (sampled out): check
    ``is_recording()`` before building attributes. Exceptions leaving it are recorded
    and set its status to ERROR, as for any span the API opens.
    """
    if trace is None or trace._TRACER_PROVIDER is None:
        return _NOTHING
    return _get_tracer().start_as_current_span(  # type: ignore[no-any-return]
        f"once {namespace}",
        kind=trace.SpanKind.INTERNAL,
        attributes={_attribute("namespace"): namespace, "code.function.name": function},
    )

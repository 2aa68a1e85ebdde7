"""One in-memory span exporter for the whole test process.

OpenTelemetry takes one global tracer provider per process (a second
``set_tracer_provider`` is ignored), so every test module that reads spans shares
this one, installed by whichever asks first.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_EXPORTER = InMemorySpanExporter()
_installed: list[TracerProvider] = []


def in_memory_exporter() -> InMemorySpanExporter:
    """The process's exporter, its provider installed globally on first use; emptied."""
    if not _installed:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
        _installed.append(provider)
    _EXPORTER.clear()
    return _EXPORTER


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})

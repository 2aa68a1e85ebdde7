"""Prometheus rules and a Grafana dashboard for ``idempotency_requests_total``, as package data.

``alerts.yml`` is a Prometheus rule file (recording rules, then alerts) and
``dashboard.json`` a Grafana dashboard; both query only the counter that
:class:`asgi_idempotency.observability.prometheus.PrometheusMetrics` exports, under its default
prefix. Copy them out of the installed package (the README's Operations section says
how)::

    from importlib.resources import files

    rules = files("asgi_idempotency.ops").joinpath("alerts.yml").read_text()

They are files, not code: nothing here imports ``prometheus_client``.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable

__all__ = ["ALERTS", "DASHBOARD"]

# Traversables rather than paths: inside a zipped install there is no file on disk.
ALERTS: Traversable = files(__name__).joinpath("alerts.yml")
DASHBOARD: Traversable = files(__name__).joinpath("dashboard.json")

"""``asgi-idempotency audit``: likely duplicates keys could not catch (a key minted inside a
retry loop), from the records every worker wrote (:mod:`asgi_idempotency.ops.audit`).

Each finding names its caller by a digest (``scope-digest PRINCIPAL`` gives the digest of
a caller one has in mind) and lists its records' key digests, which ``inspect`` takes.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from asgi_idempotency.ops.commands._common import (
    CLIError,
    Exit,
    command,
    fmt_span,
    iso,
    namespace_of,
    output,
    plural,
    require_url,
    store_errors,
    with_store,
)
from asgi_idempotency.stores.urls import redact

__all__ = ["audit"]

#: Key digests the table shows per finding (``--format json`` lists them all).
SHOWN_KEYS = 8


@command("audit")
def audit(
    database_url: str | None = None,
    *,
    timeout: float = 10.0,
    since: timedelta = timedelta(hours=1),
    window: timedelta = timedelta(minutes=10),
    route: str | None = None,
    namespace: str = "",
    output_format: str = "table",
    out: TextIO | None = None,
) -> int:
    """List runs of one caller's identical requests to one route under different keys,
    each within ``window`` of the one before, claimed in the last ``since``; only
    ``route``'s (a template) when given. ``output_format``: ``table``, ``json`` or
    ``prometheus`` (the audit's gauge alone, as exposition text). ``namespace``: the
    middleware's, carried into the commands it suggests for naming a caller.

    Returns 0 when nothing is found, 1 when something is, 4 when the schema is missing or
    not migrated.
    """
    from asgi_idempotency.ops.audit import extra_keys_by_route, suspected_duplicates

    out = output(out)
    namespace = namespace_of(namespace)
    if output_format not in ("table", "json", "prometheus"):
        raise CLIError(Exit.USAGE, f"no such format: {output_format!r}")
    url = require_url(database_url)
    if output_format == "prometheus":
        try:
            import prometheus_client  # noqa: F401

            from asgi_idempotency.observability.prometheus import PrometheusMetrics  # noqa: F401
        except ImportError as exc:
            raise CLIError(Exit.USAGE, f"--format prometheus: {exc}") from None

    async def body(store: Any) -> Exit:
        await _schema_is_current(store, url)
        now = datetime.now(UTC)
        found = await suspected_duplicates(store, since=since, window=window, route=route, now=now)
        if output_format == "json":
            payload = {
                "now": iso(now),
                "since": iso(now - since),
                "window_s": window.total_seconds(),
                "route": route,
                "namespace": namespace or None,
                "suspected": [
                    {
                        "route": run.route,
                        "caller_digest": run.scope_digest,
                        "request_digest": run.request_hash,
                        "requests": run.requests,
                        "keys": run.keys,
                        "key_digests": list(run.key_digests),
                        "first": iso(run.first),
                        "last": iso(run.last),
                    }
                    for run in found
                ],
            }
            print(json.dumps(payload), file=out)
        elif output_format == "prometheus":
            out.write(_exposition(found))
        elif not found:
            print(
                f"no suspected duplicates since {now - since:%Y-%m-%d %H:%M:%S} UTC "
                f"(window {fmt_span(window.total_seconds())})",
                file=out,
            )
        else:
            extra = sum(extra_keys_by_route(found).values())
            _table(out, found, extra, namespace)
        return Exit.FOUND if found else Exit.OK

    return asyncio.run(with_store(url, timeout, body))


async def _schema_is_current(store: Any, url: str) -> None:
    from asgi_idempotency.migrations import schema_problem
    from asgi_idempotency.stores.base import capabilities

    if not capabilities(store).migrations:
        return
    # Read-only, like stats: a table from before revision 0003 is reported (exit 4), not
    # upgraded (the app upgrades its own SQLite file at start).
    with store_errors(url):
        async with store.engine.connect() as conn:
            problem = await conn.run_sync(schema_problem)
    if problem is not None:
        raise CLIError(
            Exit.NO_SCHEMA, f"{problem} in {redact(url)}: run `asgi-idempotency migrate` first"
        )


def _exposition(found: list[Any]) -> str:
    """The audit's gauge as Prometheus text, and nothing else: ``PrometheusMetrics``
    registers the request counter, the store histogram and the take-over counter too,
    which would print as families without samples."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    from asgi_idempotency.observability.prometheus import PrometheusMetrics

    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    metrics.observe_audit(found)
    name = f"{metrics.prefix}_audit_suspected_regenerated_keys"

    class Only(Collector):
        def collect(self) -> Any:
            return [family for family in registry.collect() if family.name == name]

    only = CollectorRegistry()
    only.register(Only())
    return generate_latest(only).decode()


def _table(out: TextIO, found: list[Any], extra: int, namespace: str) -> None:
    runs = plural(len(found), "suspected duplicate run")
    print(
        f"{runs} ({plural(extra, 'request')} repeated under another key): "
        "the same caller, route and body under different keys",
        file=out,
    )
    print(
        f"{'route':<32} {'caller':<16} {'request':<16} {'requests':>8} {'keys':>5}  "
        f"{'first':<19} last",
        file=out,
    )
    for run in found:
        print(
            f"{run.route:<32} {run.scope_digest[:16]:<16} {run.request_hash[:16]:<16} "
            f"{run.requests:>8} {run.keys:>5}  {run.first:%Y-%m-%d %H:%M:%S} "
            f"{run.last:%Y-%m-%d %H:%M:%S}",
            file=out,
        )
        shown = [key[:16] for key in run.key_digests[:SHOWN_KEYS]]
        more = len(run.key_digests) - len(shown)
        if shown:
            tail = f" (and {more} more: --format json lists them)" if more else ""
            print(f"  key digests: {' '.join(shown)}{tail}", file=out)
    ns = f" --namespace {namespace}" if namespace else ""
    print(
        "\nA record: asgi-idempotency inspect KEY_DIGEST (one of the key digests above).\n"
        f"A caller: asgi-idempotency scope-digest PRINCIPAL [--host HOST]{ns} prints the "
        "digest the caller column starts with.",
        file=out,
    )

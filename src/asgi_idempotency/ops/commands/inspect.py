"""``asgi-idempotency inspect KEY``: the record for a key (did it run, when, with what result).

KEY is the Idempotency-Key as the client sent it, looked up in one scope (namespace,
host, principal), or the key digest a log line or the audit carries (16 to 64 hex
digits), which needs no scope.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime
from typing import Any, TextIO

from asgi_idempotency.ops.commands._common import (
    CLIError,
    Exit,
    command,
    fmt_time,
    header,
    host_of,
    iso,
    namespace_of,
    output,
    plural,
    require_url,
    with_store,
)

__all__ = ["inspect"]

# The logs' and the audit's key_digest: the first 16 hex digits of the scoped key (64 in
# full), or more of them.
_DIGEST = re.compile(r"[0-9a-fA-F]{16,64}")


def _searched(
    principal: str,
    host: str,
    x_forwarded_host: str | None,
    forwarded: str | None,
    namespace: str,
) -> tuple[dict[str, Any], list[str]]:
    """The scope ``inspect`` looked in, as shown, and what it may have lacked."""
    from asgi_idempotency.http.request import forwarded_hosts, host_name

    names = None if x_forwarded_host is None else x_forwarded_host.split(",")
    given = header(forwarded)
    searched: dict[str, Any] = {
        "host": host_name(header(host) or b"") or None,
        "principal": principal,
        "x_forwarded_host": None if names is None else [host_name(header(n) or b"") for n in names],
        "forwarded_host": None if given is None else [host_name(h) for h in forwarded_hosts(given)],
    }
    if namespace:
        searched["namespace"] = namespace
    hints = []
    if not host:
        hints.append(
            "records are scoped by host unless the app sets scope_by_host=False: pass "
            "--host as the app saw it (the request's Host header; a port is ignored)"
        )
    if not principal:
        hints.append(
            "searched as the anonymous caller: if the app's principal= names callers, "
            "pass --principal as it returned it"
        )
    if x_forwarded_host is None and forwarded is None:
        hints.append(
            "behind a proxy that passes X-Forwarded-Host or Forwarded, those hosts scope "
            "the record too: pass them with --x-forwarded-host or --forwarded"
        )
    if not namespace:
        hints.append(
            "a middleware given namespace= scopes its records by it: pass --namespace as "
            "the app sets it"
        )
    return searched, hints


@command("inspect")
def inspect(
    key: str,
    database_url: str | None = None,
    *,
    timeout: float = 10.0,
    principal: str = "",
    host: str = "",
    x_forwarded_host: str | None = None,
    forwarded: str | None = None,
    namespace: str = "",
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """Show the record for ``key`` in the scope of ``namespace``, ``host`` (and the
    forwarded hosts) and ``principal``, each as the app saw it; or, when no record has
    that key, the record whose key digest starts with ``key`` (16 to 64 hex digits).

    Returns 0 when a record exists (expired or not), 1 when none does, 2 when a digest
    prefix matches several records.
    """
    from asgi_idempotency.core.errors import InvalidKey
    from asgi_idempotency.core.keys import parse_key, scoped_key

    out = output(out)
    url = require_url(database_url)
    try:
        parsed = parse_key(key.encode("utf-8", "surrogateescape"))
    except InvalidKey as exc:
        raise CLIError(Exit.USAGE, f"not a valid Idempotency-Key: {exc.detail}") from None
    where = host_of(host, x_forwarded_host, forwarded)
    digest = scoped_key(principal, parsed, where, namespace=namespace_of(namespace))
    # KEY may also be the key digest a log line carries: tried when no record has it as
    # a client key (a 16-hex client key is valid, so the key goes first).
    prefix = key.lower() if _DIGEST.fullmatch(key) else None

    async def body(store: Any) -> Exit:
        nonlocal digest
        record = await store.get(digest)
        if record is None and prefix is not None:
            found = await store.find(prefix, limit=2)
            if len(found) > 1:
                raise CLIError(
                    Exit.USAGE,
                    f"the key digest {prefix} matches more than one record: "
                    "give more of its 64 hex digits",
                )
            if found:
                record = found[0]
                digest = record.key
        if record is None:
            searched, hints = _searched(principal, host, x_forwarded_host, forwarded, namespace)
            _not_found(out, digest, prefix, searched, hints, principal, as_json)
            return Exit.NOT_FOUND
        _show(out, digest, record, as_json)
        return Exit.OK

    return asyncio.run(with_store(url, timeout, body))


def _not_found(
    out: TextIO,
    digest: str,
    prefix: str | None,
    searched: dict[str, Any],
    hints: list[str],
    principal: str,
    as_json: bool,
) -> None:
    # Never a bare "it never ran": a record scoped by a host or principal the command
    # was not given is there all the same.
    if as_json:
        payload: dict[str, Any] = {
            "key_digest": digest,
            "found": False,
            "searched": searched,
            "hints": hints,
        }
        if prefix is not None:
            payload["digest_prefix"] = prefix
        print(json.dumps(payload), file=out)
        return
    forwarded = [
        f"{name} {', '.join(searched[field]) or '(none)'}"
        for name, field in (
            ("X-Forwarded-Host", "x_forwarded_host"),
            ("Forwarded host=", "forwarded_host"),
        )
        if searched[field] is not None
    ]
    lines = [
        ("key digest", digest),
        ("host", searched["host"] or "none (--host not given)"),
        ("principal", repr(principal) if principal else "anonymous"),
        ("forwarded", "; ".join(forwarded) or "none"),
    ]
    if "namespace" in searched:
        lines.append(("namespace", searched["namespace"]))
    print("no record for this key in the scope searched:", file=out)
    for label, value in lines:
        print(f"  {label:<12} {value}", file=out)
    if prefix is not None:
        print(f"nor a record whose key digest starts with {prefix}.", file=out)
    for hint in hints:
        print(f"- {hint}", file=out)
    print(
        "With the host and principal the app saw, no record means the key never "
        "ran here, was released after a failure, or was pruned.",
        file=out,
    )


def _show(out: TextIO, digest: str, record: Any, as_json: bool) -> None:
    from asgi_idempotency.core.lifecycle import RecordState, state_of
    from asgi_idempotency.stores.base import RecordStatus

    now = datetime.now(UTC)
    current = state_of(record, now)
    expired = current is RecordState.EXPIRED
    abandoned = current is RecordState.ABANDONED
    response = record.response
    # A lease bounds a running request; once completed it means nothing, so it is not shown.
    completed = record.status is RecordStatus.COMPLETED
    if as_json:
        payload = {
            "key_digest": digest,
            "found": True,
            "status": str(record.status),
            "created_at": iso(record.created_at),
            "locked_until": None if completed else iso(record.locked_until),
            "expires_at": iso(record.expires_at),
            "expired": expired,
            "abandoned": abandoned,
            "request_hash": record.request_hash,
            "response_status": None if response is None else response.status,
            "response_bytes": None if response is None else len(response.body),
        }
        print(json.dumps(payload), file=out)
        return
    state = str(record.status)
    if expired:
        state += " (expired: a new request with this key runs again; awaiting prune)"
    elif abandoned:
        state += " (lease ended: the worker died or hangs; the next retry takes over)"
    elif current is RecordState.RUNNING:
        state += " (running: its lease is live)"
    lines = [
        ("key digest", digest),
        ("status", state),
        ("created", fmt_time(record.created_at, now)),
        *([] if completed else [("lease until", fmt_time(record.locked_until, now))]),
        ("expires", fmt_time(record.expires_at, now)),
        ("fingerprint", record.request_hash),
        (
            "response",
            "-"
            if response is None
            else f"{response.status} ({plural(len(response.body), 'byte')} stored)",
        ),
    ]
    for label, value in lines:
        print(f"{label:<12} {value}", file=out)

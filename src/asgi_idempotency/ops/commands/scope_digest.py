"""``asgi-idempotency scope-digest PRINCIPAL``: the caller digest the audit shows for a caller.

The audit never names a caller: it groups by a digest of (namespace, host, principal).
Given a principal as the app's ``principal=`` returns it (and the host and namespace as
the middleware saw them), this prints that digest, so an operator can tell which
merchant a finding is about (``asgi-idempotency audit`` shows its first 16 digits).
"""

from __future__ import annotations

from typing import TextIO

from asgi_idempotency.ops.commands._common import (
    Exit,
    command,
    host_of,
    namespace_of,
    output,
)

__all__ = ["scope_digest"]


@command("scope-digest")
def scope_digest(
    principal: str,
    *,
    host: str = "",
    x_forwarded_host: str | None = None,
    forwarded: str | None = None,
    namespace: str = "",
    out: TextIO | None = None,
) -> int:
    """Print the 64-hex scope digest of ``principal`` (``""``: the anonymous caller) on
    ``host`` (the Host header, port ignored; plus the forwarded hosts, as ``inspect``
    takes them) in ``namespace``: what the audit's caller column and JSON
    ``caller_digest`` carry for that caller."""
    from asgi_idempotency.core.keys import scope_digest as digest_of

    where = host_of(host, x_forwarded_host, forwarded)
    print(digest_of(principal, where, namespace_of(namespace)), file=output(out))
    return Exit.OK

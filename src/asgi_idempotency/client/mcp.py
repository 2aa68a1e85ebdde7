"""The caller's half for MCP tools: one idempotency key per tool call of a run, in ``_meta``.

An agent framework that retries a failed step re-invokes the model: the retry has a
fresh request id and ``tool_call_id``, and a key the model writes changes exactly
when it must not. The key here comes from the originating run instead, with
:func:`~asgi_idempotency.client.keys.derive_key` over (run id, step, tool, arguments),
so a retry, a step the model regenerated with the same arguments (canonically: ``4500``
and ``4500.0``, keys in any order), and a resumed run all send the same key, while other
arguments (a call corrected after a refusal) and the same arguments in another run (or
another step) do not: they are other calls, and run::

    result = await call_tool(client, "refund", {"order": "o-1", "amount": 5},
                             run_id=run.id, step=run.step)

The server half (:mod:`asgi_idempotency.integrations.mcp`) reads the key from
``_meta`` under :data:`META_KEY`. Needs ``mcp_types`` (the ``mcp`` extra); imports
no module of the server half.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Protocol, cast

from asgi_idempotency._extras import missing_extra
from asgi_idempotency.client.keys import derive_key

try:
    from mcp_types import CallToolResult, RequestParamsMeta
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise missing_extra(__name__, "mcp", "mcp") from exc

__all__ = [
    "ERROR_META",
    "META_KEY",
    "RETRY_AFTER_META",
    "Refusal",
    "ToolCaller",
    "call_tool",
    "refusal",
    "tool_call_meta",
]

#: The ``_meta`` name of the key (the server half's ``META_KEY``; a test keeps them equal).
META_KEY: Final = "io.asgi-idempotency/key"
#: In the ``_meta`` of a result the server's guard answered itself: the reason.
ERROR_META: Final = "io.asgi-idempotency/error"
#: With ``in_progress`` and ``store_unavailable``: seconds after which to retry.
RETRY_AFTER_META: Final = "io.asgi-idempotency/retry-after"


class ToolCaller(Protocol):
    """What sends ``tools/call``: ``mcp.Client`` or ``mcp.ClientSession``."""

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
        *,
        meta: Any = None,
    ) -> CallToolResult: ...


def tool_call_meta(
    run_id: str,
    step: int,
    tool: str,
    arguments: dict[str, Any],
    *,
    meta: dict[str, Any] | None = None,
) -> RequestParamsMeta:
    """The ``_meta`` of one tool call: ``meta`` (if given) and the call's derived key,
    for ``call_tool(..., meta=...)`` of ``mcp.Client`` or ``mcp.ClientSession``.

    Raises what :func:`~asgi_idempotency.client.keys.derive_key` raises.
    """
    # An open map: the key is one of its extra items, which the TypedDict cannot spell.
    return cast(
        RequestParamsMeta, {**(meta or {}), META_KEY: derive_key(run_id, step, tool, arguments)}
    )


async def call_tool(
    session: ToolCaller,
    tool: str,
    arguments: dict[str, Any],
    *,
    run_id: str,
    step: int,
    read_timeout_seconds: float | None = None,
    meta: dict[str, Any] | None = None,
) -> CallToolResult:
    """``session.call_tool(tool, arguments)`` with the key of (``run_id``, ``step``,
    ``tool``, ``arguments``) in its ``_meta``.

    Persist ``run_id`` and ``step`` with the run: a retry of the step, or the run
    resumed after a crash, must send the same pair. ``read_timeout_seconds`` is the
    session's (seconds; default the session's own). What the session raises is raised
    (a timeout as ``mcp.MCPError``): retry the same call, the key is the same.
    """
    return await session.call_tool(
        tool,
        arguments,
        read_timeout_seconds,
        meta=tool_call_meta(run_id, step, tool, arguments, meta=meta),
    )


@dataclass(frozen=True, slots=True)
class Refusal:
    """The server's guard did not run the tool: why, and when a retry may succeed.

    ``reason``: ``missing_key``, ``invalid_key``, ``unidentified``, ``mismatch`` (the key
    was used with other arguments), ``in_progress`` (the first call still runs) or
    ``store_unavailable``. ``retry_after``: seconds, with the last two; else ``None``.
    """

    reason: str
    retry_after: float | None


def refusal(result: CallToolResult) -> Refusal | None:
    """The guard's refusal carried by ``result``, or ``None`` (the tool's own answer)."""
    meta = result.meta or {}
    reason = meta.get(ERROR_META) if result.is_error else None
    if not isinstance(reason, str):
        return None
    after = meta.get(RETRY_AFTER_META)
    return Refusal(reason, float(after) if isinstance(after, int | float) else None)

"""MCP tools run once per idempotency key, the key read from the call's ``_meta``.

MCP has no idempotency field, and an agent framework that retries a failed step
re-invokes the model, so the retry carries a fresh request id and a fresh
``tool_call_id``: neither can be the key. The caller sends one in the ``tools/call``
request's ``_meta`` under :data:`META_KEY`, derived from its run (run id, step, tool,
arguments: :func:`asgi_idempotency.client.mcp.call_tool`); a call without one is
refused, never keyed on its arguments alone (that would swallow a legitimate second
refund of the same amount).

::

    guard = ToolGuard(Once(store), principal=from_access_token)

    @server.tool()
    @guard
    async def refund(order: str, amount: int) -> dict[str, str]: ...

The guard is :class:`~asgi_idempotency.functions.once.Once`: same store, lifecycle, metrics,
traces and log events, one namespace per tool (``mcp.<function name>``). The record
is scoped by the caller (``principal=``), and fingerprinted by the tool and its
validated arguments. A guarded tool runs to its end even when the caller cancels it
(the MCP client sends ``notifications/cancelled`` when its read timeout passes, the
moment it is about to retry), so the retry finds the result stored rather than a half
done effect. The guard's own answers are tool errors (``isError``) whose ``_meta``
names the reason under :data:`ERROR_META` (``missing_key``, ``invalid_key``,
``unidentified``, ``in_progress``, ``mismatch``, ``store_unavailable``) and, where a
retry may succeed, seconds under :data:`RETRY_AFTER_META`.

Needs the ``mcp`` extra.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import orjson

from asgi_idempotency._extras import missing_extra

try:
    import pydantic_core
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
    from mcp.server.auth.provider import principal_components
    from mcp.server.mcpserver import Context
    from mcp.server.mcpserver.utilities.context_injection import find_context_parameter
    from mcp_types import CallToolResult, TextContent
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise missing_extra(__name__, "mcp", "mcp") from exc

# The wire names are the caller's half's: one definition for both ends.
from asgi_idempotency.client.mcp import ERROR_META, META_KEY, RETRY_AFTER_META
from asgi_idempotency.core.errors import InProgress, KeyReused, StoreError
from asgi_idempotency.core.keys import MAX_KEY_LENGTH
from asgi_idempotency.functions.once import Once
from asgi_idempotency.http.principals import ANONYMOUS, PrincipalFunc
from asgi_idempotency.observability.metrics import Outcome

__all__ = [
    "ERROR_META",
    "META_KEY",
    "RETRY_AFTER_META",
    "ToolGuard",
    "from_access_token",
]

# The context parameter added to a tool that declares none (MCPServer fills it by type).
_CONTEXT = "idempotency_context"

F = TypeVar("F", bound=Callable[..., Any])


def from_access_token(scope: Any) -> str | None:
    """The caller as MCP's own auth sees it: the verified bearer token's client id,
    issuer and subject (``mcp.server.auth.provider.principal_components``), never the
    token's bytes, which change on every refresh. ``None`` (refused) without a token."""
    user = scope.get("user") if isinstance(scope, dict) else None
    if not isinstance(user, AuthenticatedUser):
        return None
    return orjson.dumps(list(principal_components(user.access_token))).decode()


def _key_of(key: str, arguments: Any, *, run: Any) -> str:
    return key


def _guarded_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What ``Once`` guards for ``fn``: its run, fingerprinted by its validated arguments
    (as JSON) and named as ``fn`` is, so that traces name the tool's function."""

    async def call(key: str, arguments: Any, *, run: Any) -> Any:
        return await _run(run)

    call.__qualname__, call.__module__ = fn.__qualname__, fn.__module__
    return call


async def _run(run: Callable[[], Any]) -> Any:
    result = await run()
    if type(result).__module__.partition(".")[0] in ("mcp", "mcp_types"):
        # A result or content block would come back from the store as a plain dict and
        # reach the model as JSON text: refuse at the first call, not at the replay.
        raise TypeError(
            f"a guarded tool returns JSON values, dataclasses or pydantic models, "
            f"not {type(result).__name__}"
        )
    # Stored as JSON: the first call and every replay give the same value to MCPServer,
    # which converts and validates it against the tool's output schema alike.
    return pydantic_core.to_jsonable_python(result)


class ToolGuard:
    """Guard MCP tools so that each runs once per idempotency key sent in ``_meta``.

    Args:
        once: the :class:`~asgi_idempotency.functions.once.Once` that runs them: its store,
            ``ttl``, ``lease``, ``wait``, ``retry_after`` and metrics apply. Its own
            ``namespace`` is not used: each tool has ``<prefix>.<function name>``.
        principal: who the caller is, required, as the middleware's: a function of the
            HTTP request's ASGI scope (:func:`from_access_token` for MCP's bearer auth,
            or :mod:`asgi_idempotency.http.principals`' ``from_headers``, ``from_user``,
            ...), or ``ANONYMOUS``. A call it names no caller for (``None``), or that
            came over a transport with no HTTP request (stdio), is refused unless
            ``ANONYMOUS``.
        prefix: the namespaces' prefix (default ``"mcp"``); not starting with ``/``.

    Raises:
        TypeError: ``principal`` is not callable.
    """

    def __init__(self, once: Once, *, principal: PrincipalFunc, prefix: str = "mcp") -> None:
        if not callable(principal):
            raise TypeError(
                "principal= says who the caller is: from_access_token, a function of the "
                "request's scope, or ANONYMOUS"
            )
        self.once = once
        self.principal = principal
        self.prefix = prefix
        self._running: set[asyncio.Task[Any]] = set()

    def __call__(self, fn: F) -> F:
        """Guard ``fn``; put it under ``@server.tool()``. Async or sync (run in a thread)."""
        given = find_context_parameter(fn)
        signature = inspect.signature(fn, eval_str=True)
        namespace = f"{self.prefix}.{fn.__name__}"
        once = self.once(key=_key_of, namespace=namespace, exclude=("key", "run"))
        guarded = once(_guarded_call(fn))
        is_async = inspect.iscoroutinefunction(fn)

        @functools.wraps(fn)
        async def tool(**kwargs: Any) -> Any:
            ctx = kwargs[given] if given is not None else kwargs.pop(_CONTEXT)
            arguments = {k: v for k, v in kwargs.items() if k != given}
            scoped = await self._key(ctx, namespace)
            if isinstance(scoped, CallToolResult):
                return scoped
            if is_async:
                run = functools.partial(fn, **kwargs)
            else:
                run = functools.partial(asyncio.to_thread, fn, **kwargs)
            jsonable = pydantic_core.to_jsonable_python(arguments)
            task = asyncio.ensure_future(guarded(scoped, jsonable, run=run))
            self._running.add(task)
            task.add_done_callback(self._settled)
            try:
                # Shielded: a cancelled call (the client's read timeout) leaves the tool
                # running to its end, its result stored for the retry that follows.
                return await asyncio.shield(task)
            except InProgress as exc:
                return _refusal(
                    Outcome.IN_PROGRESS,
                    "Not run: a call with this idempotency key is still running; retry "
                    f"with the same key in {exc.retry_after:.3g} s.",
                    exc.retry_after,
                )
            except KeyReused:
                return _refusal(
                    Outcome.MISMATCH,
                    "Not run: this idempotency key was used for another call of this "
                    "tool (other arguments); derive a new key for a new call.",
                )
            except StoreError:
                return _refusal(
                    Outcome.STORE_UNAVAILABLE,
                    "Not run: the idempotency store is unavailable; retry with the same "
                    "idempotency key.",
                    self.once.retry_after,
                )

        if given is None:
            parameters = list(signature.parameters.values())
            at = next(
                (i for i, p in enumerate(parameters) if p.kind is p.VAR_KEYWORD), len(parameters)
            )
            parameters.insert(at, inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY))
            parameters[at] = parameters[at].replace(annotation=Context)
            signature = signature.replace(parameters=parameters)
            tool.__annotations__ = {**fn.__annotations__, _CONTEXT: Context}
        tool.__signature__ = signature  # type: ignore[attr-defined]
        return tool  # type: ignore[return-value]

    async def _key(self, ctx: Context[Any, Any], namespace: str) -> str | CallToolResult:
        """The Once key (caller and client key), or the refusal of a call without one."""
        request = ctx.request_context
        # An open map on the wire: ours is one of its extra items.
        meta: Mapping[str, Any] = request.meta or {}
        if META_KEY not in meta:
            self.once.count(namespace, Outcome.MISSING_KEY)
            return _refusal(
                Outcome.MISSING_KEY,
                f"Not run: this tool needs an idempotency key in the request's "
                f"_meta[{META_KEY!r}], derived from the run, step, tool and arguments "
                "(the same for every retry of the call, never per attempt).",
            )
        key = meta[META_KEY]
        if not _valid(key):
            self.once.count(namespace, Outcome.INVALID_KEY)
            return _refusal(
                Outcome.INVALID_KEY,
                f"Not run: _meta[{META_KEY!r}] must be a string of 1 to {MAX_KEY_LENGTH} "
                "printable ASCII characters.",
            )
        principal = await self._principal(request.request)
        if principal is None:
            self.once.count(namespace, Outcome.UNIDENTIFIED)
            return _refusal(
                Outcome.UNIDENTIFIED,
                "Not run: the caller is not identified, so its idempotency key cannot be "
                "told apart from another caller's; authenticate.",
            )
        # Length-prefixed, so that no (principal, key) pair spells another's.
        return f"{len(principal)}:{principal}\x00{key}"

    async def _principal(self, request: Any) -> str | None:
        scope = getattr(request, "scope", None)
        if scope is None:
            # No HTTP request (stdio, in memory): nobody to ask but the app's word.
            return "" if self.principal is ANONYMOUS else None
        named = self.principal(scope)
        if inspect.isawaitable(named):
            named = await named
        return named

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        # A call whose caller had gone: its error (already logged or counted by Once)
        # has nobody left to receive it.
        if not task.cancelled():
            task.exception()


def _valid(key: object) -> bool:
    return (
        isinstance(key, str)
        and 0 < len(key) <= MAX_KEY_LENGTH
        and key.isascii()
        and key.isprintable()
    )


def _refusal(outcome: Outcome, text: str, retry_after: float | None = None) -> CallToolResult:
    meta: dict[str, Any] = {ERROR_META: outcome.value}
    if retry_after is not None:
        meta[RETRY_AFTER_META] = retry_after
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True, _meta=meta)

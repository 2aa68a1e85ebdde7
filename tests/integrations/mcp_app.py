"""The MCP server of tests/integrations/test_mcp.py's multi-process test.

For ``uvicorn tests.integrations.mcp_app:app``.

Each process serves a guarded ``charge`` tool on the Postgres store named by
``IDEMPOTENCY_DATABASE_URL`` and appends one line per effect, with its pid, to the
file named by ``MCP_EFFECTS``: the effects of every process, counted in one place.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

from mcp.server.mcpserver import MCPServer

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.integrations.mcp import ToolGuard

store = SQLStore(os.environ["IDEMPOTENCY_DATABASE_URL"])
once = Once(store, lease=timedelta(seconds=5), retry_after=0.2)
guard = ToolGuard(once, principal=ANONYMOUS)
server = MCPServer("billing", log_level="WARNING")
SLOW = float(os.environ.get("MCP_SLOW", "2.5"))


def _record(order: str) -> None:
    # One short O_APPEND write per effect: lines from several processes never interleave.
    fd = os.open(os.environ["MCP_EFFECTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{order} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


@server.tool()
@guard
async def charge(order: str, amount: int) -> dict[str, Any]:
    """Charge a card: the charge goes out at once, its confirmation takes a while."""
    _record(order)
    await asyncio.sleep(SLOW)
    return {"order": order, "amount": amount, "pid": os.getpid()}


# Stateless: each request stands alone, so any process may answer any of them.
app = server.streamable_http_app(stateless_http=True)

"""An MCP tool that refunds once per step of an agent's run, however the agent retries.

The server is an MCPServer over streamable HTTP (uvicorn, on a loopback port) whose
``refund`` tool is guarded per idempotency key; the agent derives each call's key
from its run id, the step, the tool and the arguments, and sends it in ``_meta``.
The payment provider is slow: the agent's first attempt times out, its retries (same
key) are told the first still runs, then get its result. The plan refunds the same
amount twice, at two steps, and both are issued: a key from the arguments alone
would have swallowed the second. Run it again and the run resumes under the same
run id: every step replays, nothing is issued.

    python -m examples.mcp_tools
"""

import asyncio
import os
import socket
from typing import Any

import uvicorn
from mcp import Client, MCPError
from mcp.server.mcpserver import MCPServer
from mcp_types import CallToolResult

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.client.mcp import call_tool, refusal
from asgi_idempotency.integrations.mcp import ToolGuard
from asgi_idempotency.principals import ANONYMOUS

store = SQLStore(os.environ.get("IDEMPOTENCY_DATABASE_URL", "sqlite+aiosqlite:///./mcp.db"))
# ANONYMOUS: one agent calls this server. Behind MCP's bearer auth, from_access_token.
guard = ToolGuard(Once(store), principal=ANONYMOUS)
server = MCPServer("billing", log_level="WARNING")
issued: list[str] = []  # stands in for the payment provider's ledger


@server.tool()
@guard
async def refund(order: str, amount_p: int) -> dict[str, Any]:
    """Refund part of an order, in pence."""
    issued.append(order)
    await asyncio.sleep(1.5)  # the provider confirms slowly: longer than the agent waits
    return {"refund_id": f"rf-{order}-{len(issued)}", "amount_p": amount_p}


app = server.streamable_http_app()

# The agent's run: persisted with its run id, so that a resumed run sends the same keys.
RUN_ID = "run-42"
PLAN = [
    ("refund", {"order": "A-88214", "amount_p": 4500}),
    ("refund", {"order": "A-88214", "amount_p": 4500}),  # a second refund, on purpose
]


async def step(client: Client, number: int) -> CallToolResult:
    """One step, retried as an agent framework retries: the same key every time."""
    tool, args = PLAN[number]
    for _ in range(20):
        try:
            result = await call_tool(
                client, tool, args, run_id=RUN_ID, step=number, read_timeout_seconds=1.0
            )
        except MCPError:
            continue  # timed out: the tool runs on, the retry gets its answer
        refused = refusal(result)
        if refused is None:
            return result
        if refused.reason != "in_progress":
            raise RuntimeError(f"step {number} refused: {refused.reason}")
        await asyncio.sleep(refused.retry_after or 1.0)
    raise RuntimeError(f"step {number} did not finish")


async def main() -> list[str]:
    await store.create_all()  # development; `asgi-idempotency migrate` in production
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    web = uvicorn.Server(config)
    serving = asyncio.create_task(web.serve(sockets=[sock]))
    while not web.started:  # noqa: ASYNC110 - uvicorn sets a flag, not an event
        await asyncio.sleep(0.05)
    try:
        async with Client(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp") as client:
            for number in range(len(PLAN)):
                result = await step(client, number)
                print(f"step {number}: {result.structured_content}")
    finally:
        web.should_exit = True
        await serving
        sock.close()
        await store.close()
    print(f"refunds issued: {issued}")
    return issued


if __name__ == "__main__":
    asyncio.run(main())

"""MCP tools, both halves, over the real thing: an MCPServer served by uvicorn on a
loopback port (streamable HTTP), called by the MCP SDK's own client.

The effect is counted on the server. What an agent framework does is played by the
test: a call retried after its read timeout, a step the model regenerated (a fresh
request id, the same run, step and arguments), the same arguments in another run, a
run resumed after a crash.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from mcp import Client, MCPError
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, RequestParamsMeta
from pydantic import AnyHttpUrl

from asgi_idempotency import MemoryStore, Once, Outcome
from asgi_idempotency.client import derive_key
from asgi_idempotency.client import mcp as client_mcp
from asgi_idempotency.client.mcp import call_tool, refusal, tool_call_meta
from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.http.principals import ANONYMOUS, PrincipalFunc, from_headers
from asgi_idempotency.integrations import mcp as server_mcp
from asgi_idempotency.integrations.mcp import META_KEY, ToolGuard, from_access_token
from asgi_idempotency.ops._serve import serve_in_thread
from asgi_idempotency.stores.base import NewClaim, Record
from tests.helpers._blocking import run_without
from tests.helpers.serving import run_uvicorn

pytestmark = pytest.mark.anyio

# The slow tool outlasts the client's read timeout by a wide margin (a shared machine).
READ_TIMEOUT = 0.5
SLOW = 2.5


@dataclass
class Served:
    url: str
    once: Once
    effects: list[tuple[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, tool: str) -> int:
        with self.lock:
            return sum(1 for name, _ in self.effects if name == tool)


@contextmanager
def served(
    principal: PrincipalFunc = ANONYMOUS, lease: float = 5.0, **server_options: Any
) -> Iterator[Served]:
    """An MCPServer with guarded tools under uvicorn, in a thread of this process."""
    once = Once(MemoryStore(), lease=timedelta(seconds=lease), retry_after=0.2)
    guard = ToolGuard(once, principal=principal)
    server = MCPServer("billing", **server_options)
    state = Served("", once)

    def effect(tool: str, what: Any) -> int:
        with state.lock:
            state.effects.append((tool, what))
            return len(state.effects)

    @server.tool()
    @guard
    async def refund(order: str, amount: int) -> dict[str, Any]:
        """Refund part of an order."""
        return {"order": order, "amount": amount, "refund": effect("refund", (order, amount))}

    @server.tool()
    @guard
    async def charge(order: str, amount: int, ctx: Context) -> dict[str, Any]:
        """Charge a card: the charge goes out at once, its confirmation takes a while."""
        number = effect("charge", (order, amount))
        await asyncio.sleep(SLOW)
        return {"order": order, "charge": number, "request": ctx.request_id}

    @server.tool()
    @guard
    def ship(order: str) -> str:
        """Ship an order (a synchronous tool: run in a thread)."""
        return f"shipment {effect('ship', order)}"

    with serve_in_thread(server.streamable_http_app(), lifespan="on") as url:
        state.url = url + "/mcp"
        yield state


def _text(result: CallToolResult) -> str:
    block = result.content[0]
    assert block.type == "text"
    return block.text


async def test_a_call_retried_after_its_read_timeout_runs_once() -> None:
    with served() as server:
        async with Client(server.url) as client:
            args = {"order": "o-1", "amount": 5}
            with pytest.raises(MCPError, match="timed out"):
                await call_tool(
                    client, "charge", args, run_id="run-1", step=0,
                    read_timeout_seconds=READ_TIMEOUT,
                )  # fmt: skip
            # The client sent notifications/cancelled; the tool runs on regardless.
            first = await call_tool(client, "charge", args, run_id="run-1", step=0)
            seen = refusal(first)
            assert seen is not None, _text(first)
            assert seen.reason == "in_progress"
            assert seen.retry_after is not None
            assert 0 < seen.retry_after <= 5
            deadline = time.monotonic() + 30
            while (answer := refusal(first)) is not None:
                assert answer.reason == "in_progress"
                assert time.monotonic() < deadline, "the first call never completed"
                await asyncio.sleep(answer.retry_after or 0.2)
                first = await call_tool(client, "charge", args, run_id="run-1", step=0)
            assert not first.is_error
            result = first.structured_content
            assert result is not None
            assert result["charge"] == 1
            # Later retries get the same stored answer: the first call's request id.
            again = await call_tool(client, "charge", args, run_id="run-1", step=0)
            assert again.structured_content == result
        assert server.count("charge") == 1
        counts = server.once.snapshot().counts
        assert counts[("mcp.charge", Outcome.EXECUTED)] == 1
        assert counts[("mcp.charge", Outcome.IN_PROGRESS)] >= 1
        assert counts[("mcp.charge", Outcome.REPLAYED)] >= 2


async def test_a_regenerated_step_replays_and_another_run_runs_again() -> None:
    args = {"order": "o-2", "amount": 7}
    with served() as server:
        async with Client(server.url) as client:
            first = await call_tool(client, "refund", args, run_id="run-1", step=3)
        # The model regenerated the step: a new request (new id, new tool_call_id), over
        # a new connection even; the run, step and arguments are the same.
        async with Client(server.url) as client:
            regenerated = await call_tool(client, "refund", dict(args), run_id="run-1", step=3)
            assert regenerated.structured_content == first.structured_content
            assert server.count("refund") == 1
            # The same arguments in another run are another refund.
            other = await call_tool(client, "refund", args, run_id="run-2", step=3)
            assert not other.is_error
            assert other.structured_content == {**args, "refund": 2}
            # And so is the next step of the same run.
            await call_tool(client, "refund", args, run_id="run-1", step=4)
        assert server.count("refund") == 3


async def test_a_resumed_run_reproduces_its_keys_and_replays_what_ran() -> None:
    plan: list[tuple[str, dict[str, Any]]] = [
        ("refund", {"order": "o-3", "amount": 1}),
        ("ship", {"order": "o-3"}),
        ("refund", {"order": "o-3", "amount": 1}),  # a second, legitimate refund
    ]
    sent: list[str] = []

    async def agent(url: str, run_id: str, start: int, stop: int) -> list[Any]:
        """A run of ``plan[start:stop]``; its state (run id, step) persisted by the caller."""
        results = []
        async with Client(url) as client:
            for step in range(start, stop):
                tool, args = plan[step]
                meta: dict[str, Any] = dict(tool_call_meta(run_id, step, tool, args))
                sent.append(meta[META_KEY])
                result = await call_tool(client, tool, args, run_id=run_id, step=step)
                assert refusal(result) is None, _text(result)
                results.append(result.structured_content)
        return results

    with served() as server:
        # The agent crashed after the server ran step 1, before the run recorded it.
        before = await agent(server.url, "run-7", 0, 2)
        resumed = await agent(server.url, "run-7", 1, 3)
        assert resumed[0] == before[1]  # step 1 replayed, not shipped twice
        assert server.count("ship") == 1
        assert server.count("refund") == 2  # steps 0 and 2: same arguments, two steps
    assert sent[1] == sent[2]
    assert len(set(sent)) == 3
    assert sent[0] == derive_key("run-7", 0, "refund", plan[0][1])


async def test_a_call_without_a_key_is_refused_naming_the_field() -> None:
    with served() as server:
        async with Client(server.url) as client:
            result = await client.call_tool("refund", {"order": "o-4", "amount": 1})
            seen = refusal(result)
            assert seen is not None
            assert seen.reason == "missing_key"
            assert META_KEY in _text(result)
            bad = await client.call_tool(
                "refund",
                {"order": "o-4", "amount": 1},
                meta=cast(RequestParamsMeta, {META_KEY: "é" * 3}),
            )
            assert refusal(bad) == client_mcp.Refusal("invalid_key", None)
            # A key reused with other arguments is refused, not run.
            await call_tool(client, "refund", {"order": "o-4", "amount": 1}, run_id="r", step=0)
            reused = await client.call_tool(
                "refund",
                {"order": "o-4", "amount": 2},
                meta=tool_call_meta("r", 0, "refund", {"order": "o-4", "amount": 1}),
            )
            assert refusal(reused) == client_mcp.Refusal("mismatch", None)
        assert server.count("refund") == 1
        counts = server.once.snapshot().counts
        assert counts[("mcp.refund", Outcome.MISSING_KEY)] == 1
        assert counts[("mcp.refund", Outcome.INVALID_KEY)] == 1
        assert counts[("mcp.refund", Outcome.MISMATCH)] == 1


async def test_the_caller_scopes_the_key() -> None:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    with served(principal=from_headers("X-Caller")) as server:
        args = {"order": "o-5", "amount": 3}
        answers = []
        for name in ("alice", "bob", "alice", None):
            headers = {} if name is None else {"x-caller": name}
            async with httpx2.AsyncClient(headers=headers) as http:
                transport = streamable_http_client(server.url, http_client=http)
                async with Client(transport) as client:
                    answers.append(await call_tool(client, "refund", args, run_id="r", step=0))
        assert [a.structured_content for a in answers[:3]] == [
            {**args, "refund": 1}, {**args, "refund": 2}, {**args, "refund": 1},
        ]  # fmt: skip
        assert refusal(answers[3]) == client_mcp.Refusal("unidentified", None)
        assert server.count("refund") == 2


class _Tokens:
    """A token verifier: each token names its client and subject (a refreshed token is
    new bytes for the same subject)."""

    async def verify_token(self, token: str) -> AccessToken | None:
        subject = {"alice-1": "alice", "alice-2": "alice", "bob-1": "bob"}.get(token)
        if subject is None:
            return None
        return AccessToken(token=token, client_id="agent", scopes=[], subject=subject)


async def test_mcp_bearer_auth_names_the_caller_and_a_refreshed_token_is_the_same_caller() -> None:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    auth = AuthSettings(
        issuer_url=AnyHttpUrl("https://auth.example"),
        resource_server_url=None,
        validate_token_resource=False,
    )
    with served(from_access_token, token_verifier=_Tokens(), auth=auth) as server:
        args = {"order": "o-6", "amount": 4}
        answers = []
        for token in ("alice-1", "alice-2", "bob-1"):
            headers = {"authorization": f"Bearer {token}"}
            async with httpx2.AsyncClient(headers=headers) as http:
                transport = streamable_http_client(server.url, http_client=http)
                async with Client(transport) as client:
                    answers.append(await call_tool(client, "refund", args, run_id="r", step=0))
        assert [a.structured_content for a in answers] == [
            {**args, "refund": 1}, {**args, "refund": 1}, {**args, "refund": 2},
        ]  # fmt: skip
        assert server.count("refund") == 2


@pytest.mark.slow
@pytest.mark.postgres
async def test_a_retry_that_reaches_another_server_process_gets_the_first_ones_result(
    pg_url: str, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.log"
    effects.touch()
    env = {"IDEMPOTENCY_DATABASE_URL": pg_url, "MCP_EFFECTS": str(effects)}
    args, run_id = {"order": "o-9", "amount": 9}, uuid.uuid4().hex
    with (
        run_uvicorn("tests.integrations.mcp_app:app", env=env, log_dir=tmp_path) as a,
        run_uvicorn("tests.integrations.mcp_app:app", env=env, log_dir=tmp_path) as b,
    ):
        async with Client(a.base_url + "/mcp") as client:
            with pytest.raises(MCPError, match="timed out"):
                await call_tool(
                    client, "charge", args, run_id=run_id, step=0,
                    read_timeout_seconds=READ_TIMEOUT,
                )  # fmt: skip
        # The framework's retry reaches the other process (a load balancer's choice).
        async with Client(b.base_url + "/mcp") as client:
            answer = await call_tool(client, "charge", args, run_id=run_id, step=0)
            seen = refusal(answer)
            assert seen is not None, _text(answer)
            assert seen.reason == "in_progress"
            deadline = time.monotonic() + 30
            while (seen := refusal(answer)) is not None:
                assert seen.reason == "in_progress"
                assert time.monotonic() < deadline, "the first call never completed"
                await asyncio.sleep(seen.retry_after or 0.2)
                answer = await call_tool(client, "charge", args, run_id=run_id, step=0)
        assert answer.structured_content == {**args, "pid": a.process.pid}
    assert effects.read_text().splitlines() == [f"o-9 {a.process.pid}"]


def test_both_halves_spell_the_meta_names_alike() -> None:
    assert client_mcp.META_KEY == server_mcp.META_KEY
    assert client_mcp.ERROR_META == server_mcp.ERROR_META
    assert client_mcp.RETRY_AFTER_META == server_mcp.RETRY_AFTER_META


def test_the_client_half_imports_no_server_code() -> None:
    done = run_without(
        "starlette,sqlalchemy,mcp",
        "import asgi_idempotency.client.mcp\n"
        "leaked = sorted(m for m in sys.modules if m.startswith("
        "('asgi_idempotency.integrations', 'asgi_idempotency.functions.once',"
        " 'starlette', 'mcp.')))\n"
        "assert not leaked, leaked\n",
    )
    assert done.returncode == 0, done.stderr


async def test_without_an_http_request_only_anonymous_names_the_caller() -> None:
    # In memory (as over stdio) there are no headers to ask: the guard does not guess.
    for principal, reason in ((from_headers("X-Caller"), "unidentified"), (ANONYMOUS, None)):
        server = MCPServer("billing")
        guard = ToolGuard(Once(MemoryStore()), principal=principal)

        @server.tool()
        @guard
        async def refund(order: str) -> str:
            return order

        async with Client(server) as client:
            result = await call_tool(client, "refund", {"order": "o-8"}, run_id="r", step=0)
        seen = refusal(result)
        assert (seen and seen.reason) == reason


@pytest.mark.parametrize(
    "module", ["asgi_idempotency.integrations.mcp", "asgi_idempotency.client.mcp"]
)
def test_without_the_extra_the_import_names_it(module: str) -> None:
    done = run_without("mcp,mcp_types", f"import {module}\n")
    assert done.returncode != 0
    assert "pip install 'asgi-idempotency[mcp]'" in done.stderr


async def test_a_guarded_tool_call_is_traced_and_counted_as_any_once_call() -> None:
    from tests.observability.otel_memory import attributes, in_memory_exporter

    exporter = in_memory_exporter()
    server = MCPServer("billing")
    once = Once(MemoryStore())

    @server.tool()
    @ToolGuard(once, principal=ANONYMOUS)
    async def refund(order: str) -> str:
        return order

    async with Client(server) as client:
        for _ in range(2):
            await call_tool(client, "refund", {"order": "o-10"}, run_id="r", step=0)
    spans = [s for s in exporter.get_finished_spans() if s.name == "once mcp.refund"]
    assert [attributes(s)["idempotency.outcome"] for s in spans] == ["executed", "replayed"]
    assert attributes(spans[0])["code.function.name"].endswith("refund")
    assert once.snapshot().counts == {
        ("mcp.refund", Outcome.EXECUTED): 1,
        ("mcp.refund", Outcome.REPLAYED): 1,
    }


async def test_a_failed_tool_is_released_and_a_store_down_is_refused_unrun() -> None:
    class Flaky(MemoryStore):
        down = False

        async def insert(self, new: NewClaim) -> Record | None:
            if self.down:
                raise StoreError("the database did not answer")
            return await super().insert(new)

    store, runs = Flaky(), []
    server = MCPServer("billing")

    @server.tool()
    @ToolGuard(Once(store, retry_after=0.5), principal=ANONYMOUS)
    async def refund(order: str) -> str:
        runs.append(order)
        if len(runs) == 1:
            raise RuntimeError("the provider failed")
        return order

    async with Client(server) as client:
        failed = await call_tool(client, "refund", {"order": "o-11"}, run_id="r", step=0)
        assert failed.is_error
        assert refusal(failed) is None  # the tool's own error, not the guard's
        retried = await call_tool(client, "refund", {"order": "o-11"}, run_id="r", step=0)
        assert not retried.is_error  # released: the retry ran it again
        store.down = True
        down = await call_tool(client, "refund", {"order": "o-12"}, run_id="r", step=1)
        assert refusal(down) == client_mcp.Refusal("store_unavailable", 0.5)
    assert runs == ["o-11", "o-11"]

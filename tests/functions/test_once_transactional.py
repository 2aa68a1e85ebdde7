"""Transactional ``Once``: the function's database writes commit with its record, or roll
back with its claim, so a consumer killed after its effect runs it once in all."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from asgi_idempotency import MemoryStore, Once, SQLStore
from asgi_idempotency.functions.once import InProgress, KeyReused
from asgi_idempotency.ops.demo import refunds
from tests.functions.once_tx_holder import handler
from tests.integrations.test_transactional import record_rows, refund_rows
from tests.project.docs_text import ROOT

pytestmark = [pytest.mark.anyio]


class ProviderDown(Exception):
    pass


def refunder(once: Once, ran: list[str], fail: list[bool]) -> Any:
    @once(key=lambda msg: msg["id"], transactional=True)
    async def handle(msg: dict[str, Any], *, session: AsyncSession) -> dict[str, Any]:
        ran.append(msg["id"])
        await session.execute(
            insert(refunds).values(id=f"{msg['id']}-{len(ran)}", order_id="1", amount=msg["amount"])
        )
        if fail and fail.pop(0):
            raise ProviderDown(msg["id"])
        return {"refund": msg["id"], "amount": msg["amount"]}

    return handle


async def test_the_write_commits_with_the_record_and_a_replay_does_not_run(
    tx_store: SQLStore,
) -> None:
    ran: list[str] = []
    handle = refunder(Once(tx_store), ran, [])
    first = await handle({"id": "m1", "amount": 5})
    again = await handle({"id": "m1", "amount": 5})
    assert first == again == {"refund": "m1", "amount": 5}
    assert ran == ["m1"]
    assert await refund_rows(tx_store) == 1
    assert [r.status for r in await record_rows(tx_store)] == ["completed"]
    with pytest.raises(KeyReused):
        await handle({"id": "m1", "amount": 6})
    assert ran == ["m1"]


async def test_a_raise_rolls_back_releases_and_reraises_unchanged(tx_store: SQLStore) -> None:
    ran: list[str] = []
    handle = refunder(Once(tx_store), ran, [True])
    with pytest.raises(ProviderDown) as raised:
        await handle({"id": "m2", "amount": 5})
    assert raised.value.args == ("m2",)
    assert await refund_rows(tx_store) == 0
    assert await record_rows(tx_store) == []
    assert await handle({"id": "m2", "amount": 5}) == {"refund": "m2", "amount": 5}
    assert ran == ["m2", "m2"]
    assert await refund_rows(tx_store) == 1


async def test_once_call_runs_in_a_transaction_too(tx_store: SQLStore) -> None:
    once = Once(tx_store, namespace="calls")
    ran: list[str] = []

    async def refund(order: str, *, session: AsyncSession) -> str:
        ran.append(order)
        await session.execute(insert(refunds).values(id=order, order_id=order, amount=1))
        return order

    assert await once.call("k", refund, "A-1", transactional=True) == "A-1"  # type: ignore[call-arg]
    assert await once.call("k", refund, "A-1", transactional=True) == "A-1"  # type: ignore[call-arg]
    assert ran == ["A-1"]
    assert await refund_rows(tx_store) == 1


async def test_refused_on_a_store_without_transactions(tmp_path: Path) -> None:
    sqlite = SQLStore(f"sqlite+aiosqlite:///{tmp_path / 'r.db'}")
    ran: list[str] = []
    for store in (MemoryStore(), sqlite):
        with pytest.raises(ValueError, match="transactional=True needs a store with transactions"):
            refunder(Once(store), ran, [])

        async def refund(order: str, *, session: AsyncSession) -> str:
            ran.append(order)
            return order

        with pytest.raises(ValueError, match="transactional"):
            await Once(store).call("k", refund, "A-1", transactional=True)  # type: ignore[call-arg]
    assert ran == []
    await sqlite.close()


def test_refused_for_a_function_without_session_or_not_async(tx_url: str) -> None:
    once = Once(SQLStore(tx_url))
    with pytest.raises(TypeError, match="session"):

        @once(key=lambda order: order, transactional=True)
        async def no_session(order: str) -> str:
            return order

    with pytest.raises(TypeError, match="async"):

        @once(key=lambda order: order, transactional=True)  # type: ignore[arg-type]
        def not_async(order: str, *, session: Any) -> str:
            return order


@pytest.mark.slow
async def test_a_consumer_killed_after_its_write_leaves_nothing_and_the_redelivery_runs_once(
    tx_url: str, tx_store: SQLStore
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.functions.once_tx_holder", tx_url,
        stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.strip() == b"written"
        assert await refund_rows(tx_store) == 0  # written, not committed
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    # The redelivery: no lease to wait out, the claim died with the transaction. The
    # server may take a moment to see the connection gone and roll it back.
    once = Once(tx_store)
    handle = handler(once, hang=False)
    began = time.monotonic()
    while True:
        try:
            result = await handle({"id": "m-1"})
            break
        except InProgress:  # while the server has not yet seen the connection gone
            assert time.monotonic() - began < 5
            await asyncio.sleep(0.05)
    assert result == {"refund": "m-1"}
    assert await refund_rows(tx_store) == 1
    assert await handle({"id": "m-1"}) == {"refund": "m-1"}
    assert await refund_rows(tx_store) == 1


def test_the_docs_example_runs_on_a_migrated_database(pg_url: str, tmp_path: Path) -> None:
    """docs/guide/once.md's transactional block, on the test server's migrated database."""
    text = (ROOT / "docs" / "guide" / "once.md").read_text(encoding="utf-8")
    section = text[text.index("## Transactional functions") :]
    block = section[section.index("```python\n") + 10 : section.index("```\n", 10)]
    url = "postgresql+asyncpg://postgres@127.0.0.1/shop"
    assert url in block
    script = tmp_path / "consumer.py"
    script.write_text(block.replace(url, pg_url), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


async def test_refused_on_redis(rstore: Any) -> None:
    """Redis keeps no transactions of the database kind: refused when decorating, and at
    the call, naming transactional mode; the function never runs."""
    ran: list[str] = []
    with pytest.raises(ValueError, match="transactional=True needs a store with transactions"):
        refunder(Once(rstore), ran, [])

    async def refund(order: str, *, session: AsyncSession) -> str:
        ran.append(order)
        return order

    with pytest.raises(ValueError, match="transactional"):
        await Once(rstore).call("k", refund, "A-1", transactional=True)  # type: ignore[call-arg]
    assert ran == []

"""What a test consumer's handler does, chosen by its environment (shared by the brokers).

``BEHAVE``: ``effect`` (default: records one effect), ``block`` (records ``started``, by
its process id, and hangs, to be killed), ``block_first`` (as ``block`` on the run's
first call, as ``effect`` after), ``slow`` (records ``started``, runs on until the process gets
SIGUSR1, then records its effect), ``fail`` (records an ``attempt`` and raises).
``CRASH=before_ack``: the consumer SIGKILLs itself where it would acknowledge;
``CRASH=after_write``: in transactional mode (``TRANSACTIONAL=1``, :func:`behave_in`),
right after its effect is written through the session, before it commits.
``DEAD_LETTER=none``: the guard is given no ``on_exhausted``. Every handler first
decodes its message's body as JSON (:func:`decode`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

from sqlalchemy import text

from asgi_idempotency import Undecodable
from tests.brokers.effects import counted, record

ENV = os.environ
DB, NAME = ENV["DATABASE_URL"], ENV["NAME"]
BEHAVE = ENV.get("BEHAVE", "effect")
CRASH = ENV.get("CRASH", "")
GO = asyncio.Event()  # set by SIGUSR1: a slow handler's downstream call returns


def listen() -> None:
    """On the running loop: SIGUSR1 lets a slow handler finish."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, GO.set)


def crash_before_ack() -> None:
    """A real SIGKILL of this process, where ``CRASH=before_ack`` asks for one."""
    if CRASH == "before_ack":
        os.kill(os.getpid(), signal.SIGKILL)


async def behave(run: str) -> str:
    if BEHAVE == "block" or (BEHAVE == "block_first" and "started" not in await counted(DB, run)):
        await record(DB, run, "started", str(os.getpid()))  # the process to kill
        await asyncio.Event().wait()  # a slow downstream call: killed meanwhile
    if BEHAVE == "slow":
        await record(DB, run, "started", NAME)
        await GO.wait()
    if BEHAVE == "fail":
        await record(DB, run, "attempt", NAME)
        raise RuntimeError("the downstream refused")
    await record(DB, run, "effect", NAME)
    return NAME


def transactional() -> bool:
    """Whether the guard runs in transactional mode (``TRANSACTIONAL=1``)."""
    return ENV.get("TRANSACTIONAL", "") == "1"


async def behave_in(session: Any, run: str) -> str:
    """The effect written through the guard's session: it commits with the record."""
    await session.execute(
        text("INSERT INTO broker_effects (run, kind, consumer) VALUES (:run, 'effect', :name)"),
        {"run": run, "name": NAME},
    )
    await session.flush()  # on the server now, not yet committed
    if CRASH == "after_write":
        os.kill(os.getpid(), signal.SIGKILL)
    return NAME


def decode(body: bytes) -> Any:
    """The body as JSON; :class:`Undecodable` if it is not (no retry can change that)."""
    try:
        return json.loads(body)
    except ValueError as exc:
        raise Undecodable("the body is not JSON") from exc


def handing_off() -> bool:
    """Whether the guard gets an ``on_exhausted`` (``DEAD_LETTER=none``: not)."""
    return ENV.get("DEAD_LETTER", "") != "none"


async def dead_letter(run: str, error: BaseException) -> None:
    """The hand-off: an ``exhausted`` row, its consumer column ``NAME:ErrorType``."""
    await record(DB, run, "exhausted", f"{NAME}:{type(error).__name__}")

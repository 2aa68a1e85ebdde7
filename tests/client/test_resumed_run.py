"""A crashed agent run, resumed from disk, repeats its first four calls as replays.

Server: the real middleware with a SQLite store, on loopback. Agent: ``_agent.py``
in a fresh process per run, so nothing but the JSON state file survives the crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from asgi_idempotency.ops._serve import serve_in_thread
from tests.client._apps import guarded_app

AGENT = Path(__file__).with_name("_agent.py")
SRC = Path(__file__).parents[2] / "src"


def _agent(
    state: Path, url: str, effects: Path, *extra: str, expect_rc: int = 0
) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(AGENT), str(state), url, str(effects), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert done.returncode == expect_rc, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_resumed_run_replays_steps_one_to_four(tmp_path: Path) -> None:
    state, effects = tmp_path / "run.json", tmp_path / "effects.log"
    effects.touch()
    guarded = guarded_app(tmp_path / "idempotency.db", effects_file=effects)
    with serve_in_thread(guarded.app, lifespan="on") as url:
        crashed = _agent(state, url, effects, "--crash-after", "4", expect_rc=70)
        persisted = json.loads(state.read_text())
        resumed = _agent(state, url, effects)

    assert [s["effects"] for s in crashed] == [1, 2, 3, 4]
    assert persisted["steps_done"] == 4
    # Same run id, same step numbers, same arguments: the same keys.
    assert [s["key"] for s in resumed[:4]] == [s["key"] for s in crashed]
    assert [s["replayed"] for s in resumed] == [True] * 4 + [False] * 3
    assert [s["effects"] for s in resumed] == [4, 4, 4, 4, 5, 6, 7]
    assert len(effects.read_text().splitlines()) == 7
    assert len(guarded.effects) == 7


def test_renumbering_steps_on_resume_duplicates_visibly(tmp_path: Path) -> None:
    state, effects = tmp_path / "run.json", tmp_path / "effects.log"
    effects.touch()
    guarded = guarded_app(tmp_path / "idempotency.db", effects_file=effects)
    with serve_in_thread(guarded.app, lifespan="on") as url:
        crashed = _agent(state, url, effects, "--crash-after", "4", expect_rc=70)
        resumed = _agent(state, url, effects, "--renumber")

    # Steps 1-4 ran again under steps 5-8's numbers: new keys, new effects.
    assert not {s["key"] for s in resumed[:4]} & {s["key"] for s in crashed}
    assert not any(s["replayed"] for s in resumed)
    assert [s["effects"] for s in resumed] == [5, 6, 7, 8, 9, 10, 11]
    assert len(effects.read_text().splitlines()) == 11  # four duplicates

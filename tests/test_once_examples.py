"""The function guard's examples run as printed (``python -m examples.<name>``).

Each runs twice in a fresh directory on its SQLite default: the first run does the
work once for all its duplicate deliveries or firings, the second only replays.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, cwd: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("IDEMPOTENCY_DATABASE_URL", None)  # the example's own default, as printed
    done = subprocess.run(
        [sys.executable, "-W", "error", "-m", f"examples.{name}"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout.splitlines()


def last_list(lines: list[str], label: str) -> list[str]:
    assert lines[-1].startswith(label), lines
    value: list[str] = ast.literal_eval(lines[-1].removeprefix(label))
    return value


@pytest.mark.parametrize(
    ("name", "label", "first"),
    [
        ("queue_consumer", "refunds issued: ", ["A-88214", "A-88215"]),
        ("cron_job", "runs: ", None),  # one slot, today's: checked by its length
    ],
)
def test_an_example_does_the_work_once_and_a_second_run_replays(
    name: str, label: str, first: list[str] | None, tmp_path: Path
) -> None:
    once = run_example(name, tmp_path)
    again = run_example(name, tmp_path)
    done = last_list(once, label)
    assert done == first if first is not None else len(done) == 1
    assert last_list(again, label) == []
    assert len(once) == len(again)  # every delivery or firing answered, both times

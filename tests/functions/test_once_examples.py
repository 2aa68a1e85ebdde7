"""The function guard's examples and its README section run as printed.

Each example (``python -m examples.<name>``) runs twice in a fresh directory on its
SQLite default: the first run does the work once for all its duplicate deliveries or
firings, the second only replays. Every code block of the README's section runs as a
script (python) or as commands (bash), warnings as errors.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.project.docs_text import docs_text

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Beyond HTTP: the function guard"


def run_python(args: list[str], cwd: Path) -> list[str]:
    """``python -W error ARGS`` in ``cwd``, as a user runs it; its output's lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("IDEMPOTENCY_DATABASE_URL", None)  # the examples' own default, as printed
    done = subprocess.run(
        [sys.executable, "-W", "error", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    return done.stdout.splitlines()


def run_example(name: str, cwd: Path) -> list[str]:
    return run_python(["-m", f"examples.{name}"], cwd)


def last_list(lines: list[str], label: str) -> list[str]:
    assert lines[-1].startswith(label), lines
    value: list[str] = ast.literal_eval(lines[-1].removeprefix(label))
    return value


@pytest.mark.parametrize(
    ("name", "label", "first"),
    [
        ("queue_consumer", "refunds issued: ", ["A-88214", "A-88215"]),
        ("cron_job", "runs: ", None),  # one slot, today's: checked by its length
        # An MCPServer under uvicorn and an agent whose first attempt times out.
        ("mcp_tools", "refunds issued: ", ["A-88214", "A-88214"]),
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


def section_blocks() -> list[tuple[str, str]]:
    readme = docs_text()
    start = readme.index(f"\n{SECTION}\n")
    end = readme.index("\n## ", start + len(SECTION))
    return re.findall(r"^```(\w+)\n(.*?)^```", readme[start:end], re.S | re.M)


def test_the_section_has_its_blocks() -> None:
    assert [lang for lang, _ in section_blocks()] == ["python", "python", "bash", "python"]


@pytest.mark.parametrize("index", range(4))
def test_every_code_block_of_the_readme_section_runs_as_printed(index: int, tmp_path: Path) -> None:
    lang, code = section_blocks()[index]
    if lang == "python":
        (tmp_path / "block.py").write_text(code, encoding="utf-8")
        run_python(["block.py"], tmp_path)
        return
    for line in code.splitlines():
        command = shlex.split(line)
        assert command[0] == "python", line
        run_python(command[1:], tmp_path)

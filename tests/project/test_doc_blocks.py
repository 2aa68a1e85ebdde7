"""Every ``python`` block of the README and the docs runs as printed.

Each block runs alone, in a fresh interpreter in an empty directory. A block another
test runs with what it needs (a scratch alembic project, an app to mount on) says so
just above it, ``<!-- ran by tests/... -->``, and that test must exist and read the
docs; an excerpt that needs the caller's own objects or a live server says
``<!-- not run: why -->`` and must still parse. Nothing else is exempt.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.project.docs_text import ROOT, doc_files

_BLOCK = re.compile(r"(?:<!-- (ran by|not run:) ?(.*?) -->\n)?```python\n(.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    where: str
    code: str
    mark: str | None
    why: str


def _blocks() -> list[Block]:
    found = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            line = text[: m.start(3)].count("\n")
            found.append(
                Block(f"{path.relative_to(ROOT)}:{line}", m.group(3), m.group(1), m.group(2))
            )
    return found


BLOCKS = _blocks()


def test_there_are_blocks_and_few_exemptions() -> None:
    assert len(BLOCKS) >= 10
    exempt = [b.where for b in BLOCKS if b.mark == "not run:"]
    assert not exempt, exempt  # an excerpt should be made runnable instead


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_the_block_runs_as_printed(block: Block, tmp_path: Path) -> None:
    if block.mark == "ran by":
        runner = ROOT / block.why
        assert runner.is_file(), f"{block.where}: {block.why} does not exist"
        assert "docs_text" in runner.read_text(), f"{block.why} does not read the docs"
        return
    if block.mark == "not run:":
        assert block.why, f"{block.where}: say why it is not run"
        ast.parse(block.code, mode="exec", feature_version=(3, 11), type_comments=False)
        compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        return
    done = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{block.where} failed:\n{done.stderr[-2000:]}"

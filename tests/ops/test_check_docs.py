"""docs/guide/check.md's command, as printed, against the README's first example.

The example (``examples/fastapi_refunds.py``) is served by real uvicorn; the command
is read from the page's ``sh`` block and its results compared with the page's table.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from asgi_idempotency.ops._serve import uvicorn_process
from asgi_idempotency.ops.cli import Exit, main
from tests.project.docs_text import ROOT

PAGE = ROOT / "docs" / "guide" / "check.md"
EXAMPLE = ROOT / "examples" / "fastapi_refunds.py"
PRINTED_URL = "http://127.0.0.1:8000"


def _printed() -> tuple[list[str], dict[str, str]]:
    text = PAGE.read_text(encoding="utf-8")
    shell = re.search(r"```sh\n(.*?)```", text, re.S)
    assert shell is not None
    joined = shell.group(1).replace("\\\n", " ")
    command = next(line for line in joined.splitlines() if line.startswith("asgi-idempotency"))
    table = re.search(r"```console\n(.*?)```", text, re.S)
    assert table is not None
    results = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^(\S+)\s+(pass|fail|not run)\s", table.group(1), re.M)
    }
    return shlex.split(command)[1:], results


@pytest.mark.slow
def test_the_pages_command_gives_the_pages_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, printed = _printed()
    assert len(printed) == 12
    with uvicorn_process(
        "fastapi_refunds:app",
        env={},
        log=tmp_path / "uvicorn.log",
        args=("--app-dir", str(EXAMPLE.parent)),
        ready_path="/openapi.json",
        cwd=tmp_path,
    ) as server:
        args = [a.replace(PRINTED_URL, server.base_url) for a in args]
        code = main(args)
    out = capsys.readouterr().out
    seen = {
        m.group(1): m.group(2) for m in re.finditer(r"^(\S+)\s+(pass|fail|not run)\s", out, re.M)
    }
    assert seen == printed, out
    assert code == Exit.OK

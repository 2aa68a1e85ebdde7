"""The README's Testing your app section, as printed, is a test file that passes under pytest.

Run in a pytest of its own (its own rootdir, so none of this suite's settings or
fixtures apply), as a user would run it, with ``ResourceWarning`` an error: a store
left with connections on a closed loop would fail it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.project.docs_text import docs_text

ROOT = Path(__file__).resolve().parents[2]


def section_code(markdown: str, heading: str) -> str:
    match = re.search(rf"^### {re.escape(heading)}\n(.*?)(?=^#)", markdown, re.S | re.M)
    assert match is not None, f"the README has no {heading} section"
    blocks = re.findall(r"^```python\n(.*?)^```", match.group(1), re.S | re.M)
    assert len(blocks) == 1, blocks
    return str(blocks[0])


def test_the_readme_testing_example_passes(tmp_path: Path) -> None:
    code = section_code(docs_text(), "Testing your app")
    (tmp_path / "test_app.py").write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    warnings_as_errors = ["-W", "error::ResourceWarning",
                          "-W", "error::pytest.PytestUnraisableExceptionWarning"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *warnings_as_errors,
         "test_app.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout, done.stdout

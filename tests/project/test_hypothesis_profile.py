"""Property tests are derandomised in CI and write no example database (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import tests.conftest; from hypothesis import settings; "
    "print(settings.default.derandomize, settings.default.database is None)"
)


def test_with_ci_set_examples_are_derandomised_and_no_database_is_written() -> None:
    # A process of its own: the profile is chosen when conftest is imported.
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**os.environ, "CI": "true"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines()[-1] == "True True"

"""Run a snippet of Python in a fresh interpreter where some packages are not installed.

Used by the public-API tests of the client and of the package: both check what works,
and what error a user sees, when an optional extra is missing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).parents[2] / "src"

# A meta path finder that makes the named top-level packages unimportable, as if
# they were not installed.
_BLOCKER = """
import sys
BLOCKED = set(sys.argv[1].split(","))

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked for this test")
        return None

sys.meta_path.insert(0, Blocker())
"""


def run_without(blocked: str, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` with the comma-separated top-level packages ``blocked`` unimportable.

    The blocker is in place before ``body`` runs, so ``sys`` is already imported for
    it. Returns the finished process; stdout and stderr are captured as text.
    """
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER + body, blocked],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(SRC), "PATH": ""},
    )

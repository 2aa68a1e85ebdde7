"""Consumer processes of the broker tests: started, watched line by line, killed."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Consumer:
    """``python -m <module> <args>`` with ``env`` added; its stdout read by a thread of its own."""

    def __init__(
        self,
        module: str,
        env: dict[str, str],
        log: Path,
        args: tuple[str, ...] = (),
        cwd: Path = ROOT,
    ) -> None:
        full = {**os.environ, **env}
        full["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )  # fmt: skip
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def wait_for(self, line: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {line!r} from the consumer in {timeout} s")
            try:
                if self._lines.get(timeout=left) == line:
                    return
            except queue.Empty:
                continue

    def wait_dead(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(30)  # EOF once the process is gone
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._log.close()


@contextmanager
def running() -> Iterator[list[Consumer]]:
    """A list to start consumers into; every one of them killed on exit."""
    started: list[Consumer] = []
    try:
        yield started
    finally:
        for consumer in started:
            consumer.kill()

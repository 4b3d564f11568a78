"""Programs a test module starts at once and its tests wait for, one each.

Engine start-ups and Triton-interpreted suites are mostly one busy process at a time, so on
two cores several started together take about as long as the slowest (the suite's time
budget). A module fixture starts them (:class:`Background`), each test waits for its own
(:meth:`Background.result`), and the fixture kills what is left at teardown
(:meth:`Background.kill`).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest


class Background:
    """One program, started now in a session of its own, stdout and stderr into ``log``."""

    def __init__(self, cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT,
                                         env=None if env is None else dict(env), cwd=cwd,
                                         start_new_session=True)

    def result(self, timeout: float) -> tuple[int, str]:
        """Its exit status and output, once it ended; a test failure if it runs past
        ``timeout`` seconds (then it is killed)."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running after {timeout} s: {self.output()[-3000:]}")
        return rc, self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """Kills it and every process it started (its session), if still running."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

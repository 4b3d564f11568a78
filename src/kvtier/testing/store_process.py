"""A real ``kvtier store`` process for tests and tools: started on a socket in a directory,
waited for until it prints its ready line, stopped (SIGTERM) or killed (SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2])  # the src directory kvtier is in


class StoreProcess:
    """``python -m kvtier.cli store`` on a socket under ``directory``."""

    def __init__(self, directory: Path, size: str = "64MiB", lease_ttl: float = 30.0,
                 disk: tuple[Path, str] | None = None, extra: tuple[str, ...] = ()) -> None:
        """``disk``: the store's disk tier, (directory, size); ``extra``: more flags (the
        remote tier's, ``--remote-url``...)."""
        self.path = str(directory / "store.sock")
        self.url = "unix://" + self.path
        self.size, self.lease_ttl, self.disk = size, lease_ttl, disk
        self.extra = extra
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 60.0) -> StoreProcess:
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "store", "--socket", self.path,
             "--size", self.size, "--lease-ttl", str(self.lease_ttl),
             *(["--disk-path", str(self.disk[0]), "--disk-size", self.disk[1]]
               if self.disk else []), *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "ready on" not in line or time.monotonic() > deadline:
            # what the store said before it exited (a traceback's last lines name the cause)
            said = line
            with contextlib.suppress(subprocess.TimeoutExpired):
                said += self.proc.communicate(timeout=10)[0] or ""
            self.stop()
            raise RuntimeError("the store did not start:\n" + "\n".join(said.splitlines()[-12:]))
        self.ready_line = line.strip()
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs in the store."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

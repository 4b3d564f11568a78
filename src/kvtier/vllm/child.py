"""The server as a child process: bound to the life of the process that started it, and
checked to be the one answering on its port.

Contract:
- :func:`spawn` starts the child in a session of its own (so it can be stopped as a whole,
  and a terminal's Ctrl-C reaches only the parent, which forwards it) with Linux's
  ``PR_SET_PDEATHSIG``: when the parent dies, even by SIGKILL, the child gets SIGTERM and vLLM
  shuts its engine processes down. If the parent is already gone when the child starts, the
  child exits at once.
- :func:`wait_session_end` waits (boundedly) until no process of the child's session is
  left, so that what they still print comes before what the parent prints last.
- :func:`port_in_use` says whether something already listens on (host, port).
- :func:`owns_port` says whether a process of the child's tree holds the listening socket of
  that port (Linux ``/proc``; None where that cannot be known), so a ``/health`` answer from
  another server is never taken for the child's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

PR_SET_PDEATHSIG = 1
DEATH_SIGNAL = signal.SIGTERM


def _bind_to_parent(parent: int) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child between fork and exec
        os.setsid()
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
    return preexec


def spawn(cmd: Sequence[str], stdout: IO[bytes] | None = None,
          env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` bound to this process's life (see the module contract); stderr goes
    where stdout goes when ``stdout`` is given."""
    return subprocess.Popen(list(cmd), stdout=stdout,
                            stderr=subprocess.STDOUT if stdout is not None else None,
                            env=None if env is None else dict(env),
                            preexec_fn=_bind_to_parent(os.getpid()))


def _session_alive(sid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError), open(
                    f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":  # session, state
                    return True
    return False


def wait_session_end(sid: int, timeout: float) -> bool:
    """Wait until session ``sid`` (a child of :func:`spawn` leads its own) has no live
    process, at most ``timeout`` seconds; True if it ended. Without ``/proc``: True at once."""
    if not os.path.isdir("/proc/self"):
        return True
    deadline = time.monotonic() + timeout
    while _session_alive(sid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def port_in_use(host: str, port: int) -> bool:
    """True if (host, port) cannot be bound because a socket listens there (a port held
    only by TIME_WAIT connections of a stopped server counts as free, as for vLLM)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)
            for line in f:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])  # state 0A = LISTEN
    return inodes


def _tree(pid: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError), open(
                f"/proc/{entry}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(parents.get(p, []))
    return out


def owns_port(pid: int, port: int) -> bool | None:
    """Does ``pid`` or a descendant hold the listening socket of ``port``? None if this
    host has no ``/proc`` to tell."""
    if not os.path.isdir("/proc/self/fd") or not os.path.exists("/proc/net/tcp"):
        return None
    wanted = {f"socket:[{i}]" for i in _listening_inodes(port)}
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{p}/fd/{fd}") in wanted:
                        return True
    return False

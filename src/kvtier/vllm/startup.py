"""Start-up failures of the connector: one line, logged once, and the last line of the output.

vLLM starts kvtier's halves in its engine processes (EngineCore, the workers), several of which
print a traceback of a failure, and the process that started the engine (``LLM(...)``, the API
server) prints its own last. A kvtier refusal there would be buried; so every start-up failure
of the connector goes through this module.

Contract:
- :func:`failures` (a context manager) turns a :class:`ConfigError`, :class:`SlabError` or
  :class:`~kvtier.layout.LayoutError` (registered caches kvtier cannot move as opaque
  bytes) raised inside it into a :class:`StartupError`; :func:`fail` raises one for a refusal the
  connector makes itself. A :class:`StartupError` is a ``ValueError`` (what vLLM saw before),
  its message is one line ``kvtier: <what is wrong>; <what to do>``, and it is raised from
  None (the line says it all; vLLM prints its own traceback around it anyway).
- The line is logged once per process at ERROR on the ``vllm.kvtier`` logger.
- The line is the last thing the output shows: a *reporter* prints it once more, to stderr,
  when it exits, after everything else it and its engine processes printed. The reporter is
  the main program of the engine (:func:`install_reporter`, run by the plugin in every vLLM
  process): its engine processes (multiprocessing children) append their lines to a report
  file named by :data:`REPORT_ENV`, and it prints them at exit. ``kvtier serve``
  (:func:`open_report`) is the reporter of the server it starts: it prints the lines itself
  once the server's processes are gone. A process that reports to no other prints its own
  lines at exit if it is an engine process or dies of an unhandled exception (a program
  that caught the error and went on has handled it).
- :func:`failure_policy_refusal` is the connector's refusal of a failure policy other than
  ``recompute``, shared with ``kvtier serve``'s checks before vLLM starts.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kvtier.config import ConfigError
from kvtier.log import get_logger

logger = get_logger("startup")

# "<kind>:<pid>:<path>": the report file of the reporter with that pid. kind "engine": the
# main program of an engine, whose engine processes report to it; kind "serve": kvtier serve,
# whose child (the API server program) and that child's engine processes report to it.
REPORT_ENV = "KVTIER_STARTUP_REPORT"
ENGINE, SERVE = "engine", "serve"
TRACKER_WAIT_S = 3.0
SETTINGS_TODO = "`kvtier config` lists every setting"
LAYOUT_TODO = ("kvtier moves every KV byte it restores and refuses what it cannot map to "
               "blocks; serve this model without the kvtier connector, or report the layout")


class StartupError(ValueError):
    """A refusal of the connector at start-up; ``str()`` is the one line
    ``kvtier: <what is wrong>; <what to do>``."""


@dataclass
class _State:
    lines: list[str] = field(default_factory=list)  # this process's, in order
    own_report: str | None = None  # the report file this process is the reporter of
    hook: bool = False
    dying: bool = False  # of an unhandled exception (sys.excepthook was called)


_state = _State()


def one_line(text: str) -> str:
    """``text`` as one ``kvtier: ...`` line (whitespace collapsed, no doubled prefix)."""
    flat = " ".join(text.split())
    return "kvtier: " + re.sub(r"^kvtier:?\s+", "", flat)


def fail(what: str, todo: str) -> NoReturn:
    """Refuse to start: raise (and report) ``kvtier: WHAT; TODO``."""
    raise _report(StartupError(one_line(f"{what}; {todo}")))


@contextlib.contextmanager
def failures(todo: str | None = None) -> Iterator[None]:
    """Start-up code inside this block fails with a :class:`StartupError` (reported)
    instead of a :class:`ConfigError`, :class:`SlabError` or ``LayoutError``; ``todo`` is
    appended to errors whose own text may not say what to do."""
    from kvtier.slab import SlabError  # here: kvtier serve imports this module without torch

    # kvtier.layout needs torch; where it was never imported, none of its errors can occur
    layout = sys.modules.get("kvtier.layout")
    refusals = (ConfigError, SlabError, *((layout.LayoutError,) if layout else ()))
    try:
        yield
    except StartupError:
        raise
    except refusals as e:
        text = str(e) if todo is None else f"{e}; {todo}"
        raise _report(StartupError(one_line(text))) from None


def failure_policy_refusal(policy: str, allow_fail_policy: bool) -> tuple[str, str] | None:
    """(what is wrong, what to do) if kvtier refuses vLLM's ``kv_load_failure_policy``:
    anything but ``recompute``, unless ``allow_fail_policy``."""
    if policy == "recompute" or allow_fail_policy:
        return None
    return (f"kv_load_failure_policy={policy!r} is refused: a failed restore must recompute, "
            "not fail the request",
            "set kv_load_failure_policy='recompute' in --kv-transfer-config, or set kvtier's "
            "allow_fail_policy=true to start anyway")


def check_failure_policy(policy: str, allow_fail_policy: bool) -> None:
    """The connector's refusal of :func:`failure_policy_refusal`, as a :func:`fail`."""
    refusal = failure_policy_refusal(policy, allow_fail_policy)
    if refusal is not None:
        fail(*refusal)


def _report(err: StartupError) -> StartupError:
    line = str(err)
    if line in _state.lines:
        return err
    _state.lines.append(line)
    logger.error("%s", line)
    upstream = _upstream_report()
    if upstream is not None:
        with contextlib.suppress(OSError):
            _append(upstream, line)
    _ensure_exit_hook()
    return err


# ---- reporters ---------------------------------------------------------------------------

def install_reporter() -> None:
    """Make this process the reporter of the engine it starts, unless it reports upstream
    (an engine process of a reporter, or the server kvtier serve started). Idempotent."""
    if _state.own_report is not None or _upstream_report() is not None:
        return
    _state.own_report = _new_report_file()
    os.environ[REPORT_ENV] = f"{ENGINE}:{os.getpid()}:{_state.own_report}"
    _ensure_exit_hook()


def open_report(env: dict[str, str]) -> str:
    """kvtier serve: a new report file, named in ``env`` (the server's environment) so that
    the server and its engine processes report to this process. Returns its path; read it
    with :func:`read_report`, remove it with :func:`close_report`."""
    path = _new_report_file()
    env[REPORT_ENV] = f"{SERVE}:{os.getpid()}:{path}"
    return path


def read_report(path: str) -> list[str]:
    """The distinct lines of a report file, in the order they came (none if it is gone)."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f]
    except OSError:
        return []
    return list(dict.fromkeys(ln for ln in lines if ln))


def close_report(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _new_report_file() -> str:
    fd, path = tempfile.mkstemp(prefix="kvtier-startup-", suffix=".txt")
    os.close(fd)
    return path


def _upstream_report() -> str | None:
    """The report file of this process's reporter, if another process is it: an engine
    process (multiprocessing child) reports to the reporter named in its environment; a
    program reports only to kvtier serve, its parent."""
    kind, _, rest = os.environ.get(REPORT_ENV, "").partition(":")
    pid, _, path = rest.partition(":")
    if not pid.isdigit() or int(pid) == os.getpid() or not os.path.isfile(path):
        return None
    if multiprocessing.parent_process() is not None:
        return path
    return path if kind == SERVE and int(pid) == os.getppid() else None


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())  # one short write: lines of ranks never mix
    finally:
        os.close(fd)


def _ensure_exit_hook() -> None:
    """Register :func:`_at_exit`, and note in ``sys.excepthook`` (chained: the previous hook
    still prints the traceback) whether the program dies of an unhandled exception. Not
    ``sys.last_value``: test runners and debuggers set it for exceptions they caught."""
    if _state.hook:
        return
    _state.hook = True
    atexit.register(_at_exit)
    previous = sys.excepthook

    def excepthook(*exc_info: Any) -> None:
        _state.dying = True
        previous(*exc_info)

    sys.excepthook = excepthook


def _at_exit() -> None:
    """Print the lines this process is responsible for, last (see the module contract)."""
    lines: list[str] = []
    if _state.own_report is not None:
        lines = read_report(_state.own_report)
        close_report(_state.own_report)
    if _upstream_report() is None and (
            _state.dying or multiprocessing.parent_process() is not None):
        lines = [*_state.lines, *lines]
    lines = list(dict.fromkeys(lines))
    if not lines:
        return
    _drain_resource_tracker()
    with contextlib.suppress(Exception):
        _flush_log_handlers()
        sys.stdout.flush()
        sys.stderr.write("".join(line + "\n" for line in lines))
        sys.stderr.flush()


def _flush_log_handlers() -> None:
    for h in logging.getLogger("vllm").handlers + logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()


def _drain_resource_tracker() -> None:
    """Let multiprocessing's resource tracker print its leak warnings (vLLM's engine processes
    leave shared memory behind when they fail) before the line instead of after it: it prints
    them when the last process holding its pipe closes it, which is this one, at exit. Close
    our end now and wait for it a little (never long: a live engine process may still hold the
    pipe). Python's private tracker state, so every step is guarded."""
    with contextlib.suppress(Exception):
        from multiprocessing import resource_tracker

        tracker = resource_tracker._resource_tracker
        fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
        if fd is None or pid is None:
            return
        tracker._fd = None
        os.close(fd)
        deadline = time.monotonic() + TRACKER_WAIT_S
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                tracker._pid = None
                return
            time.sleep(0.05)

"""Start-up failures of the connector (kvtier.vllm.startup): one line, logged once, and the
last line of the output of a process tree shaped like vLLM's (a main program, engine processes
started by multiprocessing that print after the failure, a traceback of the main program).
Real processes; the engine runs of the same are in tests/e2e/test_startup_errors_e2e.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.config import KvtierConfig
from kvtier.geometry import resolve_chunk_tokens
from kvtier.slab import SlabError
from kvtier.vllm import startup

ROOT = Path(__file__).resolve().parents[1]
CHUNK_LINE = startup.one_line(
    "kvtier setting 'chunk_tokens' (100) is not a multiple of every KV-cache block size [32] "
    "(their LCM is 32): write chunk_tokens=96 or 128, or leave it unset")


def test_a_config_or_slab_error_becomes_one_line_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    config = KvtierConfig.load({"chunk_tokens": 100}, environ={})
    caplog.set_level(logging.ERROR, logger="vllm.kvtier")
    for _ in range(2):  # the same failure twice in one process (scheduler and worker halves)
        with pytest.raises(startup.StartupError) as info, startup.failures():
            resolve_chunk_tokens(config.chunk_tokens, [32])
        assert isinstance(info.value, ValueError) and info.value.__cause__ is None
        assert str(info.value) == CHUNK_LINE and "\n" not in str(info.value)
    shm = r"^kvtier: /dev/shm has 1 B free; enlarge"
    with pytest.raises(startup.StartupError, match=shm), startup.failures():
        raise SlabError("/dev/shm has 1 B free;\n enlarge it")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        CHUNK_LINE, "kvtier: /dev/shm has 1 B free; enlarge it"]
    with pytest.raises(KeyError), startup.failures():  # not a start-up refusal: unchanged
        raise KeyError("x")


def test_the_failure_policy_refusal_says_what_and_what_to_do() -> None:
    assert startup.failure_policy_refusal("recompute", False) is None
    assert startup.failure_policy_refusal("fail", True) is None
    with pytest.raises(ValueError) as info:
        startup.check_failure_policy("fail", False)
    what, todo = str(info.value).split("; ", 1)
    assert what == ("kvtier: kv_load_failure_policy='fail' is refused: a failed restore must "
                    "recompute, not fail the request")
    assert todo.startswith("set kv_load_failure_policy='recompute' in --kv-transfer-config")


# A main program that becomes the reporter (as the plugin makes vLLM's), starts an engine
# process that fails (and prints after failing, as vLLM's do), then dies of its own exception
# (vLLM's "Engine core initialization failed") or, with "handled", catches it and ends well.
ENGINE_TREE = """
import multiprocessing as mp, sys
from kvtier.config import KvtierConfig
from kvtier.geometry import resolve_chunk_tokens
from kvtier.vllm import startup

def engine_process():
    try:
        with startup.failures():
            resolve_chunk_tokens(KvtierConfig.load({"chunk_tokens": 100}, environ={}).chunk_tokens, [32])
    finally:
        print("engine process: traceback and shutdown lines", file=sys.stderr, flush=True)
    sys.exit(1)

if __name__ == "__main__":
    startup.install_reporter()
    p = mp.get_context(sys.argv[1]).Process(target=engine_process)
    p.start()
    p.join()
    if sys.argv[2] == "own":  # the failure in the main program itself (an in-process engine)
        try:
            with startup.failures():
                resolve_chunk_tokens(KvtierConfig.load({"chunk_tokens": 100}, environ={}).chunk_tokens, [32])
        except ValueError:
            if sys.argv[3] == "handled":
                print("handled", file=sys.stderr)
                sys.exit(0)
            raise
    raise RuntimeError("Engine core initialization failed. See root cause above.")
"""


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "engine_tree.py"
    script.write_text(textwrap.dedent(ENGINE_TREE))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp_path)}
    env.pop(startup.REPORT_ENV, None)
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                       env=env, timeout=120)
    assert not list(tmp_path.glob("kvtier-startup-*")), "report file left behind"
    return r


def _last_line(text: str) -> str:
    return [ln for ln in text.splitlines() if ln.strip()][-1]


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_an_engine_process_failure_is_the_last_line_of_the_main_program(
        tmp_path: Path, method: str) -> None:
    r = _run(tmp_path, method, "child", "-")
    assert r.returncode == 1
    tail = r.stderr[r.stderr.index("RuntimeError: Engine core initialization failed"):]
    assert tail.splitlines()[1:] == [CHUNK_LINE], r.stderr  # the very next line, and the last
    assert "ERROR" in r.stderr.split(CHUNK_LINE)[0].splitlines()[-1]  # logged at ERROR first


def test_an_in_process_failure_is_the_last_line_only_if_the_program_dies_of_it(
        tmp_path: Path) -> None:
    r = _run(tmp_path, "spawn", "own", "unhandled")
    assert r.returncode == 1 and _last_line(r.stderr) == CHUNK_LINE, r.stderr
    assert "StartupError: " + CHUNK_LINE in r.stderr  # its own traceback, then the line again
    r = _run(tmp_path, "spawn", "own", "handled")
    # the engine process's line still ends the output (that engine is gone); the program's own
    # failure, which it handled, is not printed again
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 0 and lines[-2:] == ["handled", CHUNK_LINE], r.stderr

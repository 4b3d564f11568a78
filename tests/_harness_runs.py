"""The harness's vLLM 0.25.1 runs, shared by the harness tests: a subprocess with the unpacked
0.25.1 sources first on ``PYTHONPATH`` (started before the in-process 0.32 run so both run at
once), its JSON summary, and the summaries written to ``.cache/harness-report.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM025 = ROOT / ".cache" / "vllm-0.25.1"
REPORT = ROOT / ".cache" / "harness-report.json"


def start_025(n: int, seed: int, *args: str) -> subprocess.Popen[str] | None:
    """``python -m harness.run`` on 0.25.1 with ``n`` scenarios from ``seed`` and ``args``;
    None where 0.25.1 is not unpacked."""
    if not (VLLM025 / "vllm" / "__init__.py").exists():
        return None
    # this checkout's kvtier first, not the one the venv's editable install points at
    path = os.pathsep.join(map(str, (VLLM025, ROOT / "src", ROOT / "tests")))
    env = dict(os.environ, PYTHONPATH=path, VLLM_LOGGING_LEVEL="ERROR")
    return subprocess.Popen(
        [sys.executable, "-m", "harness.run", *args, "--scenarios", str(n), "--seed",
         str(seed), "--json", "-"],
        cwd=ROOT / "tests", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_025(proc: subprocess.Popen[str] | None, timeout: float) -> dict[str, Any]:
    if proc is None:
        pytest.skip("vLLM 0.25.1 is not unpacked (bash scripts/fetch_vllm025.sh)")
    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"the 0.25.1 run printed no summary (rc {proc.returncode}):\n{err[-4000:]}"
    return json.loads(lines[-1])


def report(name: str, summary: dict[str, Any]) -> None:
    REPORT.parent.mkdir(exist_ok=True)
    data = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    data[name] = summary
    REPORT.write_text(json.dumps(data, indent=1))


def run_module_025(module: str, timeout: float = 600) -> dict[str, Any]:
    """Run ``python -m <module>`` (a script under tests/) with vLLM 0.25.1's sources first on
    the path and return the last JSON line it printed; skips where 0.25.1 is not unpacked."""
    if not (VLLM025 / "vllm" / "__init__.py").exists():
        pytest.skip("vLLM 0.25.1 is not unpacked (bash scripts/fetch_vllm025.sh)")
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(VLLM025), str(ROOT / "tests"), str(ROOT / "src")]))
    proc = subprocess.run([sys.executable, "-m", module], cwd=ROOT / "tests", env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stderr[-4000:]
    out = json.loads(lines[-1])
    assert out["version"] == "0.25.1"
    return out

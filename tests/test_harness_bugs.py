"""The harness catches planted bugs, one at a time (tests/harness/bugs.py):

1. no fence in ``handle_preemptions``;
2. a duplicated ``finished_recving``;
3. a chunk made visible before all ranks report (world size 2);
4. a pinned chunk evicted;
5. a failure reported without ``failed_recving``;
6. a load that copies slot s+1 into the blocks of slot s.

For each, scenarios with the faults that expose it run under the bug until the oracle reports
one of the findings that bug must cause; the scenario that caught it must pass without the bug
(the finding is the bug's, not the scenario's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.bugs import PLANTED
from harness.driver import run_scenario
from harness.run import run_batch, scenarios
from harness.workload import make_scenario

MAX_SCENARIOS = 120
ROOT = Path(__file__).resolve().parent.parent
VLLM025 = ROOT / ".cache" / "vllm-0.25.1"


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_bug_is_caught(name: str) -> None:
    bug = PLANTED[name]
    batch = run_batch(scenarios(MAX_SCENARIOS, 1000, set(bug.fault_kinds), bug.world_size),
                      bug, stop_when=bug.detected_by)
    caught = [v for v in batch.violations if v["kind"] in bug.detected_by]
    assert caught, (f"{name} ({bug.description}) went unnoticed in {batch.scenarios} "
                    f"scenarios; other findings: {[v['kind'] for v in batch.violations]}")
    v = caught[0]
    clean = run_scenario(make_scenario(v["seed"], v["async"], v["ws"], set(bug.fault_kinds)))
    assert clean.ok, f"the scenario that caught {name} fails without it too: {clean.violation}"
    print(f"{name}: caught after {batch.scenarios} scenarios as {v['kind']}: {v['detail'][:200]}")


@pytest.mark.vllm025
def test_planted_bugs_are_caught_on_vllm025() -> None:
    """The same six bugs against vLLM 0.25.1's scheduler (failures reported per block there),
    each catching scenario replayed without its bug, as on 0.32."""
    if not (VLLM025 / "vllm" / "__init__.py").exists():
        pytest.skip("vLLM 0.25.1 is not unpacked (bash scripts/fetch_vllm025.sh)")
    # this checkout's kvtier first, not the one the venv's editable install points at
    path = os.pathsep.join(map(str, (VLLM025, ROOT / "src", ROOT / "tests")))
    env = dict(os.environ, PYTHONPATH=path,
               VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-m", "harness.run", "--planted", "--json", "-"],
                          cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stderr[-4000:]
    out = json.loads(lines[-1])
    assert out["version"].startswith("0.25")
    missed = {k: v for k, v in out["planted"].items() if not v["caught"]}
    unclean = {k: v["clean"] for k, v in out["planted"].items() if v["caught"]
               and v["clean"] != "ok"}
    assert not missed and not unclean, (
        f"went unnoticed: {missed}\nthe scenarios that caught these fail without the bug "
        f"too (the finding is the scenario's, not the bug's): {unclean}")

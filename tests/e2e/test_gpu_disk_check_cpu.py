"""tools/gpu_disk_check.py's CPU dry run (``--tiny``), so the H200 check cannot break unseen.

On 2026-12-01 the H200 run failed before its first request: the tool hooked the single-tier
scheduler's cost decision, which the stacked tiers had moved (``TierStack._cheapest``), and
its dry run had not been re-run since. Here the slowed-disk mode runs end to end on vLLM's
CPU build: every repeat must be weighed by the hooked cost model and declined (the disk is
slowed far below a recompute of the tiny model), with the numbers it weighed recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("vllm")


def test_the_slowed_disk_dry_run_records_and_declines_every_promotion(tmp_path: Path) -> None:
    out = tmp_path / "slow.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_disk_check.py"), "--mode", "slow", "--tiny",
         "--enforce-eager", "--prefix-len", "2048", "--targets", "2", "--slow-gbps", "0.004",
         "--disk-dir", str(tmp_path / "disk"), "--model-dir", str(tmp_path / "model"),
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "slow" and len(res["repeats"]) == 2
    for r in res["repeats"]:
        assert r["decision"] == "recompute (declined slower)", r
        (weighed,) = [w for w in r["planner"] if "disk" in w["reads"]]
        assert weighed["decision"] == "recompute" and weighed["gain_s"] is None
        assert weighed["reads"]["disk"]["bytes"] > 0
        assert weighed["reads"]["disk"]["read_s"] > weighed["recompute_s"]
    assert res["decisions_during_repeats"]["declined_slower"] >= 2

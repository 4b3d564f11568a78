"""``kvtier bench offline`` end to end on vLLM's CPU build with a tiny model: the five
configurations in one command, one engine process each, HBM short enough that kvtier parks
requests for loads; the report's tables, JSON and PNG; kvtier's restored prefixes give the
tokens of the run where every prefix stays in HBM; null-copy's parks end in the next step.
vLLM's native OffloadingConnector needs CUDA (its worker refuses the CPU build's cache): its
failure is reported with its log, and the other configurations still run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_offline_bench_runs_every_configuration_and_reports_them(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "offline", "--shape", "tiny",
           "--prefixes", "2", "--prefix-len", "256", "--per-prefix", "2", "--suffix-len", "64",
           "--output-len", "4", "--hbm-blocks", "14", "--dram-gib", "0.125", "--enforce-eager",
           "--kvtier-set", "cost_model=false", "--model-root", str(tmp_path),
           "--out-dir", str(out)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # native, below
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["configs"]) == ["hbm", "big", "native", "kvtier", "kvtier-null-copy"]
    native = summary["configs"]["native"]
    assert native["wall_s"] == [] and "offloading" in native["errors"][0]["log_tail"]
    assert summary["device"] == "cpu" and summary["command"].startswith("kvtier bench offline")
    configs = ("hbm", "big", "kvtier", "kvtier-null-copy")
    runs = {c: json.loads((out / f"{c}-r0.json").read_text()) for c in configs}
    assert all(r["config"] == c and r["requests"] == 4 for c, r in runs.items())
    assert (out / "timelines.png").stat().st_size > 1000
    md = (out / "summary.md").read_text()
    assert "| kvtier-null-copy |" in md and "Gap to kvtier-null-copy" in md
    assert "| native | failed: exit 1" in md and "native failed (exit 1" in md

    kvt, null, big = runs["kvtier"], runs["kvtier-null-copy"], runs["big"]
    assert kvt["tokens"] == big["tokens"]  # restored prefixes: the model's own tokens
    assert kvt["kvtier"]["loads_ok"] > 0 and kvt["park_steps"]  # HBM was short: it parked
    # the floor makes the same decisions and parks, and each park ends in the next step
    assert null["kvtier"]["loads_ok"] == kvt["kvtier"]["loads_ok"]
    assert sum(null["park_steps"].values()) == kvt["kvtier"]["loads_ok"]
    assert set(null["park_steps"]) == {"1"}
    assert null["null_copy"][0]["report_steps"] == {"0": null["null_copy"][0]["jobs"]}
    for r in runs.values():  # the categories add up to the wall time
        assert abs(sum(r["categories_s"].values()) - r["wall_s"]) < 0.02 * r["wall_s"] + 1e-3
        lines = r["timelines"]
        assert len(lines) == 4 and all(line["prefill_steps"] >= 1 for line in lines)
        assert all(line["decode_steps"] >= 3 for line in lines)


def test_the_layerwise_configuration_restores_without_parking(tmp_path: Path) -> None:
    """``kvtier-layerwise``: the same hits restored inside the step that computes the rest of
    the prompt: the model's own tokens, no request parked."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "offline", "--shape", "tiny",
           "--prefixes", "2", "--prefix-len", "256", "--per-prefix", "2", "--suffix-len", "64",
           "--output-len", "4", "--hbm-blocks", "14", "--dram-gib", "0.125", "--enforce-eager",
           "--kvtier-set", "cost_model=false", "--model-root", str(tmp_path),
           "--configs", "big,kvtier-layerwise", "--no-async-scheduling", "--out-dir", str(out)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    big = json.loads((out / "big-r0.json").read_text())
    lw = json.loads((out / "kvtier-layerwise-r0.json").read_text())
    assert lw["tokens"] == big["tokens"]
    assert lw["kvtier"]["loads_ok"] > 0 and lw["kvtier"]["loads_failed"] == 0
    assert not lw["park_steps"]  # nothing parked: every hit loaded in its own step

"""Cache-aware admission (``cache_aware_admission``) on vLLM's CPU build, the offline
reference workload in small (4 prefixes x 3 requests in round-robin order, HBM for one prefix's
group and one more prefix): with admission on, requests that do not fit wait while those
sharing a resident prefix run together, so each prefix is computed once and stays in HBM for
its group. Every request finishes with the tokens of the run where every prefix stays in HBM,
the same as with admission off, in fewer engine steps and with no load from kvtier (off: one
load per repeated request). The same holds with HBM for only two prompts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _background import Background

ROOT = Path(__file__).resolve().parents[2]


class _Bench:
    """``kvtier bench offline`` in a process of its own, started at once."""

    def __init__(self, tmp_path: Path, name: str, configs: str, *extra: str) -> None:
        self.out, self.configs = tmp_path / name, configs.split(",")
        cmd = [sys.executable, "-m", "kvtier.cli", "bench", "offline", "--shape", "tiny",
               "--configs", configs, "--prefixes", "4", "--prefix-len", "512", "--per-prefix",
               "3", "--suffix-len", "64", "--output-len", "8", "--hbm-blocks", "44",
               "--max-num-batched-tokens", "256", "--dram-gib", "0.125", "--enforce-eager",
               "--kvtier-set", "cost_model=false", *extra, "--model-root",
               str(tmp_path / f"model-{name}"), "--out-dir", str(self.out)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT / "src"))
        self.run = Background(cmd, tmp_path / f"{name}.log", env=env)

    def runs(self) -> dict[str, dict]:
        rc, log = self.run.result(1200)
        assert rc == 0, log[-6000:]
        return {c: json.loads((self.out / f"{c}-r0.json").read_text()) for c in self.configs}


def test_admission_runs_each_prefix_group_together_in_fewer_steps(tmp_path: Path) -> None:
    # the two commands run at once (engine start-ups are mostly one busy process at a time,
    # and what is compared here is counted in engine steps and tokens, not seconds)
    on_args = ("--kvtier-set", "cache_aware_admission=true")
    benches = [_Bench(tmp_path, "off", "big,kvtier"), _Bench(tmp_path, "on", "kvtier", *on_args),
               # HBM for two prompts (40 blocks, 19 a prompt), as on the H200 DeepSeek-V2-Lite
               # run: before the look-ahead at tight room the next prefix's request was let in
               # beside the first in the step its prefill ended, before any sibling was asked
               # (measured: 55 steps and 3 loads; with it 40 steps, 0 loads)
               _Bench(tmp_path, "tight", "kvtier", *on_args, "--hbm-blocks", "40")]
    try:
        off, on, tight = (b.runs() for b in benches)
    finally:
        for b in benches:
            b.run.kill()
    assert on["kvtier"]["tokens"] == off["kvtier"]["tokens"] == off["big"]["tokens"]
    counts_on, counts_off = on["kvtier"]["kvtier"], off["kvtier"]["kvtier"]
    assert counts_on["admission_deferred"] > 0 and counts_on["admission_expired"] == 0
    assert "admission_deferred" not in counts_off
    # off: every repeated request (8 of 12) finds its prefix evicted from HBM and loads it;
    # on: each prefix stays in HBM while its group runs (measured: 58 steps off, 39 on)
    assert counts_off["loads_ok"] == 8 and counts_on["loads_ok"] == 0
    assert on["kvtier"]["cached_prompt_tokens"] == off["kvtier"]["cached_prompt_tokens"]
    assert len(on["kvtier"]["steps"]) <= 0.8 * len(off["kvtier"]["steps"])
    assert all(line["decode_steps"] >= 7 for line in on["kvtier"]["timelines"])
    counts_tight = tight["kvtier"]["kvtier"]
    assert tight["kvtier"]["tokens"] == off["big"]["tokens"]
    assert counts_tight["loads_ok"] == 0 and counts_tight["admission_expired"] == 0
    assert counts_tight["admission_looked_ahead"] > 0
    assert tight["kvtier"]["cached_prompt_tokens"] == off["kvtier"]["cached_prompt_tokens"]
    assert len(tight["kvtier"]["steps"]) <= 0.8 * len(off["kvtier"]["steps"])

"""Cache-aware admission (``defer_cold_requests``) on vLLM's CPU build: with HBM short, a
cold request is deferred so that a request sharing a resident prefix runs first; every
request still finishes, with the tokens of the run where every prefix stays in HBM, and the
same tokens as with admission off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, name: str, configs: str, *extra: str) -> dict[str, dict]:
    out = tmp_path / name
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "offline", "--shape", "tiny",
           "--configs", configs, "--prefixes", "2", "--prefix-len", "256", "--per-prefix",
           "2", "--suffix-len", "64", "--output-len", "4", "--hbm-blocks", "16",
           "--dram-gib", "0.125", "--enforce-eager", "--kvtier-set", "cost_model=false",
           *extra, "--model-root", str(tmp_path), "--out-dir", str(out)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {c: json.loads((out / f"{c}-r0.json").read_text()) for c in configs.split(",")}


def test_admission_on_and_off_give_the_same_tokens_and_on_defers(tmp_path: Path) -> None:
    off = _bench(tmp_path, "off", "big,kvtier")
    on = _bench(tmp_path, "on", "kvtier", "--kvtier-set", "defer_cold_requests=true")
    assert on["kvtier"]["tokens"] == off["kvtier"]["tokens"] == off["big"]["tokens"]
    assert on["kvtier"]["kvtier"]["cold_deferred"] > 0
    assert "cold_deferred" not in off["kvtier"]["kvtier"]
    # on: the request behind the deferred one (request 3, sharing request 1's prefix) is
    # prefilled first; off: first come, first served
    lines = on["kvtier"]["timelines"]
    assert lines[2]["first_prefill_step"] < lines[1]["first_prefill_step"]
    off_lines = off["kvtier"]["timelines"]
    assert off_lines[1]["first_prefill_step"] <= off_lines[2]["first_prefill_step"]
    assert all(line["decode_steps"] >= 3 for line in lines)

"""Where a repeated prefix's TTFT goes in tools/disk_shared_prefix_cpu.py's geometry: per pass-2
request its TTFT, the engine steps it took (and each step's milliseconds), the lookups that
deferred for a promotion and the disk tier's read milliseconds. Prints one JSON line per
request after a summary line.

    python tools/disk_ttft_steps_cpu.py --mode disk|dram|bigdram [--layers 2 --hidden 256]

``disk``: DRAM (16 chunks) + disk, pass 2 restores from disk; ``dram``: DRAM only (every
prefix was evicted: a recompute); ``bigdram``: DRAM holds every prefix (a pure DRAM hit,
the floor of any restore).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from disk_shared_prefix_cpu import C, tokens
from disk_shared_prefix_cpu import engine as make_engine


def run(model: str, prefixes: int, disk: str | None, dram: str
        ) -> tuple[list[float], list[dict[str, Any]]]:
    from vllm import SamplingParams

    from kvtier.testing.restore import settle
    from tests.e2e.conftest import shutdown

    llm, h = make_engine(model, disk, dram)
    engine, steps = llm.llm_engine, []
    real_step = engine.step

    def timed_step() -> Any:
        t0 = time.perf_counter()
        out = real_step()
        steps.append(time.perf_counter() - t0)
        return out

    engine.step = timed_step
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False, temperature=0.0)
    pre = [tokens(3 * C, seed=1 + i) for i in range(prefixes)]
    cold = []
    for i, p in enumerate(pre):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p + tokens(37, 500 + i)}], params, use_tqdm=False)
        cold.append(time.perf_counter() - t0)
        settle(h)
    llm.reset_prefix_cache()
    st, tier = h.kvtier.stats, h.kvtier.tier
    rows = []
    for i, p in enumerate(pre):
        steps.clear()
        deferrals, read = st.prepare_deferrals, tier.stats.read_seconds if tier else 0.0
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p + tokens(37, 900 + i)}], params, use_tqdm=False)
        rows.append({"ttft_ms": (time.perf_counter() - t0) * 1e3, "steps": len(steps),
                     "step_ms": [round(s * 1e3, 1) for s in steps],
                     "deferrals": st.prepare_deferrals - deferrals,
                     "read_ms": (tier.stats.read_seconds - read) * 1e3 if tier else 0.0})
        settle(h)
    shutdown(llm)
    return cold, rows


def main() -> None:
    from kvtier.testing.models import tiny_llama

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["disk", "dram", "bigdram"], default="disk")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--dir", default=None, help="where the model and the disk tier go")
    a = ap.parse_args()
    chunk = a.layers * 2 * C * 2 * (a.hidden // 4) * 4
    dram = f"{(64 if a.mode == 'bigdram' else 16) * chunk // 2**20}MiB"
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        model = tiny_llama(os.path.join(tmp, "model"), layers=a.layers, hidden=a.hidden)
        disk = os.path.join(tmp, "tier") if a.mode == "disk" else None
        cold, rows = run(model, a.prefixes, disk, dram)
    print(json.dumps({"mode": a.mode, "layers": a.layers, "hidden": a.hidden,
                      "chunk_kib": chunk >> 10,
                      "pass1_ttft_ms_p50": round(statistics.median(cold) * 1e3, 1),
                      "ttft_ms_p50": round(statistics.median(r["ttft_ms"] for r in rows), 1),
                      "steps_p50": statistics.median(r["steps"] for r in rows),
                      "read_ms_p50": round(statistics.median(r["read_ms"] for r in rows), 2)}))
    for r in rows:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()

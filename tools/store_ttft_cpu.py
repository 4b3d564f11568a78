"""TTFT of a repeated prefix restored through the node-wide store vs through the engine's
in-process pool, on vLLM's CPU build (issue 18: within one engine step). Prints one JSON
object.

    python tools/store_ttft_cpu.py [--prefixes 8] [--rounds 2] [--layers 4 --hidden 512]

Per round, two engines one after the other, the same model and settings but for where the
pool and index live: ``inproc`` (the engine's own slab and MemoryIndex) and ``store`` (a real
``kvtier store`` process; ``store_url``). Each engine computes ``prefixes`` prefixes of three
chunks (a 37-token suffix each), its HBM prefix cache is reset, then each prefix is sent
again with a new suffix, one request at a time, one output token (its latency is its TTFT),
restored by kvtier (every whole chunk: the cost model is off). The engine step is the
engine's decode step at batch 1, measured in the same engine: (time of 17 output tokens - time
of 1) / 16. Rounds alternate the order (inproc first, then store first) against drift.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.e2e.conftest

C = 256


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i + (i * i) % 97) % 1000 + 3 for i in range(n)]


def engine(model: str, store_url: str | None) -> Any:
    from kvtier.testing.restore import handles, sharpen_dummy_weights
    from tests.e2e.conftest import make_llm

    extra = {"dram_size": "256MiB", **({"store_url": store_url} if store_url else {})}
    h = handles(make_llm(model, extra, num_gpu_blocks_override=400))
    sharpen_dummy_weights(h)
    return h


def latency(h: Any, prompt: list[int], max_tokens: int = 1) -> float:
    from vllm import SamplingParams

    from kvtier.testing.restore import settle

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            temperature=0.0)
    t0 = time.perf_counter()
    h.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    settle(h)
    return dt


def measure(model: str, store_url: str | None, prefixes: int, seed: int) -> dict[str, Any]:
    from tests.e2e.conftest import shutdown

    h = engine(model, store_url)
    try:
        pre = [tokens(3 * C, seed=seed + i) for i in range(prefixes)]
        for i, p in enumerate(pre):
            latency(h, p + tokens(37, 500 + i))
        h.llm.reset_prefix_cache()
        before = h.kvtier.stats.loaded_tokens
        restored = [latency(h, p + tokens(37, 900 + i)) for i, p in enumerate(pre)]
        loaded = h.kvtier.stats.loaded_tokens - before
        warm = tokens(64, seed=77)
        latency(h, warm)
        steps = [(latency(h, warm + tokens(8, 80 + i), 17) - latency(h, warm + tokens(8, 90 + i)))
                 / 16 for i in range(5)]
    finally:
        shutdown(h.llm)
    return {"restored_ttft_s": restored, "loaded_tokens": loaded,
            "decode_step_s": statistics.median(steps)}


def main() -> None:
    from kvtier.testing.models import tiny_llama
    from kvtier.testing.store_process import StoreProcess

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    a = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"inproc": [], "store": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_llama(os.path.join(tmp, "model"), layers=a.layers, hidden=a.hidden)
        store = StoreProcess(Path(tmp), size="512MiB").start()
        try:
            for r in range(a.rounds):
                order = ("inproc", "store") if r % 2 == 0 else ("store", "inproc")
                for mode in order:
                    url = store.url if mode == "store" else None
                    runs[mode].append(measure(model, url, a.prefixes, seed=100 * (r + 1)))
        finally:
            store.stop()
    out: dict[str, Any] = {"prefixes": a.prefixes, "rounds": a.rounds,
                           "prompt_tokens": 3 * C + 37, "restored_tokens_each": 3 * C}
    for mode, rs in runs.items():
        ttfts = [t for r in rs for t in r["restored_ttft_s"]]
        out[mode] = {"ttft_p50_s": statistics.median(ttfts),
                     "ttft_p99_s": statistics.quantiles(ttfts, n=100, method="inclusive")[98],
                     "ttft_mean_s": statistics.mean(ttfts),
                     "decode_step_s": statistics.median(r["decode_step_s"] for r in rs),
                     "loaded_tokens": [r["loaded_tokens"] for r in rs],
                     "ttfts_s": [[round(t, 4) for t in r["restored_ttft_s"]] for r in rs]}
    step = max(out["inproc"]["decode_step_s"], out["store"]["decode_step_s"])
    diff = out["store"]["ttft_p50_s"] - out["inproc"]["ttft_p50_s"]
    out["ttft_p50_store_minus_inproc_s"] = diff
    out["within_one_engine_step"] = diff <= step
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""TTFT of a repeated prefix restored from the remote tier vs recomputed, on vLLM's CPU build
with a real Redis server. Prints one JSON object.

    python tools/remote_ttft_cpu.py HOST:PORT [--prefixes 8] [--layers 4 --hidden 512]

Engine A computes ``prefixes`` prefixes of three chunks (each with a 37-token suffix) and
writes them through to the server, then stops. Engine B (fresh: nothing in HBM, DRAM or its
catalog) sends each prefix again with a new suffix, one request at a time (its latency is its
TTFT: one output token), restored from the remote tier (discovery, promotion, load), then as
many unseen prompts of the same length (recomputed). The cost model is off (every hit is
restored, whatever it costs), so the two TTFTs compare the paths themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

C = 256


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i + (i * i) % 97) % 1000 + 3 for i in range(n)]


def engine(model: str, server: str, prefix: str) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.testing.restore import handles, sharpen_dummy_weights

    extra = {"dram_size": "256MiB", "cost_model": False, "remote_url": f"redis://{server}",
             "remote_key_prefix": prefix, "remote_timeout_ms": 2000}
    ktc = KVTransferConfig(kv_connector="KvtierConnector",
                           kv_connector_module_path="kvtier.vllm.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config=extra)
    llm = LLM(model=model, kv_transfer_config=ktc, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, dtype="float32", max_model_len=4096, max_num_seqs=4,
              block_size=32, seed=0, num_gpu_blocks_override=400)
    h = handles(llm)
    sharpen_dummy_weights(h)
    return h


def timed(h: Any, prompts: list[list[int]]) -> list[float]:
    from vllm import SamplingParams

    from kvtier.testing.restore import settle

    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False, temperature=0.0)
    out = []
    for p in prompts:
        t0 = time.perf_counter()
        h.llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        out.append(time.perf_counter() - t0)
        settle(h)
    return out


def main() -> None:
    from kvtier.testing.models import tiny_llama
    from kvtier.vllm.counters import scheduler_counts
    from tests.e2e.conftest import shutdown

    ap = argparse.ArgumentParser()
    ap.add_argument("server")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    a = ap.parse_args()
    chunk = a.layers * 2 * C * 2 * (a.hidden // 4) * 4
    prefix = f"ttft{uuid.uuid4().hex[:8]}"
    pre = [tokens(3 * C, seed=1 + i) for i in range(a.prefixes)]
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_llama(os.path.join(tmp, "model"), layers=a.layers, hidden=a.hidden)
        first = engine(model, a.server, prefix)
        computed = timed(first, [p + tokens(37, 500 + i) for i, p in enumerate(pre)])
        for _ in range(100):
            if first.kvtier.tier.remote.written_through >= 3 * a.prefixes:
                break
            timed(first, [tokens(40, 7)])
        written = first.kvtier.tier.remote.written_through
        shutdown(first.llm)
        second = engine(model, a.server, prefix)
        restored = timed(second, [p + tokens(37, 900 + i) for i, p in enumerate(pre)])
        counts = scheduler_counts(second.kvtier)
        fresh = timed(second, [tokens(3 * C + 37, 5000 + i) for i in range(a.prefixes)])
        shutdown(second.llm)
    print(json.dumps({
        "chunk_mib": chunk / 2**20, "prefixes": a.prefixes, "prompt_tokens": 3 * C + 37,
        "written_through_chunks": written, "remote_hit_tokens": counts["remote_hit_tokens"],
        "ttft_first_engine_compute_p50_s": statistics.median(computed),
        "ttft_restored_from_remote_p50_s": statistics.median(restored),
        "ttft_restored_from_remote_mean_s": statistics.mean(restored),
        "ttft_recomputed_p50_s": statistics.median(fresh),
        "ttft_recomputed_mean_s": statistics.mean(fresh)}))


if __name__ == "__main__":
    main()

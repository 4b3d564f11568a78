"""Issue 16's one H200 check of the planner's disk cost model, one configuration per process.

    python tools/gpu_disk_check.py --mode real --out $OUT/real.json   # the disk as it is
    python tools/gpu_disk_check.py --mode slow --out $OUT/slow.json   # slowed until recompute wins
    (--tiny: a tiny float32 model and short prefixes, the CPU dry run)

Llama-3.1-8B shape with dummy weights (bf16, 128 KiB of KV per token: a 16,384-token prefix
is 2 GiB), kvtier with a DRAM tier of ``--dram-prefixes`` prefixes and a disk tier under
``--disk-dir``, the cost model on. One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

1. fill: ``--targets`` prefixes of ``--prefix-len`` tokens, then one more filler prefix than
   DRAM holds, one request each (settled): DRAM evicts every target, demoted to disk;
2. HBM's prefix cache is reset; each target is sent again with a new suffix, one output
   token, one at a time: its latency is its TTFT, and the tier's counters say whether the
   planner promoted it from disk (``load``) or declined it as slower (``recompute``);
3. as many cold prefixes (never seen: a plain recompute) for the recompute TTFT.

``--mode slow`` wraps every disk store in the test-only
:func:`kvtier.testing.slow_disk.slow_engine_disk` (``--slow-gbps``), so the start-up probe
and every read see a slow disk and the planner should recompute. Reports the disk's GB/s (the
probe's, the cost model's after the run, and the measured promotions and demotions), the
planner's estimates for one prefix (read vs recompute seconds), its decisions, and the TTFTs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

TINY_KV_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # tiny_llama: 2 layers x (K, V) x 2 heads x 64 x fp32
LLAMA8B_KV_PER_TOKEN = 32 * 2 * 8 * 128 * 2


def toks(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` pseudo-random token ids of ``seed`` (distinct seeds never share a prefix)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) + 100 for _ in range(n)]


def build(args: argparse.Namespace) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    per_token = TINY_KV_PER_TOKEN if args.tiny else LLAMA8B_KV_PER_TOKEN
    prefix_bytes = per_token * args.prefix_len
    # DRAM of several prefixes: its demotion watermark (a quarter of the slots) then exceeds a
    # prefill step's burst of saves, so evicted chunks reach the disk instead of being lost
    kvtier = {"dram_size": int(args.dram_prefixes * prefix_bytes), "disk_path": args.disk_dir,
              # room for every prefix the run sends (the device's disk is 64 GiB in all)
              "disk_size": int((args.targets + args.dram_prefixes + 2) * prefix_bytes * 1.1),
              "cost_model": True,
              "prepare_timeout_ms": 20_000.0,
              "disk_max_pending_chunks": max(256, 4 * args.prefix_len // 256)}
    ktc = KVTransferConfig(kv_connector="KvtierConnector",
                           kv_connector_module_path="kvtier.vllm.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config=kvtier)
    if args.tiny:
        from kvtier.testing.models import tiny_llama

        model: dict[str, Any] = dict(model=tiny_llama(args.model_dir), dtype="float32",
                                     block_size=32, max_num_batched_tokens=1024,
                                     num_gpu_blocks_override=4 * args.prefix_len // 32)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_restore_check import llama8b

        # HBM holds about two prefixes: a target's blocks are gone once the cache is reset
        model = dict(model=llama8b(args.model_dir), dtype="bfloat16", block_size=16,
                     gpu_memory_utilization=0.85, max_num_batched_tokens=8192,
                     num_gpu_blocks_override=2 * (args.prefix_len + 1024) // 16)
    return LLM(**model, load_format="dummy", skip_tokenizer_init=True, seed=0,
               enforce_eager=args.enforce_eager, max_model_len=args.prefix_len + 1024,
               max_num_seqs=4, enable_prefix_caching=True,
               kv_transfer_config=ktc)


def timed(h: Any, prompt: list[int], params: Any) -> float:
    from kvtier.testing.restore import settle

    t0 = time.perf_counter()
    h.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    settle(h)
    return seconds


def decisions(tier: Any) -> dict[str, int]:
    st = tier.stats
    return {"promotions": st.promotions, "declined_slower": st.declined_slower,
            "hit_tokens": st.hit_tokens, "hits": st.hits}


def estimates(sched: Any, tier: Any, prefix_len: int) -> dict[str, Any]:
    """The planner's view of one prefix on disk only (TierStack._cheapest): reading it from
    disk (and a step of deferral), then loading it from DRAM like any hit, against
    recomputing it; ``pays``: what the planner decides for a prefix of this length."""
    from kvtier.planner import load_bytes

    geo, est = sched.geometry, sched.estimates
    chunks = prefix_len // geo.chunk_tokens
    nbytes = chunks * sum(tier.tier.chunk_bytes[g] for g in geo.full_groups)
    disk_s = tier.tier.cost.read_seconds(nbytes, chunks) + est.step_seconds
    dram_s = load_bytes(geo, chunks, 0) / (est.link_gbps * 1e9) + est.step_seconds
    recompute_s = chunks * geo.chunk_tokens * est.prefill_seconds_per_token
    return {"disk_read_s": disk_s, "dram_load_s": dram_s, "recompute_s": recompute_s,
            "pays": recompute_s - dram_s - disk_s > 0, "bytes": nbytes, "chunks": chunks,
            "cost_gbps": tier.tier.cost.gbps, "cost_latency_ms": tier.tier.cost.latency_s * 1e3,
            "link_gbps": est.link_gbps, "step_s": est.step_seconds,
            "prefill_s_per_token": est.prefill_seconds_per_token}


def record_decisions(stack: Any) -> list[dict[str, Any]]:
    """Every cost-model decision of the scheduler's tier stack (``TierStack._cheapest``, the
    one place the cost model weighs a promotion), with the numbers it weighed: appended to
    the returned list as they happen. A tool's hook, never a production path."""
    from kvtier.planner import load_cost

    seen: list[dict[str, Any]] = []
    cheapest = stack._cheapest

    def recorded(every: Any, keys: Any, num_tokens: int, hbm: int, have: int,
                 dram_hit: Any) -> Any:
        best = cheapest(every, keys, num_tokens, hbm, have, dram_hit)
        est = stack.estimates
        via = load_cost(stack.geometry, every.hit, hbm, est)
        reads = {}
        for t in every.tiers:
            todo = every.todo[t.tier.name]
            chunks = max((len(js) for _, js in todo), default=0)
            nbytes = t.read_bytes(todo)
            reads[t.tier.name] = {"chunks": chunks, "bytes": nbytes,
                                  "read_s": t.tier.cost.read_seconds(nbytes, chunks)}
        seen.append({"tokens": every.hit.tokens, "hbm_tokens": hbm, "dram_hit_ok": dram_hit.ok,
                     "reads": reads, "step_s": est.step_seconds,
                     "dram_load_s": via.load_seconds, "recompute_s": via.recompute_seconds,
                     "gain_s": None if best is None else best.gain,
                     "decision": "recompute" if best is None else
                     "load via " + "+".join(t.tier.name for t in best.tiers)})
        return best

    stack._cheapest = recorded
    return seen


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    from kvtier.testing.restore import handles, settle

    if args.mode == "slow":
        from kvtier.testing.slow_disk import slow_engine_disk

        slow_engine_disk(args.slow_gbps)
    shutil.rmtree(args.disk_dir, ignore_errors=True)
    t0 = time.perf_counter()
    llm = build(args)
    h = handles(llm)
    start_s = time.perf_counter() - t0
    sched = h.kvtier
    tier = sched.tier
    probe = {"gbps": tier.tier.cost.gbps, "latency_ms": tier.tier.cost.latency_s * 1e3}
    weighed = record_decisions(sched.stack)
    vocab = 800 if args.tiny else 120_000
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False, temperature=0.0)
    timed(h, toks(512, 7, vocab), params)  # warm-up: kernels, allocator
    targets = [toks(args.prefix_len, 1000 + i, vocab) for i in range(args.targets)]
    fillers = [toks(args.prefix_len, 2000 + i, vocab) for i in range(args.dram_prefixes + 1)]
    t0 = time.perf_counter()
    for i, p in enumerate(targets + fillers):  # fill: DRAM evicts the targets to disk
        timed(h, p + toks(64, 100 + i, vocab), params)
    settle(h)
    fill_s = time.perf_counter() - t0
    before = decisions(tier)
    est = estimates(sched, tier, args.prefix_len)
    repeats = []
    for i, p in enumerate(targets):
        llm.reset_prefix_cache()  # HBM only: kvtier keeps its tiers
        n_weighed = len(weighed)
        d0 = decisions(tier)
        ttft = timed(h, p + toks(64, 300 + i, vocab), params)
        d1 = decisions(tier)
        repeats.append({"ttft_s": ttft, "promoted_chunks": d1["promotions"] - d0["promotions"],
                        "declined_slower": d1["declined_slower"] - d0["declined_slower"],
                        "disk_hit_tokens": d1["hit_tokens"] - d0["hit_tokens"],
                        "decision": ("load" if d1["hit_tokens"] > d0["hit_tokens"] else
                                     "recompute (declined slower)"
                                     if d1["declined_slower"] > d0["declined_slower"]
                                     else "recompute (not on disk or past the bound)"),
                        "planner": weighed[n_weighed:]})
    after = decisions(tier)
    cold = []
    for i in range(args.targets):
        llm.reset_prefix_cache()
        cold.append(timed(h, toks(args.prefix_len, 5000 + i, vocab) + toks(64, 400 + i, vocab),
                          params))
    st = tier.stats
    res = {
        "mode": args.mode, "slow_gbps": args.slow_gbps if args.mode == "slow" else None,
        "tiny": args.tiny, "prefix_len": args.prefix_len, "targets": args.targets,
        "enforce_eager": args.enforce_eager, "vllm": __import__("vllm").__version__,
        "engine_start_s": start_s, "fill_s": fill_s, "probe": probe,
        "planner_estimate_per_prefix": est,
        "cost_model_after_run": {"gbps": tier.tier.cost.gbps,
                                 "latency_ms": tier.tier.cost.latency_s * 1e3},
        "measured_read_gbps": st.bytes_read / st.read_seconds / 1e9 if st.read_seconds else None,
        "measured_write_gbps": (st.bytes_written / st.write_seconds / 1e9
                                if st.write_seconds else None),
        "bytes_read": st.bytes_read, "bytes_written": st.bytes_written,
        "demotions": st.demotions, "demotions_dropped": st.demotions_dropped,
        "repeats": repeats, "cold_ttft_s": cold,
        "repeat_ttft_p50_s": statistics.median(r["ttft_s"] for r in repeats),
        "cold_ttft_p50_s": statistics.median(cold),
        "decisions_during_repeats": {k: after[k] - before[k] for k in before},
    }
    res["repeat_over_cold_ttft"] = res["repeat_ttft_p50_s"] / res["cold_ttft_p50_s"]
    shutil.rmtree(args.disk_dir, ignore_errors=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["real", "slow"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk-dir", default="/tmp/kvtier-disk-check")
    ap.add_argument("--model-dir", default="/tmp/llama8b-shape")
    ap.add_argument("--prefix-len", type=int, default=16384)
    ap.add_argument("--targets", type=int, default=3)
    ap.add_argument("--dram-prefixes", type=int, default=4, help="DRAM tier size in prefixes")
    ap.add_argument("--slow-gbps", type=float, default=1.0,
                    help="--mode slow: the disk's GB/s (2 GiB then take ~2.1 s)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="CUDA graphs and compilation off (a faster start)")
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 model (CPU dry run)")
    args = ap.parse_args()
    res = run(args)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    est = res["planner_estimate_per_prefix"]
    print(f"{args.mode}: probe {res['probe']['gbps']:.2f} GB/s; planner per prefix: disk "
          f"{est['disk_read_s']:.3f} s + DRAM load {est['dram_load_s']:.3f} s vs recompute "
          f"{est['recompute_s']:.3f} s (pays: {est['pays']}); decisions "
          f"{[r['decision'] for r in res['repeats']]}; repeat TTFT p50 "
          f"{res['repeat_ttft_p50_s']:.3f} s vs cold {res['cold_ttft_p50_s']:.3f} s; "
          f"measured read {res['measured_read_gbps']} GB/s, write "
          f"{res['measured_write_gbps']} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

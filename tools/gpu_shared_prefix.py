"""The shared-prefix reference run of docs/design.md §3, offline, one configuration per process.

    python tools/gpu_shared_prefix.py --config kvtier --out $OUT/sp_kvtier.json
    (configs: hbm, big (HBM holding every prefix: 12,000 blocks), kvtier, native; --tp N)
    --model kimi-linear | minimax-m3 | glm-dsa | deepseek-v32: a seed architecture at its
    real hidden size, layer count and cache geometry, 8 experts (``MODELS``; the sparse seeds
    with vLLM 0.25.1's fixes, kvtier.testing.vllm_fixes, and their engine core in-process)
    --write-only: write the model folder and print the engine arguments (no engine)

Default engine settings (CUDA graphs on); ``--enforce-eager`` turns them off, which changes
every ratio (eager decode steps are several times slower).

Llama-3.1-8B shape with dummy weights (bf16), 8 prefixes of 16,384 tokens, 6 requests each
with a unique 1,024-token suffix, 32 output tokens, requests in round-robin order, HBM prefix
cache limited to 2,600 blocks of 16 tokens (about two prefixes). All requests are submitted
at once (vLLM schedules them first come, first served). Reports wall time, input tok/s,
prompt tokens served from cache and per-request greedy tokens (to compare configurations).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any

from kvtier.bench.offline_engine import settings

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

# Per model: the HBM budget of the ``hbm``/``kvtier``/``native`` runs (about two prefixes'
# KV and state, as in design §3) and of ``big`` (every prefix stays), in vLLM blocks.
# Kimi-Linear at 27 layers (20 KDA + 7 MLA, kvtier.testing.seed_models.kimi_linear): vLLM
# 0.25.1 makes 4 KV-cache groups of 7 layers (1 MLA, 3 KDA) with 1,888-token blocks of
# 2,174,976 bytes per layer (15.2 MB per block id over the 7 tensors). A 17,408-token request
# holds 10 MLA blocks and, in ``align`` mode, one KDA block per group at each forward step's
# end (chunked prefill of 8,192 tokens ends steps every 4 blocks): about 19 block ids; its
# cached prefix keeps the 8 MLA blocks and the KDA states at the step ends.
#
# The sparse seeds (kvtier.testing.seed_models) at their real hidden size, layer count and
# cache geometry, 8 experts: one KV-cache group each, a 17,440-token request (prefix, suffix,
# output) holding 137 blocks of 128 (MiniMax-M3) or 273 of 64 (DSA). ``hbm`` holds about 2.4
# requests as Llama's 2,600 blocks of 16 do (41,600 tokens), ``big`` 192,000 tokens as
# Llama's 12,000 do. Bytes per block over every layer: M3 9.73 MB (60 fp8 K/V pages of
# 131,072 B, 57 bf16 index pages of 32,768 B), GLM 3.93 MB (78 x (656 + 132) x 64 B), V3.2
# 5.01 MB (61 x (1,152 + 132) x 64 B); dummy weights about 73, 80 and 73 GB.
# ``max_num_seqs`` 16 as for Kimi-Linear: CUDA graphs for batches up to 32 only, a shorter
# start-up.
SPARSE_SEEDS = {"minimax-m3": "minimax_m3", "glm-dsa": "glm_moe_dsa",
                "deepseek-v32": "deepseek_v32"}
MODELS: dict[str, dict] = {
    "llama8b": {"hbm_blocks": 2600, "big_blocks": 12000},
    "kimi-linear": {"hbm_blocks": 48, "big_blocks": 400, "max_num_seqs": 16},
    "minimax-m3": {"hbm_blocks": 330, "big_blocks": 1500, "max_num_seqs": 16,
                   "layers": {"layers": 60, "dense_layers": 3}},
    "glm-dsa": {"hbm_blocks": 650, "big_blocks": 3000, "max_num_seqs": 16,
                "layers": {"layers": 78}},
    "deepseek-v32": {"hbm_blocks": 650, "big_blocks": 3000, "max_num_seqs": 16,
                     "layers": {"layers": 61}},
}


def engine_model(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """The ``LLM(...)`` arguments that choose the model (written to ``--model-dir``, with
    its dtype, block size and the seed's engine arguments) and the prompt vocabulary."""
    max_len = args.prefix_len + args.suffix_len + args.output_len + 256
    if args.tiny:
        from kvtier.testing.models import tiny_llama

        return dict(model=tiny_llama(args.model_dir), dtype="float32", block_size=32), 900
    if args.model == "kimi-linear":
        from kvtier.testing.seed_models import VOCAB, kimi_linear

        return dict(model=kimi_linear(args.model_dir + "-kimi", layers=27, max_len=max_len),
                    dtype="bfloat16", gpu_memory_utilization=0.85), VOCAB - 200
    if args.model in SPARSE_SEEDS:
        from kvtier.testing.seed_models import SEED_MODELS, VOCAB

        seed = SEED_MODELS[SPARSE_SEEDS[args.model]]
        folder = seed.write(f"{args.model_dir}-{args.model}", max_len=max_len,
                            **MODELS[args.model]["layers"])
        # copied: vLLM writes into the dicts it is given (attention_config here)
        return dict(model=folder, dtype="bfloat16", gpu_memory_utilization=0.85,
                    **copy.deepcopy(seed.engine_args)), VOCAB - 200
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_restore_check import llama8b

    return dict(model=llama8b(args.model_dir), dtype="bfloat16", block_size=16,
                gpu_memory_utilization=0.85), 120000


class PhaseWatch:
    """Per phase of ``--verify-ab``: each load's park-to-release time (kvtier's own
    ``SchedulerTimings.loads_ended``, observed beside the metrics) and the time between
    successive ``schedule()`` calls (one engine step). Needs the in-process engine core
    (VLLM_ENABLE_V1_MULTIPROCESSING=0); without it the summary is empty."""

    def __init__(self, llm: object) -> None:
        self.waits: list[float] = []
        self.steps: list[float] = []
        self._last: float | None = None
        try:
            sched = llm.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
        except AttributeError:
            return
        timings = sched.connector.timings
        ended, schedule = timings.loads_ended, sched.schedule

        def loads_ended(req_ids):  # type: ignore[no-untyped-def]
            req_ids = list(req_ids)
            now = timings.clock()
            self.waits += [now - timings._load_started[r] for r in req_ids
                           if r in timings._load_started]
            return ended(req_ids)

        def timed_schedule(*a, **kw):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            if self._last is not None:
                self.steps.append(now - self._last)
            self._last = now
            return schedule(*a, **kw)

        timings.loads_ended = loads_ended
        sched.schedule = timed_schedule

    def start(self) -> None:
        self.waits, self.steps, self._last = [], [], None

    def summary(self) -> dict:
        def q(xs: list[float], f: float) -> float | None:
            return round(1000 * sorted(xs)[min(len(xs) - 1, int(f * len(xs)))], 2) if xs else None

        return {"loads": len(self.waits), "load_wait_p50_ms": q(self.waits, 0.5),
                "load_wait_p99_ms": q(self.waits, 0.99),
                "load_wait_mean_ms": round(1000 * sum(self.waits) / len(self.waits), 2)
                if self.waits else None,
                "steps": len(self.steps), "step_p50_ms": q(self.steps, 0.5),
                "step_mean_ms": round(1000 * sum(self.steps) / len(self.steps), 3)
                if self.steps else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with each model's defaults (``MODELS``) filled in."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=["hbm", "big", "kvtier", "native"], required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=16384)
    ap.add_argument("--per-prefix", type=int, default=6)
    ap.add_argument("--suffix-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--hbm-blocks", type=int, default=None,
                    help="HBM prefix-cache blocks (default: the model's, MODELS)")
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA graphs off")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="vLLM's synchronous scheduler (what kvtier's layerwise_loads needs)")
    ap.add_argument("--dram-gib", type=int, default=48)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", default="/tmp/llama8b-shape")
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 model (CPU dry run)")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama8b",
                    help="llama8b (default), or a seed at its real hidden size and layer "
                         "count: kimi-linear, minimax-m3, glm-dsa, deepseek-v32")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--verify-ab", type=int, default=0, metavar="N",
                    help="kvtier: N pairs of phases in this one process, verified restores "
                         "off then on (kvtier.testing.verify_switch), fresh prompts each")
    ap.add_argument("--kvtier-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a kvtier setting for the kvtier runs (repeatable; JSON values)")
    ap.add_argument("--write-only", action="store_true",
                    help="write the model folder, print the engine arguments, stop")
    args = ap.parse_args(argv)
    spec = MODELS[args.model]
    if args.hbm_blocks is None:
        args.hbm_blocks = spec["big_blocks"] if args.config == "big" else spec["hbm_blocks"]
    if args.max_num_seqs is None:
        args.max_num_seqs = spec.get("max_num_seqs")
    return args


def engine_kwargs(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """Every ``LLM(...)`` argument of the run (the model's, the configuration's connector or
    native offloading, the HBM budget) and the prompt vocabulary."""
    from vllm.config import KVTransferConfig

    kw, vocab = engine_model(args)
    if args.config == "kvtier":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"dram_size": f"{args.dram_gib}GiB",
                                       **settings(args.kvtier_config)})
    elif args.config == "native":
        kw["kv_offloading_size"] = float(args.dram_gib)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.no_async_scheduling:
        kw["async_scheduling"] = False
    kw.update(load_format="dummy", skip_tokenizer_init=True, seed=0,
              enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp,
              max_model_len=args.prefix_len + args.suffix_len + args.output_len + 256,
              num_gpu_blocks_override=args.hbm_blocks, max_num_batched_tokens=8192,
              enable_prefix_caching=True)
    return kw, vocab


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_only:
        kw, _ = engine_kwargs(args)
        print(json.dumps(kw, default=str, sort_keys=True))
        return 0
    if args.model in SPARSE_SEEDS:
        # kvtier.testing.vllm_fixes patches vLLM's classes in this process: they reach the
        # worker only with the engine core (and its uni-process executor) in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kvtier.testing.triton_autotune import limit_autotune

    # GPU_TOOLS_AUTOTUNE_KEEP, before vLLM imports its Triton kernels; it reaches the
    # engine only when the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    limit_autotune()
    from gpu_bare_run import apply_vllm_fixes
    from vllm import LLM, SamplingParams

    fixes = apply_vllm_fixes()  # the 0.25.1 fixes (none on other versions), recorded below
    kw, vocab = engine_kwargs(args)
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0

    def toks(n: int, seed: int) -> list[int]:
        return [(seed * 7919 + 31 * i + (i * i) % 97) % vocab + 100 for i in range(n)]

    def workload(phase: int) -> list[dict]:
        """The requests of the run; phase 0 is the reference workload, others use fresh
        prefixes and suffixes (nothing of one phase hits another's)."""
        off = 10000 * phase
        prefixes = [toks(args.prefix_len, 1000 + off + p) for p in range(args.prefixes)]
        out = []
        for r in range(args.per_prefix):
            for p in range(args.prefixes):
                out.append({"prompt_token_ids":
                            prefixes[p] + toks(args.suffix_len, off + 100 * r + p + 1)})
        return out

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False,
                            temperature=0.0)
    # warm-up on unrelated prompts (kernels, allocator), not timed; for the hybrid model as
    # long as the run's (its FLA kernels compile and autotune at first use of each shape)
    # (and the sparse seeds: their Triton and DeepGEMM kernels compile at first use too)
    warm = ([toks(args.prefix_len + args.suffix_len, 7 + i) for i in range(2)]
            if args.model != "llama8b" and not args.tiny else [toks(512, 7)])
    llm.generate([{"prompt_token_ids": w} for w in warm], params, use_tqdm=False)
    llm.reset_prefix_cache()
    phases: list[dict] = []
    if args.verify_ab:
        from kvtier.testing.verify_switch import rpc_set_verify

        watch = PhaseWatch(llm)
        for i in range(2 * args.verify_ab):
            on = i % 2 == 1
            switched = llm.collective_rpc(rpc_set_verify, args=(on,))
            llm.reset_prefix_cache()
            watch.start()
            t = time.time()
            llm.generate(workload(1 + i), params, use_tqdm=False)
            phases.append({"verify": on, "wall_s": time.time() - t, "switched": switched,
                           **watch.summary()})
            print(f"phase {i}: verify {'on' if on else 'off'}: {phases[-1]['wall_s']:.2f} s, "
                  f"park-to-release p50 {phases[-1].get('load_wait_p50_ms')} ms p99 "
                  f"{phases[-1].get('load_wait_p99_ms')} ms over {phases[-1].get('loads')} loads, "
                  f"step p50 {phases[-1].get('step_p50_ms')} ms (of {phases[-1].get('steps')})",
                  flush=True)
        llm.collective_rpc(rpc_set_verify, args=(True,))
        llm.reset_prefix_cache()
    prompts = workload(0)
    t = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.time() - t
    n_in = sum(len(p["prompt_token_ids"]) for p in prompts)
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    ttfts = []
    for o in outs:
        m = getattr(o, "metrics", None)
        first = getattr(m, "first_token_ts", None) or getattr(m, "first_token_time", None)
        arrival = getattr(m, "arrival_time", None)
        if first and arrival:
            ttfts.append(first - arrival)
    res = {
        "config": args.config, "model": args.model, "tp": args.tp,
        "kvtier_config": settings(args.kvtier_config), "hbm_blocks": args.hbm_blocks,
        "async_scheduling": not args.no_async_scheduling,
        "enforce_eager": args.enforce_eager, "vllm": __import__("vllm").__version__,
        "vllm_fixes": fixes,
        "engine_start_s": start_s, "wall_s": wall, "input_tokens": n_in,
        "input_tok_per_s": n_in / wall, "cached_prompt_tokens": cached,
        "repeated_prefix_tokens": args.prefix_len * args.prefixes * (args.per_prefix - 1),
        "ttft_s": ttfts, "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "verify_ab": phases,
    }
    if args.config == "kvtier":
        try:  # the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): kvtier's counters
            connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
            sched = connector.scheduler_side.scheduler
            st = sched.stats
            res["kvtier"] = {
                "hit_tokens": st.hit_tokens, "loaded_tokens": st.loaded_tokens,
                "loads_ok": st.loads_ok, "loads_failed": st.loads_failed,
                "checksum_failures": getattr(st, "checksum_failures", None),
                "declined": dict(st.declined), "saves_planned": st.saves_planned,
                "saves_committed": st.saves_committed, "saves_dropped": dict(st.saves_dropped),
                "evictions": sched.index.evictions, "link_gbps_estimate": sched.estimates.link_gbps,
                "prefill_s_per_token_estimate": sched.estimates.prefill_seconds_per_token,
                "step_s_estimate": sched.estimates.step_seconds,
            }
            admission = connector.scheduler_side.admission
            if admission is not None:  # cache_aware_admission: its deferrals, by reason
                res["kvtier"].update(admission.counters())
            print("kvtier:", res["kvtier"], flush=True)
        except AttributeError as e:
            print("kvtier stats unavailable:", e)
    with open(args.out, "w") as f:
        json.dump(res, f)
    print(f"{args.config}: wall {wall:.1f} s, {n_in / wall:,.0f} input tok/s, cached {cached:,}"
          f" prompt tokens, engine start {start_s:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

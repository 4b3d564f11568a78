"""One configuration of the offline reference run in this process (``kvtier bench offline``
starts one per configuration): the shared-prefix workload of docs/design.md §3 on one
in-process vLLM engine with dummy weights, every request submitted at once.

    python -m kvtier.bench.offline_engine --config kvtier --shape llama8b --out kvtier.json

Configurations (:data:`CONFIGS`): ``hbm`` (vLLM's prefix cache in ``--hbm-blocks``), ``big``
(the shape's ``big_blocks``: every prefix stays), ``native`` (vLLM's OffloadingConnector,
``kv_offloading_size``), ``kvtier``, ``kvtier-null-copy`` (kvtier with
:class:`kvtier.testing.null_copy.NullCopyConnector`: its decisions and parks, no bytes moved;
its tokens are not the model's), ``kvtier-layerwise`` (kvtier with ``layerwise_loads``: hits
restored inside the step that computes the rest of the prompt, never parked). Writes one JSON: wall time, engine start, per-request greedy
tokens, per-request timelines and the seconds per category (:mod:`kvtier.bench.steps`), park
lengths, kvtier's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

CONFIGS = ("hbm", "big", "native", "kvtier", "kvtier-null-copy", "kvtier-layerwise")
DEFAULT_CONFIGS = CONFIGS[:5]  # the reference set; kvtier-layerwise when asked for

# The reference shapes (issue 15): per shape, the model config, vLLM block size, the HBM
# budget of hbm/native/kvtier (about two prefixes) and of big (every prefix stays), in blocks.
SHAPES: dict[str, dict[str, Any]] = {
    "llama8b": {"block_size": 16, "hbm_blocks": 2600, "big_blocks": 12000, "vocab": 120000,
                "dtype": "bfloat16"},
    "deepseek-v2-lite": {"block_size": 64, "hbm_blocks": 560, "big_blocks": 3000,
                         "vocab": 100000, "dtype": "bfloat16"},
    "tiny": {"block_size": 32, "hbm_blocks": 40, "big_blocks": 400, "vocab": 900,
             "dtype": "float32"},
}


def model_config(shape: str) -> dict[str, Any]:
    """The config.json of a shape (dummy weights: only the geometry matters)."""
    common = {"rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1,
              "eos_token_id": 2, "tie_word_embeddings": False}
    if shape == "llama8b":
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
                "max_position_embeddings": 131072, "rope_theta": 500000.0}
    if shape == "deepseek-v2-lite":  # DeepSeek-V2-Lite's config.json (MLA, 64 experts)
        return {**common, "architectures": ["DeepseekV2ForCausalLM"],
                "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
                "moe_intermediate_size": 1408, "num_attention_heads": 16,
                "num_key_value_heads": 16, "num_hidden_layers": 27, "vocab_size": 102400,
                "max_position_embeddings": 163840, "kv_lora_rank": 512, "q_lora_rank": None,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1,
                "topk_group": 1, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
                "topk_method": "greedy", "norm_topk_prob": False, "rope_theta": 10000.0,
                "attention_bias": False, "rms_norm_eps": 1e-6}
    raise ValueError(f"unknown shape {shape!r}")


def model_dir(shape: str, root: str) -> str:
    from kvtier.testing.models import _write, tiny_llama

    path = os.path.join(root, f"kvtier-bench-{shape}")
    if shape == "tiny":
        return tiny_llama(path)
    return _write(path, model_config(shape))


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload and engine flags, shared with ``kvtier bench offline``."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=16384)
    p.add_argument("--per-prefix", type=int, default=6)
    p.add_argument("--suffix-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--unique", action="store_true",
                   help="every prompt unique (no reuse): the no-reuse control")
    p.add_argument("--hbm-blocks", type=int, default=None,
                   help="HBM blocks of hbm/native/kvtier (default: the shape's)")
    p.add_argument("--big-blocks", type=int, default=None,
                   help="HBM blocks of big (default: the shape's)")
    p.add_argument("--dram-gib", type=float, default=48.0,
                   help="host memory of native and kvtier, GiB")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true", help="CUDA graphs off")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="vLLM's synchronous scheduler in every run (where a failed "
                   "kvtier-layerwise load is recomputed rather than fatal; the others are "
                   "measured beside it under the same scheduler)")
    p.add_argument("--kvtier-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a kvtier setting of the kvtier runs (repeatable; JSON values)")
    p.add_argument("--model-root", default="/tmp", help="where the dummy model folders go")


def settings(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as kvtier settings; a value is JSON where it parses (true, 3,
    "x"), else the string itself (64GiB). Also used by tools/gpu_shared_prefix.py."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def toks(n: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + 31 * i + (i * i) % 97) % vocab + 100 for i in range(n)]


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Requests in round-robin order over the prefixes, each with its own suffix."""
    prefixes = [toks(args.prefix_len, 1000 + p, vocab) for p in range(args.prefixes)]
    out = []
    for r in range(args.per_prefix):
        for p in range(args.prefixes):
            prefix = (toks(args.prefix_len, 50000 + 100 * r + p, vocab) if args.unique
                      else prefixes[p])
            out.append(prefix + toks(args.suffix_len, 100 * r + p + 1, vocab))
    return out


def measured_link_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float | None:
    """This machine's pinned host-to-device copy rate in GB/s (None without CUDA).

    kvtier's planner starts from the ``link_gbps`` setting (20 GB/s) and learns the link
    from its own transfers; null-copy moves no bytes and reports them at that setting, so
    without this its load-or-recompute decisions would be those of a slower link than the
    run it is the floor of (H200 session 16: 5 hits declined as cheaper to recompute that
    kvtier restored). Every kvtier-family run therefore starts from the measured rate."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del host, dev
    torch.cuda.empty_cache()
    return nbytes * reps / seconds / 1e9


def engine_args(args: argparse.Namespace, link_gbps: float | None = None
                ) -> dict[str, Any]:
    """vLLM's engine arguments of ``args.config``; ``link_gbps``: the measured link, the
    planner's starting estimate in kvtier-family runs (:func:`measured_link_gbps`) unless
    ``--kvtier-set link_gbps=...`` says otherwise."""
    from vllm.config import KVTransferConfig

    shape = SHAPES[args.shape]
    blocks = (args.big_blocks or shape["big_blocks"]) if args.config == "big" else (
        args.hbm_blocks or shape["hbm_blocks"])
    kw: dict[str, Any] = dict(
        model=model_dir(args.shape, args.model_root), dtype=shape["dtype"],
        block_size=shape["block_size"], load_format="dummy", skip_tokenizer_init=True, seed=0,
        enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp,
        max_model_len=args.prefix_len + args.suffix_len + args.output_len + shape["block_size"],
        num_gpu_blocks_override=blocks, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True)
    if args.no_async_scheduling:
        kw["async_scheduling"] = False
    if args.shape != "tiny":
        kw["gpu_memory_utilization"] = 0.85
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.config.startswith("kvtier"):
        null = args.config == "kvtier-null-copy"
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NullCopyConnector" if null else "KvtierConnector",
            kv_connector_module_path="kvtier.testing.null_copy" if null
            else "kvtier.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"dram_size": f"{args.dram_gib:g}GiB",
                                       **({"link_gbps": round(link_gbps, 1)}
                                          if link_gbps else {}),
                                       **settings(args.kvtier_set),
                                       **({"layerwise_loads": True}
                                          if args.config == "kvtier-layerwise" else {})})
    elif args.config == "native":
        kw["kv_offloading_size"] = float(args.dram_gib)
    return kw


def kvtier_counters(engine_core: Any) -> dict[str, Any] | None:
    conn = getattr(engine_core.scheduler, "connector", None)
    side = getattr(conn, "scheduler_side", None)
    sched = getattr(side, "scheduler", None)
    if sched is None:
        return None
    st = sched.stats
    admission = getattr(side, "admission", None)
    deferred = admission.counters() if admission is not None else {}
    return {**deferred, "hit_tokens": st.hit_tokens, "loaded_tokens": st.loaded_tokens,
            "loads_ok": st.loads_ok, "loads_failed": st.loads_failed,
            "declined": dict(st.declined), "saves_planned": st.saves_planned,
            "saves_committed": st.saves_committed, "saves_dropped": dict(st.saves_dropped),
            "evictions": sched.index.evictions,
            "link_gbps_estimate": sched.estimates.link_gbps,
            "step_s_estimate": sched.estimates.step_seconds}


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # only a label
        return "unknown"


def _line_of(lines: dict[str, Any], external_id: str) -> dict[str, Any]:
    """A request's timeline by the id its output carries (0.32's scheduler knows it as
    ``ID-<8 random characters>``, 0.25.1's as ``ID``)."""
    if external_id in lines:
        return lines[external_id]
    found = [v for k, v in lines.items() if k.rsplit("-", 1)[0] == external_id]
    return found[0] if len(found) == 1 else {}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    from kvtier.bench import steps as st

    vocab = SHAPES[args.shape]["vocab"]
    kw = engine_args(args, measured_link_gbps() if args.config.startswith("kvtier") else None)
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    core = llm.llm_engine.engine_core.engine_core
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False,
                            temperature=0.0)
    # warm-up on an unrelated prompt (kernels, allocator), not timed
    llm.generate([{"prompt_token_ids": toks(min(512, args.prefix_len), 7, vocab)}], params,
                 use_tqdm=False)
    llm.reset_prefix_cache()
    rec = st.StepRecorder()
    wconn = get_kv_transfer_group() if has_kv_transfer_group() else None
    side = getattr(wconn, "worker_side", None)
    rec.install(core, wconn, getattr(side, "worker", None))
    prompts = workload(args, vocab)
    rec.reset()
    t = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.time() - t
    lines = st.timelines(rec.steps)
    ids = [o.request_id for o in outs]
    res: dict[str, Any] = {
        "config": args.config, "shape": args.shape, "vllm": vllm.__version__,
        "device": device_name(), "engine_args": {k: str(v) for k, v in kw.items()},
        "engine_start_s": start_s, "wall_s": wall, "requests": len(prompts),
        "input_tokens": sum(map(len, prompts)),
        "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        "request_ids": ids, "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "timelines": [_line_of(lines, r) for r in ids], "park_steps": st.park_steps(lines),
        "phase_means_s": st.phase_totals(lines),
        "categories_s": st.categories(rec.steps, wall), "steps": st.steps_json(rec.steps),
        "kvtier": kvtier_counters(core),
    }
    for s in res["steps"]:
        s.pop("phases")
    res["step_kinds"] = st.step_kinds(res["steps"])
    if args.config == "kvtier-null-copy":
        from kvtier.testing.null_copy import rpc_null_copy_steps

        res["null_copy"] = llm.collective_rpc(rpc_null_copy_steps)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.offline_engine")
    p.add_argument("--config", choices=CONFIGS, required=True)
    p.add_argument("--out", required=True)
    add_workload_arguments(p)
    args = p.parse_args(argv)
    # set here, not at import: ``kvtier bench`` imports this module for its flags
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the recorder needs the engine core
    res = run(args)
    with open(args.out, "w") as f:
        json.dump(res, f)
    print(f"{args.config}: wall {res['wall_s']:.2f} s, cached {res['cached_prompt_tokens']:,} "
          f"prompt tokens, parks {res['park_steps']}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

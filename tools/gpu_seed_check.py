"""The restore check with kvtier on a seed architecture (issues 13 and 14), vLLM 0.25.1 on the H200.

    PYTHONPATH=<site dir of vLLM 0.25.1>:src VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python tools/gpu_seed_check.py --arch kimi_linear --out $OUT/seed

One process per engine, all driven from this one command:

1. **kvtier** (``kvtier.testing.probe.ProbeConnector``): the registration census kvtier logs
   (groups, segments, state objects, dtypes, bytes per block, the chunk), then
   :func:`kvtier.testing.restore.restore_check` on a long prompt (three chunks + 5 tokens)
   and on two prompts sharing two chunks, one at a time (``shared_single``, part of the
   verdict) and in one batch (``shared_batch``, a report: see ``CHECKS``): run A computes,
   run C hits vLLM's own prefix cache at the same boundary, then the prefix cache is reset
   and every registered tensor (KV and state) overwritten with a fill pattern, and run B
   restores from kvtier. Passes only if
   kvtier restored exactly the whole-chunk prefixes, block checksums read through vLLM's
   block table match, and B's greedy tokens and top-5 logprobs equal C's bit for bit.
2. **cold** (no connector, prefix caching off): the same prompts computed from scratch; B's
   tokens and logprobs are compared with these too.
3. **negative controls** (``--negative NAME``, repeatable; each its own kvtier process):
   the same check with a ``kvtier.testing`` fault that leaves part of every restore out
   (``kvtier.testing.negative``); each must make the check fail.

Writes ``<arch>.json`` (and one per control) under ``--out`` and prints one line per check.
``--cpu`` runs it on vLLM's CPU build (0.32; Qwen3-Next there), for a dry run of the tool;
``--write-only`` (any architecture, no engine) runs each engine's set-up up to ``LLM(...)``
(scripts/check_gpu_scripts.sh runs it for every seed).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test-only worker rpcs
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
# kvtier's chunk on the H200 with vLLM 0.25.1 (the block size vLLM chose to equalize page
# sizes, bench/results/2026-12-01-bare-gpu-h200-vllm025/run2), so the cold reference can run
# first; a run records the chunk it found, and --chunk overrides
# DSA and MiniMax-M3: chunk 1,024 (a multiple of their blocks, 64 and 128) so that every
# prompt (the long one: 3 chunks + 5; the shared ones: 2 chunks + 519 / + 1,027) is longer
# than what the indexer selects (DSA's top 2,048 keys, M3's top 16 blocks of 128) and the
# index cache's bytes decide what is attended (at 773 tokens every key is, and the indexer
# control changed only checksums; H200 2026-12-01)
GPU_CHUNKS = {"kimi_linear": 1888, "qwen3_next": 544, "deepseek_v32": 1024,
              "glm_moe_dsa": 1024, "minimax_m3": 1024, "deepseek_v3_mtp": 256}
# Recurrent-state families: with prefix caching on, vLLM's ``align`` mode ends a prefill step
# at the last block boundary (the long prompt: 3 chunks, then 5 tokens), where a cold engine
# computes the prompt in one step and its scans sum in another order. Their cold reference
# therefore runs with a step budget of 3 chunks, so its long prompt's steps end where the
# cached runs' do (a recompute with prefix caching off, split as the cached runs split).
STATE_ARCHS = {"kimi_linear", "qwen3_next"}


# The checks, in order: the long prompt; the two prompts sharing two chunks one at a time (the
# shared chunks restored for each on its own: bit-equal to the HBM hit where kernels are not
# batch-invariant); the same two restored in one batch (a report: B's requests leave their
# parked loads in other steps than C's hits, so they are batched differently and bf16 kernels
# give other last bits; H200, 2026-12-01). The verdict is the first two.
CHECKS = ("long", "shared_single", "shared_batch")
VERDICT = ("long", "shared_single")
ONE_AT_A_TIME = {"shared_single"}


def prompts_for(chunk: int, vocab: int, spec_tokens: int = 0) -> dict[str, list[list[int]]]:
    """A long prompt of three chunks + 5 tokens, and two prompts sharing two chunks and
    differing right after them, each three chunks + a tail shorter than any block (7 and 3
    tokens), so that vLLM's own HBM hit (whole blocks) ends where kvtier's restore (whole
    chunks) does: with a tail of half a chunk, run C hit blocks past the chunk boundary and
    computed fewer tokens than run B.

    With ``spec_tokens`` draft tokens (MTP, eagle) every tail is longer than vLLM's decode
    threshold (1 + ``spec_tokens``): vLLM drops the last block of a draft model's HBM hit, so
    run C computes a block and a tail while run B computes the tail alone, and MLA backends
    run a step of at most that many tokens through their decode kernel, other arithmetic than
    the prefill kernel that computes C's step (vLLM 0.25.1: ``_init_reorder_batch_threshold``
    in ``v1/attention/backend.py``, called with spec-as-decode by the MLA builders of
    ``model_executor/layers/attention/mla_attention.py``; FLASH_ATTN_MLA takes varlen). On
    the H200 (2026-12-02) the 3-token tail of the MTP model's second shared prompt made B's
    logprobs differ from C's, C2's and CF's with every restored byte equal, while the 7-token
    tail of the first was bit-equal."""
    short = max(3, spec_tokens + 2)

    def toks(n: int, seed: int) -> list[int]:
        return [(seed * 7919 + 31 * i + (i * i) % 97) % (vocab - 200) + 100 for i in range(n)]

    def pair(seed: int) -> list[list[int]]:
        shared = toks(2 * chunk, seed)
        return [shared + toks(chunk + max(7, short + 2), seed + 1),
                shared + toks(chunk + short, seed + 2)]

    # other tokens for each check, so that each one's run A computes (kvtier holds nothing
    # of them yet) instead of loading an earlier check's chunks
    return {"long": [toks(3 * chunk + max(5, short), 1)], "shared_single": pair(2),
            "shared_batch": pair(5)}


def spec_tokens(arch: str) -> int:
    """The seed's draft tokens per step (0 without speculative decoding)."""
    from kvtier.testing.seed_models import SEED_MODELS

    spec = SEED_MODELS[arch].engine_args.get("speculative_config") or {}
    return int(spec.get("num_speculative_tokens", 0))


def engine_kwargs(args: argparse.Namespace, folder: str, mode: str) -> dict[str, Any]:
    from kvtier.testing.seed_models import SEED_MODELS

    kw: dict[str, Any] = dict(model=folder, load_format="dummy", skip_tokenizer_init=True,
                              seed=0, max_model_len=args.max_model_len, max_num_seqs=8,
                              enable_prefix_caching=mode != "cold", enforce_eager=args.eager)
    kw.update(copy.deepcopy(SEED_MODELS[args.arch].engine_args))
    if "speculative_config" in kw:  # the acceptance counters (spec_decode below) need stats
        kw["disable_log_stats"] = False
    if args.cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        kw.update(dtype="bfloat16", max_num_batched_tokens=2048)
        if mode != "cold":
            kw["mamba_cache_mode"] = "align"
    else:
        # an explicit KV size: with several engines starting at once on one GPU, vLLM's
        # profiling of free memory under gpu_memory_utilization alone comes out at nothing
        kw.update(gpu_memory_utilization=args.gpu_mem, max_num_batched_tokens=8192,
                  kv_cache_memory_bytes=4 << 30)
        if args.arch in STATE_ARCHS and args.chunk:
            # the cold engine's steps end where the cached runs' do (STATE_ARCHS above); the
            # kvtier engine gets the same budget, since torch.compile's compile range and the
            # CUDA-graph sizes follow it and may pick other kernels (sessions 2-5: vLLM's own
            # hit never equalled the cold run on Kimi-Linear, the budgets differed)
            kw["max_num_batched_tokens"] = 3 * args.chunk
    if mode != "cold":
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ProbeConnector", kv_connector_module_path="kvtier.testing.probe",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"dram_size": args.dram, "cost_model": False,
                                       **({"chunk_tokens": args.chunk} if args.chunk else {})})
    return kw


NEGATIVE_CONTROLS = {
    # name -> (module in kvtier.testing, rpc run on every worker with args (True,))
    "skip_state": ("kvtier.testing.probe", "rpc_skip_state_loads"),
    # bytes inside the blocks (kvtier.testing.controls): issue 14's families
    "indexer": ("kvtier.testing.controls", "rpc_mask_indexer"),
    "draft_layers": ("kvtier.testing.controls", "rpc_mask_draft_layers"),
    "fp8_ds_mla_scales": ("kvtier.testing.controls", "rpc_mask_fp8_ds_mla_scales"),
}


def negative_rpc(name: str) -> Any:
    """The worker rpc of negative control ``name`` (``NEGATIVE_CONTROLS``)."""
    import importlib

    module, fn = NEGATIVE_CONTROLS[name]
    return getattr(importlib.import_module(module), fn)


def write_model(args: argparse.Namespace) -> str:
    """The seed's model folder, its position limit at least the engine's max_model_len."""
    from kvtier.testing.seed_models import SEED_MODELS

    path = os.path.join(args.model_root, f"{args.arch}-{args.max_model_len}")
    return SEED_MODELS[args.arch].write(path, max_len=args.max_model_len)


def run_engine(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One engine process: ``cold`` (the prompts from scratch, prefix caching off; writes the
    reference) or ``kvtier`` (the check against C and the cold reference, optionally under a
    negative control)."""
    from kvtier.testing.triton_autotune import limit_autotune

    limit_autotune()  # GPU_TOOLS_AUTOTUNE_KEEP, before vLLM imports its Triton kernels
    from vllm import LLM, SamplingParams

    from kvtier.testing.reference import Generated, cold_reference
    from kvtier.testing.restore import handles, restore_check, sharpen_dummy_weights
    from kvtier.testing.seed_models import SEED_MODELS, VOCAB

    sys.path.insert(0, HERE)
    from gpu_bare_run import apply_vllm_fixes

    folder = write_model(args)
    res: dict[str, Any] = {"arch": args.arch, "mode": mode, "negative": args.negative,
                           "vllm": __import__("vllm").__version__,
                           "vllm_fixes": [] if args.cpu else apply_vllm_fixes()}
    kw = engine_kwargs(args, folder, mode)
    if args.write_only:  # everything up to the engine's start, and the control's rpc
        if args.negative:
            negative_rpc(args.negative)
        return {**res, "engine_kwargs": kw}
    t0 = time.time()
    llm = LLM(**kw)
    res["engine_start_s"] = round(time.time() - t0, 1)
    params = SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False, temperature=0.0,
                            logprobs=5)
    if mode == "cold":
        sharpen_dummy_weights(llm)
        for name, prompts in prompts_for(args.chunk, VOCAB, spec_tokens(args.arch)).items():
            res[name] = [g.to_json() for g in cold_reference(
                llm, prompts, params, one_at_a_time=name in ONE_AT_A_TIME)]
        return res
    h = handles(llm)
    sharpen_dummy_weights(h)
    res["census"] = census(h)
    cold = {}
    if args.cold and wait_for(args.cold, args.timeout / 2):
        with open(args.cold) as f:
            ref = json.load(f)
        cold = {n: [Generated.from_json(g) for g in ref[n]] for n in CHECKS if n in ref}
    if args.negative:
        res["negative_rpc"] = llm.collective_rpc(negative_rpc(args.negative), args=(True,))
    res["chunk_tokens"] = h.kvtier.geometry.chunk_tokens
    for name, prompts in prompts_for(args.chunk or h.kvtier.geometry.chunk_tokens, VOCAB,
                                    spec_tokens(args.arch)).items():
        t = time.time()
        try:
            r = restore_check(h, prompts, params, cold=cold.get(name),
                              one_at_a_time=name in ONE_AT_A_TIME, hit_controls=True)
        except Exception as e:  # a crash is a result (reported, and a failed check)
            res[name] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
            print(f"{args.arch} {name}: FAILED with {type(e).__name__}: {e}", flush=True)
            continue
        res[name] = {**r.to_json(), "seconds": round(time.time() - t, 2)}
        print(f"{args.arch} {name}: strict {'PASSED' if r.passed else 'FAILED'}, held to "
              f"vLLM's own cache {'PASSED' if r.passed_where_vllm_is_exact else 'FAILED'}; "
              f"restored {r.restored_tokens}/{r.expected_restored}, cold compared: "
              f"{r.cold_checked}; per prompt: "
              + "; ".join(f"{p.prompt_len} tokens: {p.why_failed or 'all equal'}"
                          f" (C2 = C: {p.hbm_hit_repeatable}, CF = C: {p.hbm_hit_fill_equal},"
                          f" C's bytes = A's: {p.hbm_hit_bytes_equal},"
                          f" blocks {p.blocks_compared})"
                          for p in r.prompts),
              flush=True)
    if not args.negative:  # a report beside the verdict: the same long check, zeros filled
        res["long_fill_zero"] = fill_zero_check(h, args, params, cold.get("long"))
    res["kvtier_stats"] = {k: v for k, v in vars(h.kvtier.stats).items()
                           if isinstance(v, (int, float))}
    if "speculative_config" in SEED_MODELS[args.arch].engine_args:
        res["spec_decode"] = spec_decode_counters(llm)
    return res


def fill_zero_check(h: Any, args: argparse.Namespace, params: Any, cold: Any) -> dict[str, Any]:
    """The long check again with the fill byte 0 (not part of the verdict): where the check
    with the usual fill fails while its checksums are equal and this one passes, the outputs
    depended on bytes no restore writes (H200, 2026-12-01: DeepSeek-V3.2 past its top-k)."""
    from kvtier.testing.restore import restore_check
    from kvtier.testing.seed_models import VOCAB

    long = prompts_for(args.chunk or h.kvtier.geometry.chunk_tokens, VOCAB,
                                    spec_tokens(args.arch))["long"]
    try:
        return restore_check(h, long, params, cold=cold, fill_byte=0).to_json()
    except Exception as e:  # a crash is a result
        return {"passed": False, "error": f"{type(e).__name__}: {e}"}


def spec_decode_counters(llm: Any) -> dict[str, Any]:
    """vLLM's speculative-decoding counters over the engine's life (drafts, draft tokens,
    accepted tokens; the mean acceptance length is 1 + accepted / drafts), or the error."""
    try:
        out = {m.name: m.value for m in llm.get_metrics()
               if "spec_decode" in m.name and hasattr(m, "value")}
    except Exception as e:  # a missing counter is a result, not a crash of the check
        return {"error": f"{type(e).__name__}: {e}"}
    drafts = out.get("vllm:spec_decode_num_drafts") or 0
    accepted = out.get("vllm:spec_decode_num_accepted_tokens") or 0
    out["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return out


def census(h: Any) -> dict[str, Any]:
    """What kvtier made of vLLM's registration: per group its kind, block size, layers and
    bytes per block and per chunk (kvtier's worker logs the same at start-up)."""
    geo = h.kvtier.geometry
    specs = h.scheduler_connector.groups.specs
    groups = []
    for g, (gg, spec) in enumerate(zip(geo.groups, specs)):
        groups.append({"kind": gg.kind.value, "block_size": gg.block_size,
                       "bytes_per_block": gg.bytes_per_block, "layers": len(spec.layer_names),
                       "chunk_bytes": geo.chunk_bytes(g)})
    return {"chunk_tokens": geo.chunk_tokens, "groups": groups}


def spawn(args: argparse.Namespace, mode: str, negative: str | None, path: str,
          cold: str) -> tuple[subprocess.Popen, str, str]:
    """Start one engine process writing ``path``; returns (process, path, log)."""
    argv = [sys.executable, os.path.abspath(__file__), "--arch", args.arch, "--child", mode,
            "--out", args.out, "--model-root", args.model_root, "--dram", args.dram,
            "--max-model-len", str(args.max_model_len), "--gpu-mem", str(args.gpu_mem),
            "--chunk", str(args.chunk), "--cold", cold, "--timeout", str(args.timeout),
            "--result", path]
    argv += ["--cpu"] * args.cpu + ["--eager"] * args.eager
    if negative:
        argv += ["--negative", negative]
    log = path[:-5] + ".log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    return proc, path, log


def collect(proc: subprocess.Popen, path: str, log: str, timeout: float) -> dict:
    """The child's result, or why there is none."""
    try:
        rc: int | str = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    if not os.path.exists(path):
        with open(log) as f:
            tail = f.read()[-3000:]
        return {"rc": rc, "error": "no result", "log": tail}
    with open(path) as f:
        return json.load(f)


def wait_for(path: str, timeout_s: float) -> bool:
    """The cold reference is written by a process started at the same time as this one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(1.0)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", required=True)
    ap.add_argument("--out", required=True, help="folder for the JSON results and logs")
    ap.add_argument("--model-root", default="/tmp/kvtier-seed-models")
    ap.add_argument("--negative", action="append", default=[],
                    help="a negative control of kvtier.testing.negative (repeatable)")
    ap.add_argument("--dram", default="16GiB")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--gpu-mem", type=float, default=0.4)
    ap.add_argument("--chunk", type=int, default=0,
                    help="kvtier's chunk in tokens, if known (else a first kvtier run finds it)")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU build")
    ap.add_argument("--eager", action="store_true", help="CUDA graphs off")
    ap.add_argument("--write-only", action="store_true",
                    help="the dry run of every engine's set-up in this process (model folder, "
                         "imports, engine arguments, each --negative's rpc), no engine; "
                         "writes <arch>_write_only.json")
    ap.add_argument("--child", choices=["kvtier", "cold"], default=None)
    ap.add_argument("--cold", default="", help="the cold reference JSON (set by the driver)")
    ap.add_argument("--result", default="", help="the child's result JSON (set by the driver)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.child:  # one engine, one result file
        args.negative = args.negative[0] if args.negative else None
        res = run_engine(args, args.child)
        name = f"{args.arch}_{args.child}" + (f"_neg_{args.negative}" if args.negative else "")
        _write(args.result or os.path.join(args.out, name + ".json"), res)
        return 0
    base = os.path.join(args.out, args.arch)
    if not args.chunk and not args.cpu:
        args.chunk = GPU_CHUNKS.get(args.arch, 0)
    if args.write_only:
        return write_only(args, base + "_write_only.json")
    summary: dict[str, Any] = {"arch": args.arch}
    if not args.chunk:  # a first kvtier run finds the chunk the prompts are built from
        first = collect(*spawn(args, "kvtier", None, base + "_probe.json", ""), args.timeout)
        args.chunk = int(first.get("chunk_tokens") or 0)
        summary["chunk_probe"] = {k: first.get(k) for k in ("census", "error", "rc", "log")}
    if not args.chunk:
        print(f"{args.arch}: no chunk size (the kvtier engine did not start)", flush=True)
        summary["passed"] = False
        _write(base + ".json", summary)
        return 1
    # every engine at once (the GPU holds them all); the kvtier runs wait for the cold file
    t0 = time.monotonic()
    cold_path = base + "_cold.json"
    runs = {"cold": spawn(args, "cold", None, cold_path, ""),
            "kvtier": spawn(args, "kvtier", None, base + "_kvtier.json", cold_path)}
    for neg in args.negative:
        runs[neg] = spawn(args, "kvtier", neg, base + f"_kvtier_neg_{neg}.json", cold_path)
    res = {k: collect(*v, args.timeout - (time.monotonic() - t0)) for k, v in runs.items()}
    summary["cold"] = {k: v for k, v in res["cold"].items()
                       if k in ("engine_start_s", "error", "rc", "log")}
    args.cold = cold_path if os.path.exists(cold_path) else ""
    kv = res["kvtier"]
    summary["kvtier"] = kv
    summary["negative"] = {}
    for neg in args.negative:
        r = res[neg]
        failed = any(isinstance(r.get(n), dict) and r[n].get("passed") is False
                     for n in VERDICT)
        summary["negative"][neg] = {"check_failed": failed, "as_expected": failed,
                                    "long": r.get("long"), "error": r.get("error")}
    def verdict(key: str) -> bool:
        return all(isinstance(kv.get(n), dict) and kv[n].get(key) and kv[n].get("cold_checked")
                   for n in VERDICT)

    passed = verdict("passed")
    summary["passed"] = passed
    summary["passed_where_vllm_is_exact"] = verdict("passed_where_vllm_is_exact")
    _write(base + ".json", summary)
    print(f"{args.arch}: restore check, strict (B equals C and the cold run D bit for bit): "
          f"{'PASSED' if passed else 'FAILED'}; held to what vLLM's own cache reproduces: "
          f"{'PASSED' if summary['passed_where_vllm_is_exact'] else 'FAILED'} (cold reference: "
          f"{bool(args.cold)}); negative controls failed the check: "
          f"{ {n: v['check_failed'] for n, v in summary['negative'].items()} }", flush=True)
    return 0 if summary["passed_where_vllm_is_exact"] else 1


def write_only(args: argparse.Namespace, path: str) -> int:
    """``--write-only``: each run the driver would spawn (cold, kvtier, one per negative
    control), up to its engine's start, in this process; their engine arguments to ``path``."""
    negatives = args.negative
    runs = []
    for mode, negative in [("cold", None), ("kvtier", None)] + [("kvtier", n) for n in negatives]:
        args.negative = negative
        runs.append(run_engine(args, mode))
    args.negative = negatives
    _write(path, {"arch": args.arch, "chunk": args.chunk, "runs": runs})
    print(f"{args.arch}: {len(runs)} engine set-ups written to {path}", flush=True)
    return 0


def _write(path: str, payload: Any) -> None:
    """Whole or not at all: another process may be waiting for the file."""
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())

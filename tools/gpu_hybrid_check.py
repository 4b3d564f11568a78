"""The restore check with recurrent state for a hybrid model folder (kvtier.testing.restore).

    # on the GPU host (vLLM 0.25.1), a seed architecture or any dummy-weight model folder:
    PYTHONPATH=/tmp/site:src python tools/gpu_hybrid_check.py --seed kimi_linear --out $OUT/k.json
    PYTHONPATH=/tmp/site:src python tools/gpu_hybrid_check.py --model-dir /tmp/m --out $OUT/m.json
    # CPU dry run (vLLM 0.32's CPU build): 4-layer Qwen3-Next, bf16, short prompts
    python tools/gpu_hybrid_check.py --tiny --out /tmp/hybrid.json

1. Run D, the cold reference, in a child process (its engine's memory is gone when the kvtier
   engine starts): same weights (dummy, re-drawn by ``sharpen_dummy_weights``), prefix caching
   off, no connector; each batch generated as the check generates it (vLLM is not
   batch-invariant). Outputs travel as :class:`~kvtier.testing.reference.Generated` JSON.
2. The kvtier engine (``ProbeConnector``, prefix caching on): a registration census (vLLM's
   groups and specs, the registered tensors, kvtier's groups with bytes per block, chunk).
3. Checks, each ``restore_check(h, prompts, params, cold=...)``: ``positive`` (must pass),
   ``negative`` (loads skip their state objects while reporting success: must fail),
   ``failed_load`` (one load fails on rank 0: must recompute to the same output).

Writes one JSON (``--out``) as it goes; prints one line per check; exit 0 only if the positive
check passes, the negative control fails and the failed load recomputes correctly. On vLLM
0.25.1 kvtier turns loads off with several KV-cache groups until multi-group loads land
(src/kvtier/vllm/setup.py): the JSON then shows 0 restored tokens and ``passed`` false.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test-only worker rpcs
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

CHECKS = ("positive", "negative", "failed_load")


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + 31 * i + (i * i) % 97) % (vocab - 100) + 100 for i in range(n)]


def batches(tokens: int, vocab: int) -> dict[str, list[list[int]]]:
    """The prompts of every check, batched as the check runs them."""
    return {"positive": [prompt(tokens + 5, 1, vocab), prompt(tokens // 2 + 9, 2, vocab)],
            "negative": [prompt(tokens + 7, 3, vocab)],
            "failed_load": [prompt(tokens + 3, 4, vocab)]}


def engine_args(args: argparse.Namespace, model: str) -> dict[str, Any]:
    out: dict[str, Any] = dict(model=model, load_format="dummy", skip_tokenizer_init=True,
                               enforce_eager=True, seed=0, max_model_len=args.max_model_len,
                               max_num_seqs=4, dtype="bfloat16")
    if args.seed:
        from kvtier.testing.seed_models import SEED_MODELS

        out.update(SEED_MODELS[args.seed].engine_args)
    if not args.cpu:
        out["gpu_memory_utilization"] = args.gpu_mem
    return out


def greedy() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False, temperature=0.0,
                          logprobs=5)


def cold_child(args: argparse.Namespace, model: str, vocab: int) -> None:
    """Run D; writes {check: [Generated JSON]} to --cold-out."""
    from vllm import LLM

    from kvtier.testing.reference import cold_reference
    from kvtier.testing.restore import sharpen_dummy_weights

    llm = LLM(**engine_args(args, model), enable_prefix_caching=False)
    sharpen_dummy_weights(llm)
    out = {name: [g.to_json() for g in cold_reference(llm, ps, greedy())]
           for name, ps in batches(args.tokens, vocab).items()}
    with open(args.cold_out, "w") as f:
        json.dump(out, f)


def census(h: Any) -> dict[str, Any]:
    from kvtier.testing.census import rpc_census

    worker = h.worker_connector.worker_side.worker if h.worker_connector else None
    kv = {"geometry": str(h.kvtier.geometry)}
    if worker is not None:
        kv["groups"] = [{"kind": g.spec.kind.value, "block_size": g.spec.block_size,
                         "layers": list(g.spec.layer_names), "bytes_per_block": g.bytes_per_block,
                         "segments": [(s.layer, s.role, s.run) for s in g.segments]}
                        for g in worker.layout.groups]
    return {"vllm": h.llm.collective_rpc(rpc_census)[0], "kvtier": kv}


def run_check(h: Any, name: str, prompts: list[list[int]], cold: list[Any]) -> dict[str, Any]:
    from kvtier.testing.probe import rpc_fail_next_loads, rpc_skip_state_loads
    from kvtier.testing.restore import restore_check

    t = time.time()
    if name == "negative":
        h.llm.collective_rpc(rpc_skip_state_loads, args=(True,))
    elif name == "failed_load":
        h.llm.collective_rpc(rpc_fail_next_loads, args=(0, 1))
    try:
        res = restore_check(h, prompts, greedy(), cold=cold)
    finally:
        h.llm.collective_rpc(rpc_skip_state_loads, args=(False,))
        h.llm.reset_prefix_cache()
    out = res.to_json()
    out["seconds"] = time.time() - t
    if name == "positive":
        out["as_expected"] = res.passed
    elif name == "negative":
        out["as_expected"] = not any(p.checksums_equal or p.logprobs_equal
                                     for p in res.prompts)
    else:
        out["as_expected"] = res.loads_failed >= 1 and all(
            p.tokens_equal and p.logprobs_equal and p.tokens_equal_cold
            and p.logprobs_equal_cold for p in res.prompts)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", help="a kvtier.testing.seed_models architecture: its engine "
                    "arguments, and its folder written unless --model-dir has one")
    ap.add_argument("--model-dir", help="a dummy-weight model folder")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: 4-layer Qwen3-Next")
    ap.add_argument("--cpu", action="store_true", help="no GPU memory settings (--tiny sets it)")
    ap.add_argument("--tokens", type=int, default=16384, help="the long prompt (tiny: 2,304)")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--dram-size", default="24GiB")
    ap.add_argument("--out", default="hybrid_check.json")
    ap.add_argument("--cold-out", help=argparse.SUPPRESS)  # the child's output
    args = ap.parse_args(argv)
    if args.tiny:
        args.tokens, args.max_model_len, args.dram_size = 2304, 4096, "256MiB"
        args.seed, args.cpu = "qwen3_next", True
    if not (args.seed or args.model_dir):
        ap.error("give --seed, --model-dir or --tiny")
    workdir = tempfile.mkdtemp(prefix="kvtier-hybrid-")
    model = args.model_dir
    if model is None or not os.path.exists(os.path.join(model, "config.json")):
        from kvtier.testing.seed_models import SEED_MODELS

        model = SEED_MODELS[args.seed].write(model or os.path.join(workdir, args.seed))
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size", 4096))
    if args.cold_out:
        cold_child(args, model, vocab)
        return 0
    return check(args, model, vocab, workdir)


def check(args: argparse.Namespace, model: str, vocab: int, workdir: str) -> int:
    out: dict[str, Any] = {"model": model, "args": vars(args)}

    def dump() -> None:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    cold_path = os.path.join(workdir, "cold.json")
    child = [sys.executable, os.path.abspath(__file__), "--model-dir", model,
             "--tokens", str(args.tokens), "--max-model-len", str(args.max_model_len),
             "--gpu-mem", str(args.gpu_mem), "--cold-out", cold_path,
             *(["--seed", args.seed] if args.seed else []), *(["--cpu"] if args.cpu else [])]
    t = time.time()
    rc = subprocess.run(child, check=False).returncode
    out["cold"] = {"rc": rc, "seconds": time.time() - t}
    dump()
    if rc != 0:
        print("cold reference FAILED", rc, flush=True)
        return 1
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.testing.reference import Generated
    from kvtier.testing.restore import handles, sharpen_dummy_weights

    with open(cold_path) as f:
        cold = {k: [Generated.from_json(g) for g in v] for k, v in json.load(f).items()}
    ktc = KVTransferConfig(
        kv_connector="ProbeConnector", kv_connector_module_path="kvtier.testing.probe",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"dram_size": args.dram_size, "cost_model": False})
    llm = LLM(**engine_args(args, model), enable_prefix_caching=True, kv_transfer_config=ktc)
    import vllm

    out["vllm"] = vllm.__version__
    out["mamba_cache_mode"] = llm.llm_engine.vllm_config.cache_config.mamba_cache_mode
    h = handles(llm)
    sharpen_dummy_weights(h)
    out["census"] = census(h)
    dump()
    for name, prompts in batches(args.tokens, vocab).items():
        out[name] = run_check(h, name, prompts, cold[name])
        r = out[name]
        print(f"{name}: {'as expected' if r['as_expected'] else 'NOT AS EXPECTED'} "
              f"(passed={r['passed']}, restored {r['restored_tokens']}/"
              f"{r['expected_restored']}, loads ok {r['loads_ok']} failed {r['loads_failed']})",
              flush=True)
        dump()
    ok = all(out[n]["as_expected"] for n in CHECKS)
    print("ALL AS EXPECTED" if ok else "SOME NOT AS EXPECTED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

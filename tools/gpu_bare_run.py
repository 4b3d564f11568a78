"""Bare runs of the seed architectures (kvtier.testing.seed_models) on vLLM 0.25.1, no kvtier.

    # on the GPU host, all architectures, one JSON each (one device call):
    PYTHONPATH=/tmp/site:src python tools/gpu_bare_run.py --all --out $OUT/bare
    # one architecture, in this process:
    PYTHONPATH=/tmp/site:src python tools/gpu_bare_run.py --arch kimi_linear --out $OUT/bare
    # CPU dry run (vLLM 0.32's CPU build; only Qwen3-Next runs there):
    python tools/gpu_bare_run.py --arch qwen3_next --cpu --out /tmp/bare

Per architecture: write the dummy-weight folder, start ``LLM(...)`` with vLLM's default
engine settings (CUDA graphs and compilation on) plus prefix caching and what the seed ran with
(fp8 KV, MTP), run two short prompts that share a prefix one after the other (the second can
hit the first's blocks), and write ``<arch>.json``: whether it started (the exact error and a
traceback tail if not), the KV-cache groups (kind, block size, layers, spec), the tensors a
connector receives in ``register_kv_caches`` (name, shape, dtype, stride; through
kvtier.testing.census's no-op connector, or the layers' own caches with --no-connector), and
per prompt the greedy tokens and cached-token count.

``--all`` runs each architecture in its own process with a timeout, ``--parallel`` at a time on
the one GPU; each reserves ``--kv-gib`` of KV cache (``kv_cache_memory_bytes``, so concurrent
start-ups do not disturb each other's memory profiling) within ``--gpu-mem`` of the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test-only worker rpc
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not in the gpu-kit
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from kvtier.testing.seed_models import SEED_MODELS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--arch", choices=sorted(SEED_MODELS))
    which.add_argument("--all", action="store_true", help="every architecture, one process each")
    ap.add_argument("--out", required=True, help="folder for <arch>.json (and logs with --all)")
    ap.add_argument("--model-root", default="/tmp/kvtier-seed-models")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-mem", type=float, default=0.25, help="gpu_memory_utilization")
    ap.add_argument("--kv-gib", type=float, default=4.0,
                    help="KV cache size (kv_cache_memory_bytes); 0: vLLM's profiling")
    ap.add_argument("--no-connector", action="store_true",
                    help="no connector at all; tensors read from the layers")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=270, help="seconds per architecture (--all)")
    ap.add_argument("--parallel", type=int, default=3, help="architectures at once (--all)")
    ap.add_argument("--only", default="", help="--all: comma-separated subset")
    ap.add_argument("--write-only", action="store_true", help="write the model folders, stop")
    ap.add_argument("--cpu", action="store_true",
                    help="vLLM's CPU build: bf16, mamba_cache_mode align, VLLM_CPU_KVCACHE_SPACE")
    return ap.parse_args(argv)


def engine_kwargs(args: argparse.Namespace, name: str, folder: str) -> dict[str, Any]:
    """``LLM(...)`` arguments: vLLM's defaults plus prefix caching, the seed's own settings,
    dummy weights, token-id prompts and the sizing that lets several runs share the GPU."""
    kw: dict[str, Any] = dict(model=folder, load_format="dummy", skip_tokenizer_init=True,
                              seed=0, enable_prefix_caching=True,
                              max_model_len=args.max_model_len, disable_log_stats=False,
                              **SEED_MODELS[name].engine_args)
    if args.cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        kw.update(dtype="bfloat16", mamba_cache_mode="align", max_num_batched_tokens=2048)
    else:
        kw["gpu_memory_utilization"] = args.gpu_mem
        if args.kv_gib > 0:
            kw["kv_cache_memory_bytes"] = int(args.kv_gib * 2**30)
    if not args.no_connector:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CensusConnector", kv_connector_module_path="kvtier.testing.census",
            kv_role="kv_both")
    return kw


def shared_prefix_prompts(block_sizes: list[int], max_len: int, output_len: int
                          ) -> list[list[int]]:
    """Two prompts sharing a prefix of two blocks of the largest group (so every group can
    hit), each with its own 17-token tail; token ids within the 4,096-token vocabulary."""
    prefix_len = min(2 * max(block_sizes), max_len - output_len - 64)
    prefix = [(7919 * i + (i * i) % 97) % 3900 + 100 for i in range(prefix_len)]
    return [prefix + [(s * 131 + 7 * j) % 3900 + 100 for j in range(17)] for s in (1, 2)]


def spec_decode_metrics(llm: Any) -> dict[str, float]:
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # metrics are a bonus; their absence is reported, not fatal
        return {"unavailable": str(e)}  # type: ignore[dict-item]
    out: dict[str, float] = {}
    for m in metrics:
        if "spec_decode" in m.name and hasattr(m, "value"):
            out[m.name] = float(m.value)
    return out


def run_one(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Start, census, two prompts; every failure is recorded, never raised."""
    seed = SEED_MODELS[name]
    folder = seed.write(os.path.join(args.model_root, name))
    result: dict[str, Any] = {"arch": name, "architecture": seed.architecture,
                              "engine_args": seed.engine_args, "needs": seed.needs,
                              "model_dir": folder, "started": False}
    if args.write_only:
        result["write_only"] = True
        return result
    import vllm
    from vllm import LLM, SamplingParams

    from kvtier.testing.census import rpc_census

    result["vllm_version"] = vllm.__version__
    stage = "start"
    try:
        t0 = time.time()
        llm = LLM(**engine_kwargs(args, name, folder))
        result.update(started=True, start_s=round(time.time() - t0, 1))
        stage = "census"
        result["census"] = llm.collective_rpc(rpc_census)[0]
        stage = "generate"
        blocks = [g["block_size"] for g in result["census"]["groups"]]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
        runs = []
        for prompt in shared_prefix_prompts(blocks, args.max_model_len, args.output_len):
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            runs.append({"prompt_len": len(prompt), "num_cached_tokens": out.num_cached_tokens,
                         "tokens": list(out.outputs[0].token_ids)})
        result["prompts"] = runs
        result["spec_decode"] = spec_decode_metrics(llm)
        result["ok"] = True
    except BaseException as e:  # the exact error is the result of a failed bare run
        result.update(ok=False, failed_at=stage, error=f"{type(e).__name__}: {e}",
                      traceback_tail=traceback.format_exc()[-6000:])
    return result


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def child_argv(args: argparse.Namespace, name: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--arch", name, "--out", args.out,
            "--model-root", args.model_root, "--max-model-len", str(args.max_model_len),
            "--gpu-mem", str(args.gpu_mem), "--kv-gib", str(args.kv_gib),
            "--output-len", str(args.output_len)]
    flags = {"--no-connector": args.no_connector, "--write-only": args.write_only,
             "--cpu": args.cpu}
    return argv + [flag for flag, on in flags.items() if on]


def run_child(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One architecture in its own process; a crash or timeout still leaves <arch>.json."""
    path, log = (os.path.join(args.out, f"{name}{ext}") for ext in (".json", ".log"))
    if os.path.exists(path):
        os.remove(path)
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc: int | str = subprocess.run(child_argv(args, name), stdout=f,
                                           stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {args.timeout} s"
    if not os.path.exists(path):
        with open(log) as f:
            tail = f.read()[-6000:]
        write_json(path, {"arch": name, "started": False, "ok": False,
                          "error": f"process ended without a result ({rc})", "log_tail": tail})
    with open(path) as f:
        result = json.load(f)
    result["wall_s"] = round(time.time() - t0, 1)
    write_json(path, result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.arch:
        result = run_one(args, args.arch)
        write_json(os.path.join(args.out, f"{args.arch}.json"), result)
        print(json.dumps({k: result.get(k) for k in ("arch", "started", "ok", "error")}))
        return 0 if result.get("ok", args.write_only) else 1
    names = [n for n in sorted(SEED_MODELS) if not args.only or n in args.only.split(",")]
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        results = list(pool.map(lambda n: run_child(args, n), names))
    summary = {r["arch"]: {"started": r.get("started"), "ok": r.get("ok"),
                           "error": r.get("error"), "wall_s": r.get("wall_s")} for r in results}
    write_json(os.path.join(args.out, "summary.json"), summary)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

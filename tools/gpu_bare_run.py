"""Bare runs of the seed architectures (kvtier.testing.seed_models) on vLLM 0.25.1, no kvtier.

    # on the GPU host, all architectures, one JSON each (one device call):
    PYTHONPATH=/tmp/site:src python tools/gpu_bare_run.py --all --out $OUT/bare
    # one architecture, in this process:
    PYTHONPATH=/tmp/site:src python tools/gpu_bare_run.py --arch kimi_linear --out $OUT/bare
    # CPU dry run (vLLM 0.32's CPU build; only Qwen3-Next runs there):
    python tools/gpu_bare_run.py --arch qwen3_next --cpu --out /tmp/bare

Per architecture: write the dummy-weight folder, start ``LLM(...)`` with vLLM's default
engine settings (CUDA graphs and compilation on) plus prefix caching, ``--max-num-seqs``
(default 128: the Mamba/KDA state pool of a small KV budget holds fewer than vLLM's 1,024
sequences, and CUDA-graph capture refuses that) and what the seed ran with (fp8 KV, MTP,
kernel choices the kit needs), run two short prompts that share a prefix one after the other
(the second can hit the first's blocks), and write ``<arch>.json``: the engine arguments as
passed, whether it started (the exact error and a traceback tail if not), the KV-cache groups
(kind, block size, layers, spec), the tensors a connector receives in ``register_kv_caches``
(name, shape, dtype, stride; through kvtier.testing.census's no-op connector, or the layers'
own caches with --no-connector), and per prompt the greedy tokens and cached-token count.

``--all`` runs each architecture in its own process with a timeout, ``--parallel`` at a time on
the one GPU; each reserves ``--kv-gib`` of KV cache (``kv_cache_memory_bytes``, so concurrent
start-ups do not disturb each other's memory profiling) within ``--gpu-mem`` of the GPU. A
child that dies, times out or leaves an unreadable JSON is recorded as failed; summary.json is
always written.

vLLM 0.25.1 fixes applied in the child (``--no-vllm-fixes`` runs it pristine; the JSON lists what
was applied; ``kvtier.testing.vllm_fixes``): the fp8_ds_mla spec fix (every DSA model with fp8
KV fails at start-up without it: vllm-project/vllm#48378, fixed after 0.25.1 by #48379) and
MiniMax-M3's top-k buffer layout off SM100 (NaN in batched prefills: #48603, fixed by #49149).

DeepGEMM's JIT headers (the DSA indexer, deepseek_v32 and glm_moe_dsa) are in vLLM's own wheel
(``vllm/third_party/deep_gemm/include``: 863 files, CUTLASS/CuTe and DeepGEMM, 27 MB) and the
gpu-kit's build.sh deletes them. They travel as one file beside a kit part (about 2.3 MB), and
the GPU image's CUDA 13.0 nvcc (/usr/local/cuda, CUDA_HOME set) compiles them there:

    # here, from the wheel the kit was built from:
    python tools/gpu_bare_run.py --pack-deepgemm-include \\
        .cache/wheels/vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl --out .gpu-kit/dg
    # on the GPU host, after the kit's install.sh (carry .gpu-kit/dg):
    tar xzf .gpu-kit/dg/deepgemm-include.tar.gz -C /tmp/site

Each child records ``deepgemm``: whether the headers are installed and match the installed
vLLM's RECORD, and which nvcc DeepGEMM will find.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import importlib.util
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from kvtier.testing.seed_models import SEED_MODELS
from kvtier.testing.vllm_fixes import (  # noqa: F401 (FIX_*, with_quant_mode: the tests' names)
    FIX_M3_TOPK_LAYOUT,
    FIX_MLA_QUANT_MODE,
    apply_vllm_fixes,
    with_quant_mode,
)

CHILD_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # test-only worker rpc
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # flashinfer is not in the gpu-kit
}
DEEPGEMM_INCLUDE = "vllm/third_party/deep_gemm/include/"
DEEPGEMM_PROBE = DEEPGEMM_INCLUDE + "deep_gemm/scheduler/paged_mqa_logits.cuh"
DEEPGEMM_TARBALL = "deepgemm-include.tar.gz"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--arch", choices=sorted(SEED_MODELS))
    which.add_argument("--all", action="store_true", help="every architecture, one process each")
    which.add_argument("--pack-deepgemm-include", metavar="WHEEL",
                       help=f"write --out/{DEEPGEMM_TARBALL} from vLLM's wheel, stop")
    ap.add_argument("--out", required=True, help="folder for <arch>.json (and logs with --all)")
    ap.add_argument("--model-root", default="/tmp/kvtier-seed-models")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--gpu-mem", type=float, default=0.25, help="gpu_memory_utilization")
    ap.add_argument("--kv-gib", type=float, default=4.0,
                    help="KV cache size (kv_cache_memory_bytes); 0: vLLM's profiling")
    ap.add_argument("--no-connector", action="store_true",
                    help="no connector at all; tensors read from the layers")
    ap.add_argument("--no-vllm-fixes", action="store_true",
                    help="run vLLM 0.25.1 pristine (none of kvtier.testing.vllm_fixes)")
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
    dummy weights, token-id prompts and the sizing that lets several runs share the GPU.

    The seed's arguments are deep-copied: vLLM writes into what it is given (it adds
    ``target_model_config`` to a ``speculative_config`` dict), and SEED_MODELS must stay as
    declared."""
    kw: dict[str, Any] = dict(model=folder, load_format="dummy", skip_tokenizer_init=True,
                              seed=0, enable_prefix_caching=True,
                              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                              disable_log_stats=False)
    kw.update(copy.deepcopy(SEED_MODELS[name].engine_args))
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


def record_hash(data: bytes) -> str:
    """A wheel RECORD's hash field for these bytes."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def read_record(text: str) -> dict[str, str]:
    return {p[0]: p[1] for p in (line.split(",") for line in text.splitlines()) if len(p) >= 2}


def pack_deepgemm_include(wheel: str, out_dir: str) -> dict[str, Any]:
    """Write ``out_dir/deepgemm-include.tar.gz``: every file under
    ``vllm/third_party/deep_gemm/include/`` of vLLM's wheel, paths kept (extract it into the
    site folder vllm lives in), each checked against the wheel's RECORD first."""
    with zipfile.ZipFile(wheel) as z:
        record_name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        record = read_record(z.read(record_name).decode())
        members = [i for i in z.infolist()
                   if i.filename.startswith(DEEPGEMM_INCLUDE) and not i.is_dir()]
        if not any(i.filename == DEEPGEMM_PROBE for i in members):
            raise ValueError(f"{wheel} has no {DEEPGEMM_PROBE}")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, DEEPGEMM_TARBALL)
        with tarfile.open(path, "w:gz") as tar:
            for info in members:
                data = z.read(info)
                if record.get(info.filename) != record_hash(data):
                    raise ValueError(f"{info.filename} does not match {record_name}")
                entry = tarfile.TarInfo(info.filename)
                entry.size, entry.mode = len(data), 0o644
                tar.addfile(entry, io.BytesIO(data))
    return {"path": path, "files": len(members), "bytes": os.path.getsize(path)}


def deepgemm_status(site: str | None = None) -> dict[str, Any]:
    """What DeepGEMM's JIT will find: its headers beside vllm in ``site`` (default: where the
    importable vllm lives), whether they match that vllm's RECORD, and the nvcc its
    ``_find_cuda_home`` picks."""
    if site is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return {"vllm": None}
        site = os.path.dirname(next(iter(spec.submodule_search_locations)))
    probe = os.path.join(site, DEEPGEMM_PROBE)
    records = [os.path.join(site, d, "RECORD") for d in sorted(os.listdir(site))
               if d.startswith("vllm-") and d.endswith(".dist-info")]
    expected = read_record(pathlib.Path(records[0]).read_text()).get(DEEPGEMM_PROBE) if records else None
    found = os.path.isfile(probe)
    match = (record_hash(pathlib.Path(probe).read_bytes()) == expected) if found and expected else None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    return {"headers": found, "headers_match_record": match,
            "nvcc": nvcc if nvcc and os.path.exists(nvcc) else None}


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
                              "seed_engine_args": seed.engine_args, "needs": seed.needs,
                              "model_dir": folder, "started": False}
    if args.write_only:
        result["write_only"] = True
        return result
    import vllm

    result["vllm_version"] = vllm.__version__
    try:
        result["deepgemm"] = deepgemm_status()
        result["vllm_fixes"] = [] if args.no_vllm_fixes else apply_vllm_fixes()
        kwargs = engine_kwargs(args, name, folder)
        result["engine_args"] = json.loads(dumps(kwargs))  # as passed, before vLLM edits them
        generate_stages(args, kwargs, result)
    except BaseException as e:  # the exact error is the result of a failed bare run
        result.update(ok=False, failed_at=result.get("stage", "start"),
                      error=f"{type(e).__name__}: {e}",
                      traceback_tail=traceback.format_exc()[-6000:])
    result.pop("stage", None)
    return result


def generate_stages(args: argparse.Namespace, kwargs: dict[str, Any],
                    result: dict[str, Any]) -> None:
    """Start the engine, take the census, run the two prompts; ``result["stage"]`` names the
    step under way, so a failure says where it happened."""
    from vllm import LLM, SamplingParams

    from kvtier.testing.census import rpc_census

    t0 = time.time()
    llm = LLM(**kwargs)
    result.update(started=True, start_s=round(time.time() - t0, 1), stage="census")
    result["census"] = llm.collective_rpc(rpc_census)[0]
    result["stage"] = "generate"
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


def _json_fallback(value: Any) -> str:
    return repr(value)[:2000]


def dumps(payload: Any) -> str:
    """JSON text; a value JSON cannot hold (a vLLM config object) is written as its repr."""
    return json.dumps(payload, indent=1, default=_json_fallback)


def write_json(path: str, payload: Any) -> None:
    """Serialize first, then replace the file: a reader never sees half a result."""
    text = dumps(payload)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def child_argv(args: argparse.Namespace, name: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--arch", name, "--out", args.out,
            "--model-root", args.model_root, "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--gpu-mem", str(args.gpu_mem),
            "--kv-gib", str(args.kv_gib), "--output-len", str(args.output_len)]
    flags = {"--no-connector": args.no_connector, "--write-only": args.write_only,
             "--cpu": args.cpu, "--no-vllm-fixes": args.no_vllm_fixes}
    return argv + [flag for flag, on in flags.items() if on]


def read_child_result(name: str, path: str, log: str, rc: int | str) -> dict[str, Any]:
    """The child's ``<arch>.json``, or a failed result saying why there is none: no file, or
    one that is not a JSON object (kept beside it as ``<arch>.json.unreadable``)."""
    with open(log, errors="replace") as f:
        tail = f.read()[-6000:]
    failed = {"arch": name, "started": None, "ok": False, "log_tail": tail}
    if not os.path.exists(path):
        return {**failed, "started": False, "error": f"process ended without a result ({rc})"}
    with open(path, errors="replace") as f:
        raw = f.read()
    try:
        result = json.loads(raw)
        if not isinstance(result, dict):
            raise ValueError(f"a JSON {type(result).__name__}, not an object")
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        os.replace(path, path + ".unreadable")
        return {**failed, "error": f"unreadable result JSON ({rc}): {type(e).__name__}: {e}",
                "json_tail": raw[-2000:]}
    return result


def run_child(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One architecture in its own process; a crash, a timeout or an unreadable result still
    leaves a readable <arch>.json."""
    path, log = (os.path.join(args.out, f"{name}{ext}") for ext in (".json", ".log"))
    for stale in (path, path + ".unreadable"):
        if os.path.exists(stale):
            os.remove(stale)
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc: int | str = subprocess.run(child_argv(args, name), stdout=f,
                                           stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {args.timeout} s"
    result = read_child_result(name, path, log, rc)
    result.update(arch=name, wall_s=round(time.time() - t0, 1))
    write_json(path, result)
    return result


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every selected architecture; summary.json is written whatever any child did."""
    names = [n for n in sorted(SEED_MODELS) if not args.only or n in args.only.split(",")]

    def guarded(name: str) -> dict[str, Any]:
        try:
            return run_child(args, name)
        except Exception as e:  # the driver's own failure is one architecture's result
            return {"arch": name, "started": None, "ok": False,
                    "error": f"driver: {type(e).__name__}: {e}"}

    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        results = list(pool.map(guarded, names))
    summary = {r["arch"]: {k: r.get(k) for k in ("started", "ok", "failed_at", "error",
                                                 "wall_s")} for r in results}
    write_json(os.path.join(args.out, "summary.json"), summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    os.makedirs(args.out, exist_ok=True)
    if args.pack_deepgemm_include:
        print(dumps(pack_deepgemm_include(args.pack_deepgemm_include, args.out)))
        return 0
    if args.arch:
        result = run_one(args, args.arch)
        write_json(os.path.join(args.out, f"{args.arch}.json"), result)
        print(json.dumps({k: result.get(k) for k in ("arch", "started", "ok", "error")}))
        return 0 if result.get("ok", args.write_only) else 1
    print(dumps(run_all(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

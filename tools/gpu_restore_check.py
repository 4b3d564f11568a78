"""The restore check on a GPU with vLLM 0.25.1 (docs/design.md §5); results in bench/results/.

    PYTHONPATH=<site dir of vLLM 0.25.1>:src VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python tools/gpu_restore_check.py --tokens 16384 --tp 1 --out $OUT/restore_tp1.json

A Llama-3.1-8B-shaped model with dummy weights (bf16; re-drawn so the output depends on the
context), one prompt of ``--tokens`` + 5 tokens and a batch of two prompts sharing a prefix:
run A computes, run C hits vLLM's own prefix cache at the same boundary, then the prefix cache
is reset and every KV byte overwritten, and run B restores from kvtier. Passes only if kvtier
restored exactly the whole-chunk prefixes, checksums read through vLLM's block tables match on
every rank, and greedy tokens and top-5 logprobs of B equal C's. Wall times of A (compute)
and B (restore) are reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test-only worker rpcs
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def llama8b(path: str) -> str:
    from kvtier.testing.models import _write

    return _write(path, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    })


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default="restore.json")
    ap.add_argument("--model-dir", default="/tmp/llama8b-shape")
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 model (CPU dry run)")
    ap.add_argument("--kvtier-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a kvtier setting for the kvtier runs (repeatable; JSON values)")
    args = ap.parse_args()

    from gpu_shared_prefix import settings
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvtier.testing.restore import handles, restore_check, settle, sharpen_dummy_weights

    vocab = 900 if args.tiny else 120000

    def prompt(n: int, seed: int) -> list[int]:
        return [(seed * 7919 + 31 * i + (i * i) % 97) % vocab + 100 for i in range(n)]

    if args.tiny:
        from kvtier.testing.models import tiny_llama

        model = dict(model=tiny_llama(args.model_dir), dtype="float32", block_size=32)
    else:
        model = dict(model=llama8b(args.model_dir), dtype="bfloat16", block_size=16,
                     gpu_memory_utilization=0.85)
    t0 = time.time()
    llm = LLM(
        **model, load_format="dummy", skip_tokenizer_init=True,
        max_model_len=args.tokens + 4096, seed=0,
        enforce_eager=True, tensor_parallel_size=args.tp,
        max_num_seqs=8, max_num_batched_tokens=8192,
        kv_transfer_config=KVTransferConfig(
            kv_connector="ProbeConnector", kv_connector_module_path="kvtier.testing.probe",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"dram_size": "512MiB" if args.tiny else "24GiB",
                                       **settings(args.kvtier_config)}),
    )
    start_s = time.time() - t0
    h = handles(llm)
    sharpen_dummy_weights(h)
    params = SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False, temperature=0.0,
                            logprobs=5)
    c = 256
    long = prompt(args.tokens + 5, 1)
    shared = prompt(args.tokens // 2, 2)
    batch = [shared + prompt(c + 7, 3), shared + prompt(2 * c + 3, 4)]
    out: dict = {"tp": args.tp, "tokens": args.tokens, "engine_start_s": start_s,
                 "vllm": __import__("vllm").__version__}
    def dump() -> None:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    for name, prompts in (("long", [long]), ("shared_batch", batch)):
        t = time.time()
        try:
            res = restore_check(h, prompts, params)
            settle(h)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            dump()
            raise
        out[name] = {
            "passed": res.passed, "restored_tokens": res.restored_tokens,
            "expected_restored": res.expected_restored, "loads_ok": res.loads_ok,
            "loads_failed": res.loads_failed, "seconds": time.time() - t,
            "prompts": [p.__dict__ for p in res.prompts],
        }
        print(name, "PASSED" if res.passed else "FAILED", res.restored_tokens, "/",
              res.expected_restored, [(p.checksums_equal, p.tokens_equal, p.logprobs_equal)
                                      for p in res.prompts], flush=True)
        dump()
    # compute vs restore wall time for the long prompt (fresh engine state for both)
    from kvtier.testing.probe import rpc_fill

    single = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False, temperature=0.0)
    fresh = prompt(args.tokens + 5, 9)
    llm.reset_prefix_cache()
    t = time.time()
    llm.generate([{"prompt_token_ids": fresh}], single, use_tqdm=False)
    compute_s = time.time() - t
    settle(h)
    llm.reset_prefix_cache()
    llm.collective_rpc(rpc_fill)
    t = time.time()
    llm.generate([{"prompt_token_ids": fresh}], single, use_tqdm=False)
    restore_s = time.time() - t
    out["ttft_compute_s"] = compute_s
    out["ttft_restore_s"] = restore_s
    out["kvtier_stats"] = {k: v for k, v in vars(h.kvtier.stats).items()
                           if isinstance(v, (int, float))}
    print(f"first token: compute {compute_s:.3f} s, restore {restore_s:.3f} s "
          f"({compute_s / max(restore_s, 1e-9):.1f}x)", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    ok = out["long"]["passed"] and out["shared_batch"]["passed"]
    print("ALL PASSED" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from kvtier.testing.seed_models import qwen3_next
mode = sys.argv[1]; blocks = int(sys.argv[2])
d = qwen3_next("/tmp/hyb/model", layers=4)
kw = dict(model=d, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
          max_model_len=2600, max_num_seqs=16, seed=0, enable_prefix_caching=True, mamba_cache_mode="align",
          num_gpu_blocks_override=blocks, max_num_batched_tokens=2304)
if mode != "hbm":
    extra = {"dram_size": "1GiB", "cost_model": False}
    if mode == "admit": extra["cache_aware_admission"] = True
    kw["kv_transfer_config"] = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
llm = LLM(**kw)
def toks(n, seed): return [(seed * 7919 + 31 * i + (i * i) % 97) % 3800 + 100 for i in range(n)]
P, R = 3, 3
prefixes = [toks(2 * 1152 + 100, 1000 + p) for p in range(P)]
prompts = [prefixes[p] + toks(64, 10 * r + p + 1) for r in range(R) for p in range(P)]
core = llm.llm_engine.engine_core.engine_core
n_steps = [0]
orig = core.scheduler.schedule
def sched(*a, **k):
    n_steps[0] += 1
    return orig(*a, **k)
core.scheduler.schedule = sched
params = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False, temperature=0.0)
t = time.time()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
side = getattr(core.scheduler.connector, "scheduler_side", None) if core.scheduler.connector else None
res = {"mode": mode, "wall": time.time() - t, "steps": n_steps[0], "tokens": [list(o.outputs[0].token_ids) for o in outs],
       "cached": sum(o.num_cached_tokens or 0 for o in outs),
       "adm": side.admission.counters() if side is not None and side.admission is not None else None,
       "loads": side.scheduler.stats.loads_ok if side is not None else None}
json.dump(res, open(f"/tmp/hyb/{mode}.json", "w"))
print(json.dumps({k: v for k, v in res.items() if k != "tokens"}))

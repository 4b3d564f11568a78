#!/usr/bin/env bash
# The main job, on a CPU machine: install (pinned, into .venv), then serve a tiny float32 model
# on vLLM's CPU build twice - HBM prefix cache only, and with kvtier - with the HBM prefix
# cache deliberately small, run the same shared-prefix workload against both and print them
# side by side, then the ratio lines and the checks.
#   bash scripts/demo.sh                 (results under out/demo-<time>/)
#   DEMO_OUT=dir DEMO_PREFIX_LEN=4096 DEMO_REQUESTS=64 DEMO_ROUNDS=5 bash scripts/demo.sh
#
# Both servers start once; then DEMO_ROUNDS (default 3) alternating pairs run, HBM-only then
# kvtier, each pair on new prompts (seed 0, 1, 2, ...). The HBM-only baseline has two states
# on a small machine (requests spread out, or in waves of four whose prefills queue behind
# each other), so one pair's ratio moves between runs; the check is on the median over the
# pairs, and the range is printed.
#
# Workload per pair: 8 prefixes of DEMO_PREFIX_LEN (default 8192) tokens in round-robin
# order, each request = a prefix + a unique 256-token suffix, 16 output tokens, concurrency
# 4, DEMO_REQUESTS (default 32) requests (4 passes over the prefixes). A request holds (prefix + 256 + 16) / 32 blocks; the HBM cache holds 4 such
# requests plus one in 8 of their blocks, so by the time a prefix comes back 7 other requests
# have pushed it out of HBM. The model is the connector issue's (kvtier.testing.models).
# docs/bench.md has a run.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/install.sh
. .venv/bin/activate
echo "demo: installed in $(( $(date +%s) - t0 )) s" >&2

PREFIX_LEN=${DEMO_PREFIX_LEN:-8192}
REQUESTS=${DEMO_REQUESTS:-32}
ROUNDS=${DEMO_ROUNDS:-3}
OUT=${DEMO_OUT:-out/demo-$(date +%Y%m%d-%H%M%S)}
BLOCKS_PER_REQ=$(( (PREFIX_LEN + 256 + 16 + 31) / 32 ))
HBM_BLOCKS=$(( 4 * BLOCKS_PER_REQ + BLOCKS_PER_REQ / 8 ))
MAX_LEN=$(( (PREFIX_LEN + 256 + 16 + 1023) / 1024 * 1024 ))
mkdir -p "$OUT"
# the connector issue's model: Llama, 2 layers, hidden 256, 4 heads, 2 KV heads, float32
python -c "from kvtier.testing.models import tiny_llama as m; m('$OUT/model', max_len=max(8192, $MAX_LEN))"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
COMMON="$OUT/model --load-format dummy --dtype float32 --block-size 32 --skip-tokenizer-init \
--enforce-eager --max-model-len $MAX_LEN --num-gpu-blocks-override $HBM_BLOCKS --max-num-seqs 4"

kvtier bench --workload shared-prefix --prompt-prefix-pool-size 8 \
  --prompt-prefix-length "$PREFIX_LEN" --isl 256 --osl 16 --concurrency 4 --requests "$REQUESTS" --seed 0 --out "$OUT" \
  --rounds "$ROUNDS" \
  --compare "HBM-only=$COMMON --no-kvtier" \
  --compare "kvtier=$COMMON --dram-size 1GiB"

python - "$OUT/results.json" "$(( $(date +%s) - t0 ))" <<'PY'
import json, statistics, sys

pairs: dict[int, dict] = {}
for r in json.load(open(sys.argv[1]))["runs"]:
    pairs.setdefault(r.get("round", 0), {})[r["name"]] = r["summary"]
pairs = [pairs[k] for k in sorted(pairs)]
hbm = [p["HBM-only"] for p in pairs]
kvt = [p["kvtier"] for p in pairs]
ratios = [h["ttft_repeat_p50_ms"] / k["ttft_repeat_p50_ms"] for h, k in zip(hbm, kvt)]
ratio = statistics.median(ratios)
each = ", ".join(f"{x:.1f}x" for x in ratios)
checks = [
    ("HBM-only serves under 5% of repeated-prefix tokens from HBM (every pair)",
     all(h["hbm_share_of_repeat"] < 0.05 for h in hbm),
     " / ".join(f"{100 * h['hbm_share_of_repeat']:.1f}%" for h in hbm)),
    ("kvtier restores at least 95% of the whole-chunk prefix tokens (every pair)",
     all(k["connector_share_of_restorable"] >= 0.95 for k in kvt),
     " / ".join(f"{k['connector_tokens']:,} of {k['restorable_tokens']:,} = "
                f"{100 * k['connector_share_of_restorable']:.1f}%" for k in kvt)),
    (f"median over {len(pairs)} pairs of the median TTFT of repeated-prefix requests at "
     "least 5x lower", ratio >= 5.0,
     f"{ratio:.1f}x (pairs: {each}; range {min(ratios):.1f}x-{max(ratios):.1f}x)"),
    ("no failed requests", all(s["failed"] == 0 for s in hbm + kvt),
     " + ".join(str(s["failed"]) for s in hbm + kvt)),
]
print()
for what, ok, value in checks:
    print(f"[{'ok' if ok else 'NOT MET'}] {what}: {value}")
print(f"demo wall time {sys.argv[2]} s (install included); results in "
      f"{sys.argv[1].rsplit('/', 1)[0]}/")
sys.exit(0 if all(ok for _, ok, _ in checks) else 1)
PY

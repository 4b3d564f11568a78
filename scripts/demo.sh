#!/usr/bin/env bash
# The main job, on a CPU machine: install (pinned, into .venv), then serve a tiny float32 model
# on vLLM's CPU build twice - HBM prefix cache only, and with kvtier - with the HBM prefix
# cache deliberately small, run the same shared-prefix workload against both and print them
# side by side, then the ratio line and the checks.
#   bash scripts/demo.sh                 (results under out/demo-<time>/)
#   DEMO_OUT=dir DEMO_PREFIX_LEN=4096 DEMO_REQUESTS=64 bash scripts/demo.sh
#
# Workload: 8 prefixes of DEMO_PREFIX_LEN (default 8192) tokens in round-robin order, each
# request = a prefix + a unique 256-token suffix, 16 output tokens, concurrency 4, 48 requests
# (6 rounds). A request holds (prefix + 256 + 16) / 32 blocks; the HBM cache holds 4 such
# requests plus one in 8 of their blocks, so by the time a prefix comes back 7 other requests
# have pushed it out of HBM. The model is the connector issue's (kvtier.testing.models).
# Takes about 3 minutes after the install on a 2-core machine; docs/bench.md has a run.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/install.sh
. .venv/bin/activate
echo "demo: installed in $(( $(date +%s) - t0 )) s" >&2

PREFIX_LEN=${DEMO_PREFIX_LEN:-8192}
REQUESTS=${DEMO_REQUESTS:-48}
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
  --compare "HBM-only=$COMMON --no-kvtier" \
  --compare "kvtier=$COMMON --dram-size 1GiB"

python - "$OUT/results.json" "$(( $(date +%s) - t0 ))" <<'PY'
import json, sys

runs = {r["name"]: r["summary"] for r in json.load(open(sys.argv[1]))["runs"]}
hbm, kvt = runs["HBM-only"], runs["kvtier"]
ratio = hbm["ttft_repeat_p50_ms"] / kvt["ttft_repeat_p50_ms"]
checks = [
    ("HBM-only serves under 5% of repeated-prefix tokens from HBM",
     hbm["hbm_share_of_repeat"] < 0.05, f"{100 * hbm['hbm_share_of_repeat']:.1f}%"),
    ("kvtier restores at least 95% of the whole-chunk prefix tokens",
     kvt["connector_share_of_restorable"] >= 0.95,
     f"{kvt['connector_tokens']:,} of {kvt['restorable_tokens']:,} tokens = "
     f"{100 * kvt['connector_share_of_restorable']:.1f}%"),
    ("median TTFT of repeated-prefix requests at least 5x lower", ratio >= 5.0, f"{ratio:.1f}x"),
    ("no failed requests", hbm["failed"] == kvt["failed"] == 0,
     f"{hbm['failed']} + {kvt['failed']}"),
]
print()
for what, ok, value in checks:
    print(f"[{'ok' if ok else 'NOT MET'}] {what}: {value}")
print(f"demo wall time {sys.argv[2]} s (install included); results in "
      f"{sys.argv[1].rsplit('/', 1)[0]}/")
sys.exit(0 if all(ok for _, ok, _ in checks) else 1)
PY

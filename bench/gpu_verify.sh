#!/usr/bin/env bash
# The cost of verified restores (issue 12 item 10) on one H200, vLLM 0.25.1 from the gpu-kit
# installed into $SITE, in one device call:
#   1. (ROUNDS=0 skips it) `kvtier bench transfer` at 2 MiB (mha) and Kimi-Linear's registered layout, checksums
#      off and on, alternating ROUNDS pairs (GB/s each way, both at once, under a GEMM);
#   2. the reference shared-prefix run (Llama-3.1-8B shape, design.md §3) with kvtier, one
#      engine process, AB_PAIRS pairs of phases verify off then on (fresh prompts each:
#      tools/gpu_shared_prefix.py --verify-ab), then the reference workload with verify on.
# Everything lands in $OUT/verify.tgz.
set -u -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
SITE=${SITE:-/tmp/site}
ROUNDS=${ROUNDS:-2}
AB_PAIRS=${AB_PAIRS:-2}
W=$OUT/verify
mkdir -p "$W"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$SITE:$PWD/src
# BENCH_COMMIT: the commit as the caller knows it (the device's copy of .git can be stale)
echo "${BENCH_COMMIT:-$(git log -1 --format='%H %s' 2>/dev/null)}" > "$W/commit.txt"
t0=$(date +%s)
for i in $(seq 1 "$ROUNDS"); do
    for v in off on; do
        flag=(); [ "$v" = on ] && flag=(--verify)
        timeout 150 python3 -m kvtier.cli bench transfer --families mha,kimi_linear \
            --chunks 2MiB "${flag[@]}" --out "$W" --tag "verify-$v-$i" > "$W/transfer-$v-$i.log" 2>&1
        echo "transfer verify $v round $i rc=$?"
        grep -E "^\| (mha|kimi_linear) " "$W/transfer-$v-$i.log"
    done
done
echo "transfer done after $(( $(date +%s) - t0 )) s"
# in-process engine core: the tool observes each load's park-to-release time and step times
VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout "${AB_TIMEOUT:-300}" \
    python3 tools/gpu_shared_prefix.py --config kvtier --verify-ab "$AB_PAIRS" \
    --out "$W/sp_verify_ab.json" > "$W/sp_verify_ab.log" 2>&1
echo "verify-ab rc=$?"; grep -E "^phase|^kvtier: wall" "$W/sp_verify_ab.log"
tar czf "$OUT/verify.tgz" -C "$OUT" verify && rm -rf "$W"
echo "done after $(( $(date +%s) - t0 )) s"

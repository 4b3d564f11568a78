#!/usr/bin/env bash
# The behaviour check of a restructuring, on one H200 with vLLM 0.25.1 from the gpu-kit
# (installed into $SITE first), in one device call:
#   1. the restore check (tools/gpu_restore_check.py, 16,389-token prompt and a shared-prefix
#      batch; tokens, checksums and top-5 logprobs);
#   2. the reference shared-prefix run (tools/gpu_shared_prefix.py: Llama-3.1-8B shape,
#      8 x 16,384-token prefixes x 6 requests, 1,024-token suffixes, 32 output tokens,
#      2,600 HBM blocks, default engine settings) with kvtier, alternating this checkout's
#      src/ with a reference checkout's ($REF_SRC, e.g. `git archive <commit> src`), ROUNDS
#      pairs, one engine process per run.
# Everything lands in $OUT/check.tgz (the device tool returns at most 8 files).
#   REF_SRC=.gpu-old/src ROUNDS=2 bash bench/gpu_behaviour_check.sh
set -u -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
SITE=${SITE:-/tmp/site}
ROUNDS=${ROUNDS:-2}
REF_SRC=${REF_SRC:-}
W=$OUT/check
mkdir -p "$W"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv > "$W/gpu.txt" 2>&1
# BENCH_COMMIT: the commit as the caller knows it (the device's copy of .git can be stale)
echo "${BENCH_COMMIT:-$(git log -1 --format='%H %s' 2>/dev/null)}" > "$W/commit.txt"
t0=$(date +%s)
PYTHONPATH=$SITE:$PWD/src timeout 240 python3 tools/gpu_restore_check.py --tokens 16384 --tp 1 \
    --out "$W/restore_tp1.json" > "$W/restore.log" 2>&1
echo "restore check rc=$? after $(( $(date +%s) - t0 )) s"
grep -E "PASSED|FAILED|first token" "$W/restore.log"
for i in $(seq 1 "$ROUNDS"); do
    for which in new ref; do
        src=$PWD/src
        if [ "$which" = ref ]; then
            [ -n "$REF_SRC" ] || continue
            src=$(cd "$REF_SRC" && pwd)
        fi
        PYTHONPATH=$SITE:$src timeout 200 python3 tools/gpu_shared_prefix.py --config kvtier \
            --out "$W/sp_kvtier_${which}_$i.json" > "$W/sp_${which}_$i.log" 2>&1
        echo "$which $i rc=$?: $(grep -E '^kvtier: wall' "$W/sp_${which}_$i.log" | tail -1)"
    done
done
tar czf "$OUT/check.tgz" -C "$OUT" check && rm -rf "$W"
echo "done after $(( $(date +%s) - t0 )) s"

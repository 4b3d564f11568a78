#!/usr/bin/env bash
# Issue 15's offline reference runs on one H200 (vLLM 0.25.1 from the gpu-kit installed into
# $SITE), in one device call: `kvtier bench offline` for SHAPE (llama8b or deepseek-v2-lite)
# with CONFIGS (default all five: hbm, big, native, kvtier, kvtier-null-copy), ROUNDS
# alternating rounds, then (ADMISSION=1) kvtier again with cache_aware_admission on.
# Budget: an engine start with CUDA graphs is ~1-1.5 min, a run 4-30 s, so five
# configurations x one round is ~8 min: for more rounds use several calls (ROUNDS=1 each,
# alternating CONFIGS order by hand) or CONFIGS=kvtier,kvtier-null-copy.
# Everything lands in $OUT/offline-$SHAPE.tgz (summary.md, summary.json, per-run JSON/logs, PNG).
set -u -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
SITE=${SITE:-/tmp/site}
SHAPE=${SHAPE:-llama8b}
ROUNDS=${ROUNDS:-1}
CONFIGS=${CONFIGS:-hbm,big,native,kvtier,kvtier-null-copy}
ADMISSION=${ADMISSION:-0}
EXTRA=${EXTRA:-}
W=$OUT/offline-$SHAPE
mkdir -p "$W"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$SITE:$PWD/src
# BENCH_COMMIT: the commit as the caller knows it (the device's copy of .git can be stale)
echo "${BENCH_COMMIT:-$(git log -1 --format='%H %s' 2>/dev/null)}" > "$W/commit.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$W/gpu.txt" 2>&1
# shellcheck disable=SC2086
python3 -m kvtier.cli bench offline --shape "$SHAPE" --configs "$CONFIGS" --rounds "$ROUNDS" \
    --out-dir "$W/admission-off" $EXTRA 2>&1 | tail -40
if [ "$ADMISSION" = 1 ]; then
    # shellcheck disable=SC2086
    python3 -m kvtier.cli bench offline --shape "$SHAPE" --configs kvtier,kvtier-null-copy \
        --rounds "$ROUNDS" --kvtier-set cache_aware_admission=true \
        --out-dir "$W/admission-on" $EXTRA 2>&1 | tail -40
fi
tar czf "$OUT/offline-$SHAPE.tgz" -C "$OUT" "offline-$SHAPE"

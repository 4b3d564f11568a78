#!/usr/bin/env bash
# Hybrid and sparse seed families with kvtier on one H200, vLLM 0.25.1 from the gpu-kit
# (installed into $SITE first). One stage per device call (each under the 10-minute limit):
#   STAGE=check  tools/gpu_seed_check.py for $ARCHS in parallel (correctness only, so they
#                share the GPU), then `kvtier bench transfer --families kimi_linear` alone;
#   STAGE=gain   tools/gpu_shared_prefix.py --model $GAIN_MODEL (default kimi-linear;
#                minimax-m3, glm-dsa, deepseek-v32: the sparse seeds at their real hidden
#                size and layer count) for $CONFIGS (default hbm kvtier native big), one
#                engine process each, one after the other, each under RUN_TIMEOUT seconds.
# Everything lands in $OUT/<stage>.tgz (the device tool returns at most 8 files).
#   STAGE=check ARCHS="kimi_linear qwen3_next" NEG="" bash bench/gpu_hybrid.sh
# The sparse seeds' gain runs (issue 14) need the gpu-kit with flashinfer (M3's Gemma norms)
# and DeepGEMM's JIT headers (the DSA indexer) in $SITE, as their checks do. Their HBM-only
# run recomputes about 835k prompt tokens on a 60-78-layer model (estimated 150-280 s, plus
# a 40-130 s start: DSA compiles 61-78 layers, later engines hit the compile cache), so it
# gets a device call of its own and the other three share the next (10-minute limit):
#   STAGE=gain GAIN_MODEL=minimax-m3 CONFIGS=hbm RUN_TIMEOUT=560 DRAM_GIB=24 bash bench/gpu_hybrid.sh
#   STAGE=gain GAIN_MODEL=minimax-m3 CONFIGS="big kvtier native" RUN_TIMEOUT=185 DRAM_GIB=24 \
#       bash bench/gpu_hybrid.sh
# (GAIN_MODEL=glm-dsa the same; DRAM_GIB 24 holds every prefix's and suffix's chunks: 13.7 GB
# for M3, 11 GB for GLM.)
set -u -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
SITE=${SITE:-/tmp/site}
STAGE=${STAGE:-check}
W=$OUT/$STAGE
mkdir -p "$W"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$SITE:$PWD/src
# FLA's autotune search (kvtier.testing.triton_autotune): every engine runs one and the same
# configuration per kernel (KEEP=1: no timing, identical kernels across processes, compiled
# once per machine); CHECK_KEEP/GAIN_KEEP=N searches N, cached on disk by the first process
export TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv > "$W/gpu.txt" 2>&1
# BENCH_COMMIT: the commit as the caller knows it (the device's copy of .git can be stale)
echo "${BENCH_COMMIT:-$(git log -1 --format='%H %s' 2>/dev/null)}" > "$W/commit.txt"
t0=$(date +%s)
if [ "$STAGE" = check ]; then
    pids=()
    for a in ${ARCHS:-kimi_linear qwen3_next}; do
        negs=()
        # NEG_<arch> (e.g. NEG_glm_moe_dsa="indexer fp8_ds_mla_scales") overrides NEG
        per_arch="NEG_$a"
        for n in ${!per_arch-${NEG:-}}; do negs+=(--negative "$n"); done
        # every engine of every architecture at once: GPU_MEM each
        GPU_TOOLS_AUTOTUNE_KEEP=${CHECK_KEEP:-1} \
            timeout "${CHECK_TIMEOUT:-420}" python3 tools/gpu_seed_check.py --arch "$a" \
            --out "$W/seed" --gpu-mem "${GPU_MEM:-0.14}" --timeout $(( ${CHECK_TIMEOUT:-420} - 15 )) \
            "${negs[@]}" > "$W/$a.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; echo "seed check pid $p rc=$?"; done
    grep -h -E "PASSED|FAILED|restore check" "$W"/*.log
    echo "seed checks done after $(( $(date +%s) - t0 )) s"
    if [ -z "${NO_TRANSFER:-}" ]; then
        timeout "${BENCH_TIMEOUT:-150}" python3 -m kvtier.cli bench transfer \
            --families kimi_linear --out "$W" --tag kimi_linear > "$W/transfer.log" 2>&1
        echo "transfer rc=$?"; grep -E "^\| kimi|ceiling" "$W/transfer.log"
    fi
elif [ "$STAGE" = gain ]; then
    n=0
    for c in ${CONFIGS:-hbm kvtier native big}; do
        n=$((n + 1))
        # kvtier-admit: kvtier with cache-aware admission (cache_aware_admission);
        # kvtier-layerwise: layer-by-layer restores (layerwise_loads) on vLLM's synchronous
        # scheduler (where a failed one is recomputed; M3 restores parked anyway: its sparse
        # layers skip the hook); kvtier-admit-layerwise: both; native-sync: native
        # offloading on that scheduler too
        extra=()
        case "$c" in
            kvtier-admit) extra=(--kvtier-config cache_aware_admission=true) ;;
            kvtier-layerwise) extra=(--kvtier-config layerwise_loads=true --no-async-scheduling) ;;
            kvtier-admit-layerwise) extra=(--kvtier-config cache_aware_admission=true
                --kvtier-config layerwise_loads=true --no-async-scheduling) ;;
            native-sync) extra=(--no-async-scheduling) ;;
        esac
        # in-process engine core: the autotune limit applies and kvtier's counters are read
        # the first engine on a fresh machine JIT-compiles every FLA/Triton kernel in its
        # untimed warm-up (H200 session 6: Kimi-Linear's first engine was still compiling at
        # 135 s): FIRST_TIMEOUT for it, RUN_TIMEOUT for the rest
        limit=${RUN_TIMEOUT:-240}
        [ "$n" = 1 ] && limit=${FIRST_TIMEOUT:-$limit}
        GPU_TOOLS_AUTOTUNE_KEEP=${GAIN_KEEP:-1} VLLM_ENABLE_V1_MULTIPROCESSING=0 \
            timeout "$limit" python3 tools/gpu_shared_prefix.py \
            --model "${GAIN_MODEL:-kimi-linear}" --dram-gib "${DRAM_GIB:-16}" \
            --config "${c%%-*}" "${extra[@]}" --out "$W/sp_${n}_$c.json" > "$W/sp_${n}_$c.log" 2>&1
        echo "$c rc=$?: $(grep -E '^(hbm|big|kvtier|native): wall' "$W/sp_${n}_$c.log" | tail -1)"
    done
fi
tar czf "$OUT/$STAGE.tgz" -C "$OUT" "$STAGE" && rm -rf "$W"
echo "done after $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# One device call (one H200, the gpu-kit's vLLM 0.25.1 at $SITE): issue 15's first-seen TTFT
# target. The 96-request agent-session run of the issue (16 sessions, an 8,192-token start,
# +1,024 tool +256 message +64 output tokens per turn, concurrency 8, 2,600 HBM blocks of 16,
# the Llama-8B shape with dummy weights) against vLLM's native offloading, in ROUNDS
# alternating pairs (`kvtier bench serving --compare ... --rounds N`: both servers start once
# and stay up, then the workload runs native, kvtier, native, kvtier, ..., each round on new
# prompts), default engine settings (CUDA graphs on). The targets: first-
# seen TTFT p50 <= 1.03x native from at least 5 pairs; with it, repeated-prefix TTFT p50 <=
# 0.7x native and throughput >= native (CONCURRENCY=2 for the other half of that target).
# Both servers share the GPU (GPU_UTIL each, a fixed KV cache) and the host (DRAM_GIB each,
# pinned), and start together.
# Needs the entry point: python3 -m pip install -q --no-deps --no-build-isolation .
# CONFIGS names the servers, in order (default "native kvtier"); "kvtier-admission" is kvtier with
# cache-aware admission on, for the issue's admission off/on report; "kvtier-xl" registers one
# KV tensor of every layer (cross_layer_blocks), "kvtier-hnd" / "kvtier-xl-hnd" ask for native's
# HND layout, "kvtier-dma" moves every group by DMA (transfer_path=dma), "kvtier-layerwise"
# restores layer by layer (layerwise_loads; "kvtier-layerwise-sync" with
# --no-async-scheduling) and "native-sync" is native under that synchronous scheduler. Everything lands in
# $OUT/agent-c$CONCURRENCY/. DRY=1 checks the chosen servers' arguments with
# `kvtier serve --dry-run` (vLLM's own parser; runs on a CPU box: PY=.venv/bin/python SITE=
# DRAM_GIB=4, as the dry run also checks dram_size against this machine's memory) and stops.
set -u -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}  # a dry run: the project's venv, e.g. PY=.venv/bin/python
ROUNDS=${ROUNDS:-5}
CONCURRENCY=${CONCURRENCY:-8}
REQUESTS=${REQUESTS:-96}
DRAM_GIB=${DRAM_GIB:-32}
GPU_UTIL=${GPU_UTIL:-0.42}
W=$OUT/agent-c$CONCURRENCY
mkdir -p "$W"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$SITE:$PWD/src
MODEL=$("$PY" -c "from kvtier.bench.offline_engine import model_dir; print(model_dir('llama8b', '/tmp'))")
# 8,192 + 5 x (1,024 + 256 + 64) + 1,024 + 256 + 64 tokens at the sixth turn: 16,256 < 20,480
# --kv-cache-memory-bytes: exactly 2,600 blocks of the Llama-8B shape (16 tokens x 128 KiB);
# it skips vLLM's memory profiling, so the servers can start together (--start-together)
COMMON="$MODEL --load-format dummy --skip-tokenizer-init --dtype bfloat16 --block-size 16 \
--num-gpu-blocks-override 2600 --kv-cache-memory-bytes 5452595200 --max-model-len 20480 \
--gpu-memory-utilization $GPU_UTIL"
NATIVE="--no-kvtier $COMMON --kv-offloading-size $DRAM_GIB"
KVTIER="$COMMON --dram-size ${DRAM_GIB}GiB"
ADMISSION="$KVTIER --kvtier-set cache_aware_admission=true"
COMPARE=()
for name in ${CONFIGS:-native kvtier}; do
    case $name in
        native) cfg=$NATIVE ;;
        kvtier) cfg=$KVTIER ;;
        kvtier-admission) cfg=$ADMISSION ;;
        # one KV tensor of every layer (whole-block DMA), in vLLM's layout or in native's
        kvtier-xl) cfg="$KVTIER --kvtier-set cross_layer_blocks=true" ;;
        kvtier-xl-hnd) cfg="$KVTIER --kvtier-set cross_layer_blocks=true --kvtier-set kv_cache_layout=HND" ;;
        kvtier-hnd) cfg="$KVTIER --kvtier-set kv_cache_layout=HND" ;;
        # every group on the copy engines (no SM gathers beside the decode steps)
        kvtier-dma) cfg="$KVTIER --kvtier-set transfer_path=dma" ;;
        # restores inside the step that computes the rest of the prompt (layerwise_loads),
        # under vLLM's default asynchronous scheduler, or its synchronous one (-sync, where a
        # failed load is recomputed rather than fatal) beside native on that scheduler
        kvtier-layerwise) cfg="$KVTIER --kvtier-set layerwise_loads=true" ;;
        kvtier-layerwise-sync) cfg="$KVTIER --kvtier-set layerwise_loads=true --no-async-scheduling" ;;
        native-sync) cfg="$NATIVE --no-async-scheduling" ;;
        *) echo "unknown config $name (native, native-sync, kvtier, kvtier-admission, kvtier-xl, kvtier-xl-hnd, kvtier-hnd, kvtier-dma, kvtier-layerwise, kvtier-layerwise-sync)"; exit 2 ;;
    esac
    # shellcheck disable=SC2086
    "$PY" -m kvtier.cli serve $cfg --dry-run > "$W/dry-run-$name.txt" 2>&1
    rc=$?; echo "dry-run $name rc=$rc: $(tail -1 "$W/dry-run-$name.txt" | head -c 300)"
    [ $rc -eq 0 ] || exit $rc
    COMPARE+=(--compare "$name=$cfg")
done
[ -n "${DRY:-}" ] && exit 0
timeout "${TIMEOUT:-570}" "$PY" -m kvtier.cli bench serving --workload agent-sessions \
    --sessions 16 --turns 6 --first-len 8192 --tool-len 1024 --message-len 256 --osl 64 \
    --concurrency "$CONCURRENCY" --requests "$REQUESTS" --rounds "$ROUNDS" --server-timeout 300 --start-together \
    "${COMPARE[@]}" --out "$W" 2>&1 | tee "$W/log" \
    | grep -v "^\s*$" | tail -60
echo "exit ${PIPESTATUS[0]}"

#!/usr/bin/env bash
# One device call (one H200; no vLLM needed): issue 18's GPU numbers for the node-wide store.
#   1. save and load GB/s through the store's shared pool against the in-process pool: the same
#      `kvtier bench transfer` cells (mha and mla_bf16 at 256 KiB and 2 MiB chunks, dma and
#      kernel paths, no GEMM; the pinned-memcpy ceiling on each pool), run
#      alternately on --host-pool slab (an engine's own pool: private memory, cudaHostRegister)
#      and --host-pool store (a private `kvtier store`'s memfd pool, attached over its socket and
#      registered as a worker does), and --host-pool memfd (the store's kind of memory made by
#      this process: it separates shared-memory pages from the store process), ROUNDS times
#      each; every pool registered in one piece; tools/store_transfer_compare.py gives the
#      table and whether the store is within 5%;
#   2. the pin time of a 64 GiB store mapping (tools/store_map_time.py --pin: store start and
#      fallocate, attach, mmap, cudaHostRegister in 1 GiB pieces, first touch).
# Everything goes under $OUT; every step has a timeout within what is left of a 285 s budget,
# so the whole stays under 5 minutes (PIN_SIZE=32GiB or ROUNDS=1 to shorten). From the
# repository root:
#   OUT=/tmp/out bash bench/gpu_store.sh
# DRY=1 runs the same steps on a CPU box (the transfer bench's --smoke, no pinning, a 1 GiB
# mapping): it checks the script, not the numbers.
# The store needs msgpack (and kvtier's config pydantic): where the image lacks them, carry
# wheels in .whl/ (git ignores nothing there: keep them out of commits), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl msgpack==1.2.4 pydantic==2.14.4 \
#     pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
set -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
ROUNDS=${ROUNDS:-2}
BUDGET=${BUDGET:-285}
PIN_TIMEOUT=${PIN_TIMEOUT:-90}
SMOKE=(); PIN=(--pin)
if [ -n "$DRY" ]; then SMOKE=(--smoke); PIN=(); PIN_SIZE=${PIN_SIZE:-1GiB}; fi
PIN_SIZE=${PIN_SIZE:-64GiB}
mkdir -p "$OUT/transfer"
export PYTHONUNBUFFERED=1
if [ -z "$DRY" ] && ls .whl/*.whl >/dev/null 2>&1; then  # the GPU image's Python (a dry run uses this one)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src
t_start=$(date +%s)
# seconds for the next step: at most $1, never past $2 s from the start
within() { local left=$(( $2 - ($(date +%s) - t_start) )); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
    free -g
    python3 -c "import torch, msgpack, pydantic; print('torch', torch.__version__, 'msgpack', msgpack.version, torch.cuda.get_device_name())"
    uname -r
    for f in /sys/kernel/mm/transparent_hugepage/{enabled,shmem_enabled,hugepages-2048kB/enabled,hugepages-2048kB/shmem_enabled}; do
        [ -r "$f" ] && echo "$f: $(cat "$f")"
    done
    grep -i huge /proc/meminfo
} 2>&1 | tee "$OUT/log"
python3 -c "import msgpack, pydantic" 2>/dev/null || { echo "msgpack or pydantic missing: see the header" | tee -a "$OUT/log"; exit 2; }
for round in $(seq 1 "$ROUNDS"); do
    for pool in ${POOLS:-slab store memfd}; do
        echo "== transfer round $round, --host-pool $pool" | tee -a "$OUT/log"
        timeout "$(within "${TRANSFER_TIMEOUT:-30}" $(( BUDGET - PIN_TIMEOUT )))" python3 -m kvtier.cli bench transfer \
            --families mha,mla_bf16 --chunks 256KiB,2MiB --modes dma,kernel --no-gemm --reps 3 --gib 1 --host-pool "$pool" "${SMOKE[@]}" \
            --tag "$pool-$round" --out "$OUT/transfer" 2>&1 | tee -a "$OUT/log"
        echo "exit $? at $(( $(date +%s) - t_start )) s" | tee -a "$OUT/log"
    done
done
python3 tools/store_transfer_compare.py "$OUT/transfer" --json "$OUT/compare.json" 2>&1 \
    | tee "$OUT/compare.md" | tee -a "$OUT/log"
# the device tool returns at most 8 files: the runs' JSON and tables travel as one archive
tar czf "$OUT/transfer.tgz" -C "$OUT" transfer && rm -rf "$OUT/transfer"
echo "== pin time of a $PIN_SIZE store mapping" | tee -a "$OUT/log"
timeout "$(within "$PIN_TIMEOUT" "$BUDGET")" python3 tools/store_map_time.py --size "$PIN_SIZE" "${PIN[@]}" \
    --json "$OUT/store_map_$PIN_SIZE.json" 2>&1 | tee -a "$OUT/log"
echo "exit $? at $(( $(date +%s) - t_start )) s (total)" | tee -a "$OUT/log"

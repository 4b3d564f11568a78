#!/usr/bin/env bash
# One device call (one H200; no vLLM needed): issue 14's GB/s of save and load for each seed
# family's registered layout, built from the tensors vLLM 0.25.1 registers
# (kvtier.bench.transfer.registered: deepseek_v32, glm_moe_dsa, minimax_m3, deepseek_v3_mtp,
# kimi_linear, each at its real layer count and kvtier's own chunk), plus the `indexer` family
# (DSA indexer rows alone, 8,448-byte pieces) at 256 KiB chunks: dma and kernel paths, alone
# and under the bench's bf16 8192^3 GEMM (the target: small pieces >= 75% of the link while
# the GEMM runs; ~36-38 GB/s on 2026-11-29 and 2026-12-01).
#   1. every family with 2 kernel streams per direction (--kernel-streams 2: kernel-path
#      batches of a direction alternate between two streams; unmeasured before this run, so
#      the engine's default stays 1 until it wins);
#   2. the A/B for that change: indexer 256 KiB and deepseek_v32 with --kernel-streams 1 (the
#      engine's default) and 2, alternating (ROUNDS pairs);
#   3. a summary table (summary.md): per cell, kernel path, save/load alone and under the
#      GEMM, against 75% of the measured pinned ceiling.
# Everything goes under $OUT; every step has a timeout within what is left of a 235 s budget.
# From the repository root:
#   OUT=/tmp/out bash bench/gpu_layouts.sh
# DRY=1 runs the same steps on a CPU box (the transfer bench's --smoke: CPU tensors, kernels
# through TRITON_INTERPRET=1, no GEMM, no ceiling): it checks the script, not the numbers.
# kvtier needs msgpack and pydantic: where the image lacks them, carry wheels in .whl/ as
# bench/gpu_store.sh's header says (pip download --no-deps ... -d .whl msgpack pydantic ...).
set -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
BUDGET=${BUDGET:-235}
ROUNDS=${ROUNDS:-2}
FAMILIES=${FAMILIES:-deepseek_v32,glm_moe_dsa,minimax_m3,deepseek_v3_mtp,kimi_linear,indexer}
AB_FAMILIES=${AB_FAMILIES:-indexer,deepseek_v32}
SMOKE=()
if [ -n "$DRY" ]; then SMOKE=(--smoke); fi
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
bench() {  # bench TIMEOUT END TAG ARGS...: one `kvtier bench transfer` run, logged
    local limit=$1 end=$2 tag=$3; shift 3
    echo "== transfer $tag: $*" | tee -a "$OUT/log"
    timeout "$(within "$limit" "$end")" python3 -m kvtier.cli bench transfer --chunks 256KiB \
        --modes dma,kernel --gib 1 --reps 3 "${SMOKE[@]}" --tag "$tag" --out "$OUT/transfer" \
        "$@" 2>&1 | tee -a "$OUT/log"
    echo "exit $? at $(( $(date +%s) - t_start )) s" | tee -a "$OUT/log"
}
{
    date -u
    echo "commit ${BENCH_COMMIT:-$(git log -1 --format='%H %s' 2>/dev/null)}"
    if [ -z "$DRY" ]; then
        nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
    fi
    free -g
    python3 -c "import torch, msgpack, pydantic; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/log"
python3 -c "import msgpack, pydantic" 2>/dev/null || { echo "msgpack or pydantic missing: see the header" | tee -a "$OUT/log"; exit 2; }
bench 120 $(( BUDGET - 90 )) layouts --families "$FAMILIES" --kernel-streams 2
for round in $(seq 1 "$ROUNDS"); do
    bench 40 $(( BUDGET - 10 )) "one-stream-$round" --families "$AB_FAMILIES" --kernel-streams 1
    bench 40 $(( BUDGET - 10 )) "two-streams-$round" --families "$AB_FAMILIES" --kernel-streams 2
done
timeout "$(within 10 "$BUDGET")" python3 - "$OUT/transfer" <<'EOF' 2>&1 | tee "$OUT/summary.md" | tee -a "$OUT/log"
import json, pathlib, re, sys
rows = ["| run | kernel streams | layout | chunk | pieces (B) | save | load | save+GEMM | load+GEMM | >= 75% of link under GEMM |",
        "|---|---|---|---|---|---|---|---|---|---|"]
for js in sorted(pathlib.Path(sys.argv[1]).glob("transfer-*.json")):
    r = json.loads(js.read_text())
    c = r.get("ceiling") or {}
    link = min(c.get("d2h", {}).get("gbps", 0), c.get("h2d", {}).get("gbps", 0)) or None
    run = re.split(r"(?:cpu-smoke|H200)-", js.stem)[-1]
    run = f"{run} | {r['meta'].get('kernel_streams')}"
    for cell in r["cells"]:
        m = cell["modes"].get("kernel")
        if not m:
            rows.append(f"| {run} | {cell['family']} | - | - | failed: {cell.get('errors')} | | | | |")
            continue
        g = lambda k: m.get(k, {}).get("gbps")
        f = lambda v: f"{v:.1f}" if v is not None else "-"
        under = [g("gemm_save"), g("gemm_load")]
        met = ("-" if link is None or None in under
               else "yes" if min(under) >= 0.75 * link else f"no ({min(under):.1f} < {0.75 * link:.1f})")
        rows.append(f"| {run} | {cell['family']} | {cell['chunk_bytes'] / 1024:.0f} KiB x{cell['blocks_per_chunk']} "
                    f"| {cell['min_piece']}..{cell['max_piece']} | {f(g('save'))} | {f(g('load'))} "
                    f"| {f(under[0])} | {f(under[1])} | {met} |")
print("\n".join(rows))
EOF
echo "total $(( $(date +%s) - t_start )) s" | tee -a "$OUT/log"

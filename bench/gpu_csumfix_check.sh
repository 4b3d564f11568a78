#!/usr/bin/env bash
# The check of the verified-restore race fix (wip/csumfix) on one H200, in one device call
# (~4 min): `kvtier bench transfer --verify` for mha 2 MiB and Kimi-Linear's layout, ROUNDS
# times with the fix and ROUNDS times with it undone in a copy of src/ (BatchCheck's sums
# buffer allocated and zeroed on the caller's stream again, as before), alternating; then the
# CUDA twins of the verified-restore tests. Each round also runs the fixed sources with
# checksums off ("off"; the order alternates per round), for the cost of verifying.
# Expected: "before" rounds show kimi_linear "FAILED ... checksum mismatch" lines (3 of 4
# engine runs did on 2026-12-01), "after" rounds none, the tests pass. All in $OUT/csumfix.tgz.
set -u -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
ROUNDS=${ROUNDS:-3}
W=$OUT/csumfix
mkdir -p "$W"
export PYTHONUNBUFFERED=1
BEFORE=$OUT/before-src
rm -rf "$BEFORE" && cp -r src "$BEFORE"
python3 - "$BEFORE/kvtier/gpu/verify.py" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
old = "        self.part: torch.Tensor | None = None\n"
assert old in s
open(p, "w").write(s.replace(old, old + "        self.device_sums()  # undone: on the caller's stream\n"))
PY
t0=$(date +%s)
declare -A fails=([before]=0 [after]=0 [off]=0)
for i in $(seq 1 "$ROUNDS"); do
    # "off": the fixed sources with checksums off, the same cells (the cost of verifying)
    order="before after off"; [ $((i % 2)) = 0 ] && order="off after before"
    for v in $order; do
        src=$PWD/src; [ "$v" = before ] && src=$BEFORE
        flag=(--verify); [ "$v" = off ] && flag=()
        PYTHONPATH=$src timeout 150 python3 -m kvtier.cli bench transfer \
            --families mha,kimi_linear --chunks 2MiB "${flag[@]}" --out "$W" --tag "$v-$i" \
            > "$W/transfer-$v-$i.log" 2>&1
        echo "transfer $v round $i rc=$?"
        grep -E "FAILED|^\| (mha|kimi_linear) " "$W/transfer-$v-$i.log"
        n=$(grep -c "FAILED" "$W/transfer-$v-$i.log"); fails[$v]=$((fails[$v] + n))
    done
done
echo "FAILED lines over $ROUNDS rounds: before ${fails[before]}, after ${fails[after]}, off ${fails[off]}" \
    "(after $(( $(date +%s) - t0 )) s)"
PYTHONPATH=$PWD/src timeout 300 python3 -m pytest -m cuda tests/test_gpu_verify_cuda.py tests/test_checksum.py -q \
    -p no:cacheprovider > "$W/pytest.log" 2>&1
echo "cuda tests rc=$?"; tail -3 "$W/pytest.log"
rm -rf "$BEFORE"; tar czf "$OUT/csumfix.tgz" -C "$OUT" csumfix && rm -rf "$W"
echo "done after $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# The CPU dry runs of the GPU scripts (bench/gpu_*.sh, tools/gpu_*.py), so that a merge that
# breaks one fails here instead of on the H200 (2026-12-01: tools/gpu_disk_check.py died before
# its first request after an internal API moved; its dry run had not been re-run). Each step
# runs a script's own dry mode with a timeout, its output in a temporary folder (removed at the
# end), and fails when the script fails or writes no result; at the end every failed step is
# named with the tail of its log and the exit status is 1. About 4 minutes on the 2-core box.
#   bash scripts/check_gpu_scripts.sh   (vLLM's CPU build: the active venv, else .venv's,
#                                        as scripts/install.sh makes it)
# .ci/run runs it as its own step before the tests. Steps:
#   syntax          bash -n of every bench/*.sh and scripts/*.sh
#   store           bench/gpu_store.sh DRY=1 ROUNDS=1 (the transfer bench's --smoke per pool,
#                   tools/store_transfer_compare.py, tools/store_map_time.py)
#   layouts         bench/gpu_layouts.sh DRY=1 ROUNDS=1 (every seed family's registered layout)
#   transfer-verify `kvtier bench transfer --verify --smoke`, kimi_linear at 2 MiB: the verified
#                   cells of bench/gpu_verify.sh and bench/gpu_csumfix_check.sh (mha: store's)
#   seed-check      tools/gpu_seed_check.py --write-only for every seed (kvtier.testing.seed_models)
#                   with every negative control: each engine's set-up up to LLM(...), no engine
#                   (bench/gpu_hybrid.sh STAGE=check; a full --cpu run is 3 engines, too slow)
#   shared-prefix   tools/gpu_shared_prefix.py --write-only for every --model and --config
#                   (bench/gpu_hybrid.sh STAGE=gain), then one real --tiny kvtier run with
#                   --verify-ab 1 (bench/gpu_behaviour_check.sh, bench/gpu_verify.sh) whose
#                   result must hold kvtier's counters and its restores
#   restore-check   tools/gpu_restore_check.py --tiny (bench/gpu_behaviour_check.sh)
#   offline         bench/gpu_offline.sh SHAPE=tiny CONFIGS=kvtier ADMISSION=1 (`kvtier bench
#                   offline` with a tiny model; both kvtier configurations with admission on)
#   serve           bench/gpu_serve.sh DRY=1 (`kvtier serve --dry-run`: vLLM's parser)
# Not here: tools/gpu_disk_check.py (bench/gpu_disk.sh), run by the default pytest run
# (tests/e2e/test_gpu_disk_check_cpu.py); tools/gpu_bare_run.py (its CPU run starts Qwen3-Next;
# its argument building is tests/test_gpu_bare_run.py's). ONLY="store serve" runs some steps,
# KEEP=1 keeps the folder.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gpu-dry.XXXXXX")
trap '[ -n "${KEEP:-}" ] && echo "check_gpu_scripts: kept $work" || rm -rf "$work"' EXIT
# this tree's sources; no gpu-kit site folder (the scripts put $SITE first on the path)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 SITE=$work/no-site TMPDIR=$work
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
failed=()

declare -A script  # step -> the GPU script it dry-runs, for the failure message
# step NAME SCRIPT TIMEOUT COMMAND...: COMMAND's output in $work/NAME.log; a failure is recorded
step() {
  local name=$1 limit=$3 t0=$SECONDS rc; script[$1]=$2; shift 3
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  timeout -k 10 "$limit" "$@" > "$work/$name.log" 2>&1
  rc=$?
  [ $rc = 124 ] && echo "timed out after $limit s" >> "$work/$name.log"
  [ $rc = 0 ] || failed+=("$name (exit $rc)")
  echo "check_gpu_scripts: $name (${script[$name]}) exit $rc in $((SECONDS - t0)) s"
}
# expect NAME WHAT COMMAND...: after step NAME passed, COMMAND must succeed (its result)
expect() {
  local name=$1 what=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  [[ " ${failed[*]} " == *" $name "* ]] && return 0
  "$@" >> "$work/$name.log" 2>&1 || failed+=("$name (no result: $what)")
}
# every "exit N" line a bench script logs after a step says 0, and there are at least $2
all_exit_zero() {
  local n bad
  n=$(grep -cE '^exit [0-9]+' "$1"); bad=$(grep -E '^exit [0-9]+' "$1" | grep -vc '^exit 0 ')
  echo "$1: $n steps, $bad failed"; [ "$n" -ge "$2" ] && [ "$bad" = 0 ]
}

step syntax 'bench/*.sh scripts/*.sh' 30 bash -c 'for f in bench/*.sh scripts/*.sh; do bash -n "$f" || exit 1; done'

step store bench/gpu_store.sh 150 env DRY=1 ROUNDS=1 OUT="$work/store" bash bench/gpu_store.sh
expect store "4 steps of exit 0" all_exit_zero "$work/store/log" 4
expect store "compare.json" test -s "$work/store/compare.json"
expect store "store_map_1GiB.json" test -s "$work/store/store_map_1GiB.json"

step layouts bench/gpu_layouts.sh 150 env DRY=1 ROUNDS=1 OUT="$work/layouts" bash bench/gpu_layouts.sh
expect layouts "3 steps of exit 0" all_exit_zero "$work/layouts/log" 3
expect layouts "a summary row per family, none failed" python - "$work/layouts/summary.md" <<'EOF'
import sys
rows = [r for r in open(sys.argv[1]) if r.startswith("| layouts ")]
assert len(rows) == 6 and not any("failed:" in r for r in rows), rows
EOF

step transfer-verify 'kvtier bench transfer --verify' 90 python -m kvtier.cli bench transfer --families kimi_linear \
  --chunks 2MiB --verify --smoke --out "$work/transfer" --tag verify
expect transfer-verify "a result without errors or checksum failures" python - "$work/transfer" <<'EOF'
import json, pathlib, sys
(js,) = pathlib.Path(sys.argv[1]).glob("transfer-*.json")
cells = json.loads(js.read_text())["cells"]
assert {c["family"] for c in cells} == {"kimi_linear"}, cells
assert all(not c.get("errors") and c["modes"] for c in cells), cells
EOF
expect transfer-verify "no FAILED cell (a checksum mismatch)" bash -c \
  "! grep -n FAILED '$work/transfer-verify.log'"

step seed-check tools/gpu_seed_check.py 120 python - "$work/seed" <<'EOF'
import importlib.util, json, os, sys
from kvtier.testing.seed_models import SEED_MODELS
spec = importlib.util.spec_from_file_location("gpu_seed_check", "tools/gpu_seed_check.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["gpu_seed_check"] = tool
spec.loader.exec_module(tool)
out = sys.argv[1]
negatives = [a for n in tool.NEGATIVE_CONTROLS for a in ("--negative", n)]
for arch in SEED_MODELS:
    assert tool.main(["--arch", arch, "--write-only", "--out", out,
                      "--model-root", os.path.join(out, "models"), *negatives]) == 0, arch
    with open(os.path.join(out, f"{arch}_write_only.json")) as f:
        runs = json.load(f)["runs"]
    assert len(runs) == 2 + len(tool.NEGATIVE_CONTROLS), arch
    assert all(os.path.isfile(os.path.join(r["engine_kwargs"]["model"], "config.json"))
               for r in runs), arch
    assert "kv_transfer_config" not in runs[0]["engine_kwargs"], arch  # cold: no connector
print(f"{len(SEED_MODELS)} seeds written: {', '.join(SEED_MODELS)}")
EOF

step shared-prefix tools/gpu_shared_prefix.py 240 bash -c '
set -e
python - "$1" <<"EOF"
import contextlib, importlib.util, io, json, os, sys
spec = importlib.util.spec_from_file_location("gpu_shared_prefix", "tools/gpu_shared_prefix.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
out = sys.argv[1]
for model in tool.MODELS:
    for config in ("hbm", "big", "kvtier", "native"):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            rc = tool.main(["--model", model, "--config", config, "--write-only",
                            "--out", os.path.join(out, "never.json"),
                            "--model-dir", os.path.join(out, "model")])
        kw = json.loads(text.getvalue().strip().splitlines()[-1])
        assert rc == 0 and os.path.isfile(os.path.join(kw["model"], "config.json")), model
        assert kw["num_gpu_blocks_override"] > 0, (model, config)
        assert ("kv_transfer_config" in kw) == (config == "kvtier"), (model, config)
        print(model, config, "blocks", kw["num_gpu_blocks_override"])
assert not os.path.exists(os.path.join(out, "never.json"))
EOF
VLLM_ENABLE_V1_MULTIPROCESSING=0 python tools/gpu_shared_prefix.py --tiny --config kvtier \
  --verify-ab 1 --prefixes 3 --prefix-len 256 --per-prefix 2 --suffix-len 64 --output-len 4 \
  --hbm-blocks 20 --dram-gib 1 --enforce-eager --kvtier-config cost_model=false \
  --model-dir "$1/tiny" --out "$1/tiny.json"
' shared-prefix "$work/shared-prefix"
expect shared-prefix "tiny.json with kvtier's counters, restores and both verify phases" \
  python - "$work/shared-prefix/tiny.json" <<'EOF'
import json, sys
res = json.load(open(sys.argv[1]))
assert res["kvtier"]["loads_ok"] > 0 and res["kvtier"]["loads_failed"] == 0, res.get("kvtier")
assert [p["verify"] for p in res["verify_ab"]] == [False, True], res["verify_ab"]
assert all(p["switched"] and p["steps"] > 0 for p in res["verify_ab"]), res["verify_ab"]
assert len(res["tokens"]) == 6 and all(len(t) == 4 for t in res["tokens"])
EOF

step restore-check tools/gpu_restore_check.py 180 python tools/gpu_restore_check.py --tiny --tokens 512 \
  --model-dir "$work/restore-model" --out "$work/restore.json"
expect restore-check "restore.json with both timings" grep -q ttft_restore_s "$work/restore.json"

step offline bench/gpu_offline.sh 240 env SHAPE=tiny CONFIGS=kvtier ADMISSION=1 OUT="$work/offline" \
  EXTRA="--prefixes 2 --prefix-len 256 --per-prefix 2 --suffix-len 64 --output-len 4 \
--hbm-blocks 14 --dram-gib 0.125 --enforce-eager --kvtier-set cost_model=false \
--model-root $work/offline-models" \
  bash bench/gpu_offline.sh
expect offline "summary.json of every run, each with kvtier's restores" \
  python - "$work/offline/offline-tiny" <<'EOF'
import json, pathlib, sys
w = pathlib.Path(sys.argv[1])
def stats(sub: str, configs: list[str]) -> dict[str, dict]:
    summary = json.loads((w / sub / "summary.json").read_text())
    assert list(summary["configs"]) == configs, summary["configs"]
    assert all(summary["configs"][c]["wall_s"] for c in configs), summary["configs"]
    return {c: json.loads((w / sub / f"{c}-r0.json").read_text())["kvtier"] for c in configs}

off = stats("admission-off", ["kvtier"])["kvtier"]
assert off["loads_ok"] > 0 and off["loads_failed"] == 0, off  # HBM is short: restores
on = stats("admission-on", ["kvtier", "kvtier-null-copy"])["kvtier"]
assert on["admission_deferred"] > 0, on  # cache_aware_admission took effect
assert (w.parent / "offline-tiny.tgz").stat().st_size > 0
EOF

step serve bench/gpu_serve.sh 90 env DRY=1 OUT="$work/serve-out" MODEL="$work/serve-tiny" bash bench/gpu_serve.sh
expect serve "vLLM's command line with kvtier's connector" \
  grep -q -- "--kv-transfer-config .*kvtier" "$work/serve-out/serve/dry-run.txt"

for f in "${failed[@]}"; do
  name=${f%% *}
  echo "check_gpu_scripts: FAILED ${script[$name]}: $f; the end of its log:"
  tail -n 25 "$work/$name.log" | sed 's/^/    /'
done
if [ ${#failed[@]} -gt 0 ]; then
  names=(); for f in "${failed[@]}"; do names+=("${script[${f%% *}]}"); done
  echo "check_gpu_scripts: ${#failed[@]} failed in $((SECONDS - start)) s: ${names[*]}"
  exit 1
fi
echo "check_gpu_scripts: ok in $((SECONDS - start)) s"

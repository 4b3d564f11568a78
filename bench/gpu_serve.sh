#!/usr/bin/env bash
# Issue 15's "once on the H200": `kvtier serve` on vLLM 0.25.1 (gpu-kit at $SITE) picks the
# server module the installed vLLM has, starts, answers two completions of one prompt, shows
# kvtier's series on /metrics, and vLLM exits when the wrapper gets SIGTERM.
# Needs the entry point: python3 -m pip install -q --no-deps --no-build-isolation .
# Everything lands in $OUT/serve/. DRY=1 stops after `kvtier serve --dry-run` (vLLM's parser
# checks the arguments; no server, runs on a CPU box) with its exit status.
set -u -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
SITE=${SITE:-/tmp/site}
PORT=${PORT:-8011}
MODEL=${MODEL:-/tmp/serve-tiny}
W=$OUT/serve
mkdir -p "$W"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$SITE:$PWD/src
python3 -c "import sys; from kvtier.testing.models import tiny_llama; print(tiny_llama(sys.argv[1]))" "$MODEL"
python3 -m kvtier.cli serve "$MODEL" --dry-run --load-format dummy --port "$PORT" \
    > "$W/dry-run.txt" 2>&1; rc=$?; echo "dry-run rc=$rc"; tail -3 "$W/dry-run.txt"
[ -n "${DRY:-}" ] && exit $rc
t0=$(date +%s)
python3 -m kvtier.cli serve "$MODEL" --dram-size 2GiB --load-format dummy \
    --port "$PORT" --max-model-len 1024 --gpu-memory-utilization 0.15 --block-size 16 --num-gpu-blocks-override 64 --skip-tokenizer-init \
    --ready-timeout 240 > "$W/serve.log" 2>&1 &
wrapper=$!
for _ in $(seq 1 240); do
    grep -q "kvtier serve: ready" "$W/serve.log" && break
    kill -0 $wrapper 2>/dev/null || break
    sleep 1
done
echo "ready after $(( $(date +%s) - t0 )) s: $(grep -c 'kvtier serve: ready' "$W/serve.log")"
python3 - "$PORT" "$MODEL" > "$W/completions.json" <<'PY'
import json, sys, urllib.request
port, model = sys.argv[1], sys.argv[2]
a = [100 + (i * 37) % 800 for i in range(700)]
b = [100 + (i * 53 + 7) % 800 for i in range(700)]
out = []
for i, prompt in enumerate([a, b, a]):  # 64 HBM blocks of 16: b pushes a out of HBM
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        c = json.load(r)["choices"][0]
    out.append({"token_ids": c.get("token_ids")})
print(json.dumps({"completions": out, "a_identical": out[0] == out[2]}))
PY
echo "completions rc=$?: $(cat "$W/completions.json" | head -c 300)"
curl -s "http://127.0.0.1:$PORT/metrics" > "$W/metrics.txt"
grep -E "^(vllm:)?kvtier" "$W/metrics.txt" | grep -v " 0.0$" | head -40
grep -E "prompt_tokens_by_source" "$W/metrics.txt" | head
kill -TERM $wrapper; sleep 15
echo "wrapper alive after SIGTERM: $(kill -0 $wrapper 2>/dev/null && echo yes || echo no)"
echo "vLLM processes left: $(pgrep -f 'vllm.entrypoints' | wc -l)"
grep -E "server module|api_server|kvtier serve" "$W/serve.log" | head -5
tail -20 "$W/serve.log" > "$W/serve-tail.txt"

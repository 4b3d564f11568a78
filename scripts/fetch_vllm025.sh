#!/usr/bin/env bash
# Unpack the Python part of vLLM 0.25.1 (the version in the GPU kit) into .cache/vllm-0.25.1,
# so that scheduler-side tests run against it on CPU with PYTHONPATH=.cache/vllm-0.25.1.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.cache/vllm-0.25.1
[ -f "$DEST/vllm/__init__.py" ] && exit 0
mkdir -p .cache/wheels "$DEST"
WHL=$(ls .cache/wheels/vllm-0.25.1-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$WHL" ]; then
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d .cache/wheels vllm==0.25.1
  WHL=$(ls .cache/wheels/vllm-0.25.1-*.whl | head -n1)
fi
python - "$WHL" "$DEST" <<'PY'
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.endswith(".py") or n.endswith(".json")
             or ".dist-info/" in n]
    z.extractall(dest, names)
print(f"vLLM 0.25.1 Python sources in {dest} ({len(names)} files)")
PY

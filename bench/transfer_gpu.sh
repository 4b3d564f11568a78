#!/usr/bin/env bash
# One device call (the H200 machine): the GPU correctness tests, then the full
# `kvtier bench transfer`. Run from the repository root with $OUT set; extra arguments go to
# the bench. Wheels for what the GPU image lacks travel in .whl/ (git ignores it; carry it):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 \
#     annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
set -o pipefail
OUT=${OUT:-/tmp/kvtier-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the gpu-kit, when installed into /tmp/site, already holds these
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current,temperature.gpu,power.draw --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/log"
if [ -z "$SKIP_TESTS" ]; then
    t0=$(date +%s)
    timeout "${TEST_TIMEOUT:-150}" python3 -m pytest tests/test_gpu_cuda.py -q -p no:cacheprovider \
        --maxfail=20 > "$OUT/pytest.log" 2>&1
    echo "pytest exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/log"
    tail -40 "$OUT/pytest.log" | tee -a "$OUT/log"
fi
timeout "${BENCH_TIMEOUT:-270}" python3 -m kvtier.cli bench transfer --out "$OUT" "$@" 2>&1 | tee -a "$OUT/log"

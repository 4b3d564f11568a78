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
# Real Redis servers for the remote tier's tests (a standalone one and a three-node cluster),
# stopped when this script exits; CI (.ci/run) requires them, elsewhere they start if they can.
if [ "${KVTIER_TEST_REDIS_REQUIRED:-0}" = 1 ] || command -v redis-server >/dev/null; then
  redis_dir=$(mktemp -d)
  # The trap keeps pytest's exit status: a clean-up hiccup must neither fail a green run nor
  # hide a red one.
  trap 'rc=$?; bash scripts/redis_servers.sh stop "$redis_dir" || true; rm -rf "$redis_dir" || true; exit $rc' EXIT
  eval "$(bash scripts/redis_servers.sh start "$redis_dir")"
fi
# Two pytest-xdist workers, a test file each at a time (module-scoped engines start once): most of an e2e
# test is one busy process (imports, engine start-up, a spawned server), so two files at once
# keep both cores of the CI machine busy. `-n 0` after it runs everything in one process.
python -m pytest -n 2 --dist loadfile "$@"

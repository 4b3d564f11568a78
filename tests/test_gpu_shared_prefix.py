"""tools/gpu_shared_prefix.py without an engine: the sparse seeds' gain runs (issue 14) start
the model they claim (real hidden size, layer count and cache geometry, 8 experts, the seed's
fp8 and block-size arguments), each configuration gets its own connector or native offloading,
and the HBM budgets hold what the workload needs (about two prefixes; every prefix for
``big``). Parsed with vLLM 0.32's config classes; 0.25.1 builds them on the H200 only."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest

from _tools import load_tool
from kvtier.testing.seed_models import SEED_MODELS

get_config = pytest.importorskip("vllm.transformers_utils.config").get_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpu_shared_prefix.py"
REQUEST = 16384 + 1024 + 32  # prefix, suffix, output tokens

# model -> (layers, dense-attention layers, hidden, block size, KV bytes per block per layer)
SEEDS = {
    "minimax-m3": (60, 3, 6144, 128, None),
    "glm-dsa": (78, None, 6144, 64, (656 + 132) * 64),
    "deepseek-v32": (61, None, 7168, 64, (576 * 2 + 132) * 64),
}


def _tool() -> ModuleType:
    return load_tool("gpu_shared_prefix")


def _kwargs(tool: ModuleType, tmp: pathlib.Path, model: str, config: str) -> dict[str, Any]:
    args = tool.parse_args(["--model", model, "--config", config, "--out", str(tmp / "o.json"),
                            "--model-dir", str(tmp / "m")])
    kw, vocab = tool.engine_kwargs(args)
    assert 100 <= vocab + 100 <= 4096  # prompts inside the seeds' 4,096-token vocabulary
    return kw


@pytest.mark.parametrize("model", sorted(SEEDS))
def test_a_sparse_seed_runs_at_its_real_size(model: str, tmp_path: pathlib.Path) -> None:
    tool = _tool()
    layers, dense, hidden, block, _ = SEEDS[model]
    kw = _kwargs(tool, tmp_path, model, "hbm")
    text = get_config(kw["model"], trust_remote_code=False).get_text_config()
    assert text.architectures == [SEED_MODELS[tool.SPARSE_SEEDS[model]].architecture]
    assert (text.num_hidden_layers, text.hidden_size) == (layers, hidden)
    experts = getattr(text, "n_routed_experts", None) or text.num_local_experts
    assert experts == 8
    if dense is not None:  # M3: layers 0-2 dense attention + MLP, 3-59 sparse + MoE
        freq = text.sparse_attention_config["sparse_attention_freq"]
        assert freq == [0] * dense + [1] * (layers - dense) == text.moe_layer_freq
    assert text.max_position_embeddings >= kw["max_model_len"] >= REQUEST
    seed = SEED_MODELS[tool.SPARSE_SEEDS[model]].engine_args
    assert {k: kw[k] for k in seed} == seed  # the seed's fp8 KV, block size, index dtype
    assert kw.get("block_size", 64) == block
    assert kw["max_num_seqs"] == 16 and kw["enable_prefix_caching"] is True
    assert kw["max_num_batched_tokens"] == 8192 and kw["enforce_eager"] is False


@pytest.mark.parametrize("model", sorted(SEEDS))
def test_hbm_holds_about_two_prefixes_and_big_every_prefix(model: str,
                                                           tmp_path: pathlib.Path) -> None:
    tool = _tool()
    block = SEEDS[model][3]
    per_request = -(-REQUEST // block)
    hbm = _kwargs(tool, tmp_path, model, "hbm")["num_gpu_blocks_override"]
    big = _kwargs(tool, tmp_path, model, "big")["num_gpu_blocks_override"]
    assert 2.0 < hbm / per_request < 2.6  # Llama's 2,600 blocks of 16: 2.39 requests
    assert big * block >= 192_000 > 8 * (16384 + 1024)  # as Llama's 12,000 blocks of 16
    for config in ("kvtier", "native"):
        assert _kwargs(tool, tmp_path, model, config)["num_gpu_blocks_override"] == hbm


def test_each_configuration_gets_its_offload(tmp_path: pathlib.Path) -> None:
    tool = _tool()
    kv = _kwargs(tool, tmp_path, "minimax-m3", "kvtier")["kv_transfer_config"]
    assert kv.kv_connector == "KvtierConnector"
    assert kv.kv_connector_extra_config["dram_size"] == "48GiB"
    assert _kwargs(tool, tmp_path, "glm-dsa", "native")["kv_offloading_size"] == 48.0
    for config in ("hbm", "big"):
        kw = _kwargs(tool, tmp_path, "deepseek-v32", config)
        assert "kv_transfer_config" not in kw and "kv_offloading_size" not in kw


def test_layerwise_runs_take_the_synchronous_scheduler(tmp_path: pathlib.Path) -> None:
    """bench/gpu_hybrid.sh's kvtier-layerwise and native-sync: both sides of that pair run
    vLLM's synchronous scheduler (where a failed load by layer is recomputed, not fatal)."""
    tool = _tool()
    base = ["--model", "minimax-m3", "--out", str(tmp_path / "o.json"),
            "--model-dir", str(tmp_path / "m")]
    for config, extra in (("kvtier", ["--kvtier-config", "layerwise_loads=true"]),
                          ("native", [])):
        args = tool.parse_args([*base, "--config", config, *extra, "--no-async-scheduling"])
        kw, _ = tool.engine_kwargs(args)
        assert kw["async_scheduling"] is False
        if config == "kvtier":
            extra_config = kw["kv_transfer_config"].kv_connector_extra_config
            assert extra_config["layerwise_loads"] is True
    plain, _ = tool.engine_kwargs(tool.parse_args([*base, "--config", "native"]))
    assert "async_scheduling" not in plain  # vLLM's default otherwise


def test_the_seed_declarations_stay_as_declared(tmp_path: pathlib.Path) -> None:
    tool = _tool()
    declared = json.dumps(SEED_MODELS["minimax_m3"].engine_args, sort_keys=True)
    kw = _kwargs(tool, tmp_path, "minimax-m3", "hbm")
    kw["attention_config"]["indexer_kv_dtype"] = "edited"  # as vLLM edits what it is given
    assert json.dumps(SEED_MODELS["minimax_m3"].engine_args, sort_keys=True) == declared


def test_m3_kv_bytes_per_block_as_documented(tmp_path: pathlib.Path) -> None:
    """MODELS' comment: 9.73 MB per M3 block (fp8 K/V on every layer, bf16 index keys on the
    sparse ones), so ``big`` (1,500 blocks) takes 14.6 GB beside about 73 GB of weights."""
    tool = _tool()
    text = get_config(_kwargs(tool, tmp_path, "minimax-m3", "hbm")["model"],
                      trust_remote_code=False).get_text_config()
    sparse = sum(text.sparse_attention_config["sparse_attention_freq"])
    kv = 2 * 128 * text.num_key_value_heads * text.head_dim  # fp8: one byte
    index = 128 * text.sparse_attention_config["sparse_index_dim"] * 2
    per_block = text.num_hidden_layers * kv + sparse * index
    assert round(per_block / 1e6, 2) == 9.73
    for _, _, _, block, per_layer in SEEDS.values():
        assert per_layer is None or per_layer % block == 0


def test_write_only_prints_the_engine_arguments(tmp_path: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "--model", "glm-dsa", "--config", "big",
                           "--out", str(tmp_path / "o.json"), "--model-dir",
                           str(tmp_path / "m"), "--write-only"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kw = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kw["num_gpu_blocks_override"] == 3000 and kw["kv_cache_dtype"] == "fp8"
    assert (pathlib.Path(kw["model"]) / "config.json").is_file()
    assert not (tmp_path / "o.json").exists()

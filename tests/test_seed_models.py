"""The seed-architecture configurations (kvtier.testing.seed_models): each parses with vLLM
0.32's config classes (all six architectures exist in 0.32), keeps the real geometry it claims,
and carries every ``config.X`` that vLLM 0.25.1's model code for it reads.

What this cannot check here: that 0.25.1 builds the model (that needs CUDA kernels; the GPU
bare run, tools/gpu_bare_run.py, does it), and 0.25.1's own config parsing for
``glm_moe_dsa``, which uses the GPU host's transformers (``GlmMoeDsaConfig``).
"""

from __future__ import annotations

import ast
import os
import pathlib
from typing import Any

import pytest

from kvtier.testing.seed_models import SEED_MODELS

get_config = pytest.importorskip("vllm.transformers_utils.config").get_config

VLLM025 = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "vllm-0.25.1" / "vllm"

# The 0.25.1 source files whose ``config.X`` reads each architecture goes through.
MODEL_SOURCES = {
    "kimi_linear": ["model_executor/models/kimi_linear.py"],
    "qwen3_next": ["model_executor/models/qwen3_next.py"],
    "deepseek_v32": ["model_executor/models/deepseek_v2.py"],
    "glm_moe_dsa": ["model_executor/models/deepseek_v2.py"],
    "minimax_m3": ["models/minimax_m3/nvidia/model.py"],
    "deepseek_v3_mtp": ["model_executor/models/deepseek_v2.py",
                        "model_executor/models/deepseek_mtp.py"],
}

# Reads that are absent on purpose, each off this architecture's path.
ABSENT_OFF_PATH = {
    # the indexer is built only when hasattr(config, "index_topk") (deepseek_v2.py:1076)
    "deepseek_v3_mtp": {"index_topk", "index_n_heads", "index_head_dim"},
    # outer-config reads of MiniMaxM3SparseForConditionalGeneration (model.py:1077-1100)
    "minimax_m3": {"text_config", "vision_config"},
}


def _config_reads(source: str) -> set[str]:
    """Attribute names read off a variable called config / hf_config / text_config."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("config", "hf_config", "text_config")):
            out.add(node.attr)
    return out


def _parsed(name: str, tmp_path: pathlib.Path) -> Any:
    folder = SEED_MODELS[name].write(str(tmp_path / name))
    return get_config(folder, trust_remote_code=False)


@pytest.mark.parametrize("name", sorted(SEED_MODELS))
def test_parses_with_vllm032_and_names_its_architecture(name: str,
                                                        tmp_path: pathlib.Path) -> None:
    config = _parsed(name, tmp_path)
    assert config.architectures == [SEED_MODELS[name].architecture]
    assert config.get_text_config().vocab_size == 4096


@pytest.mark.skipif(not VLLM025.is_dir(), reason="vLLM 0.25.1 sources not unpacked in .cache")
@pytest.mark.parametrize("name", sorted(SEED_MODELS))
def test_every_field_vllm025_reads_is_present(name: str, tmp_path: pathlib.Path) -> None:
    text = _parsed(name, tmp_path).get_text_config()
    reads = set().union(*(_config_reads((VLLM025 / f).read_text())
                          for f in MODEL_SOURCES[name]))
    missing = {a for a in reads if not hasattr(text, a)}
    assert missing == ABSENT_OFF_PATH.get(name, set())


def test_kimi_linear_keeps_the_kda_and_mla_geometry(tmp_path: pathlib.Path) -> None:
    c = _parsed("kimi_linear", tmp_path)
    lin = c.linear_attn_config
    assert (lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]) == (32, 128, 4)
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == (
        512, 64, 128, 128)
    assert [c.is_kda_layer(i) for i in range(4)] == [True, True, True, False]
    assert c.hidden_size == 2304 and c.num_attention_heads == 32


def test_qwen3_next_keeps_the_delta_net_geometry(tmp_path: pathlib.Path) -> None:
    c = _parsed("qwen3_next", tmp_path)
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
            c.linear_value_head_dim, c.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 2, 256)


@pytest.mark.parametrize("name,rank,rope,index", [
    ("deepseek_v32", 512, 64, (64, 128, 2048)), ("glm_moe_dsa", 512, 64, (32, 128, 2048))])
def test_dsa_keeps_the_mla_and_indexer_geometry(name: str, rank: int, rope: int,
                                                index: tuple[int, int, int],
                                                tmp_path: pathlib.Path) -> None:
    c = _parsed(name, tmp_path)
    assert (c.kv_lora_rank, c.qk_rope_head_dim) == (rank, rope)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == index


def test_minimax_m3_has_dense_and_sparse_layers_and_fp8(tmp_path: pathlib.Path) -> None:
    text = _parsed("minimax_m3", tmp_path).get_text_config()
    sparse = text.sparse_attention_config
    assert sparse["sparse_attention_freq"] == [0, 1, 1, 1]
    assert (sparse["sparse_index_dim"], sparse["sparse_block_size"],
            sparse["sparse_topk_blocks"]) == (128, 128, 16)
    assert (text.num_key_value_heads, text.head_dim) == (4, 128)
    args = SEED_MODELS["minimax_m3"].engine_args
    # fp8 dense and sparse K/V; bf16 index keys, the only ones 0.25.1's Triton indexer (the
    # Hopper one) takes (the fp8 index cache needs SM100's MSA impl)
    assert args["kv_cache_dtype"] == "fp8"
    assert args["attention_config"] == {"indexer_kv_dtype": "bf16"}
    # the block size is given: 0.25.1 would take the dense layers' 16, which its sparse and
    # index backends refuse (their only kernel block size is the sparse block)
    assert args["block_size"] == sparse["sparse_block_size"]
    for module in ("sparse_attention.py", "indexer.py"):
        code = (VLLM025 / "models" / "minimax_m3" / "common" / module).read_text()
        body = code.split("def get_supported_kernel_block_sizes", 1)[1].split("def ", 1)[0]
        assert f"return [{args['block_size']}]" in body, module


def test_qwen3_next_uses_the_triton_gdn_prefill_the_kit_has() -> None:
    assert SEED_MODELS["qwen3_next"].engine_args == {"gdn_prefill_backend": "triton"}


def _engine_args_fields() -> set[str]:
    tree = ast.parse((VLLM025 / "engine" / "arg_utils.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    return {n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@pytest.mark.skipif(not VLLM025.is_dir(), reason="vLLM 0.25.1 sources not unpacked in .cache")
@pytest.mark.parametrize("name", sorted(SEED_MODELS))
def test_every_engine_arg_is_a_vllm025_engine_arg(name: str) -> None:
    assert set(SEED_MODELS[name].engine_args) <= _engine_args_fields()


def test_mtp_seed_has_one_draft_layer_and_three_speculative_tokens(
        tmp_path: pathlib.Path) -> None:
    c = _parsed("deepseek_v3_mtp", tmp_path)
    assert c.num_nextn_predict_layers == 1 and not hasattr(c, "index_topk")
    spec = SEED_MODELS["deepseek_v3_mtp"].engine_args["speculative_config"]
    assert spec == {"method": "mtp", "num_speculative_tokens": 3}


def test_a_folder_rewritten_while_engines_read_it_is_never_half_written(tmp_path) -> None:
    """The check starts its kvtier, cold and control engines at once on one model folder, and
    each rewrites it (H200 2026-12-02: a reader got a partial config.json). Readers racing
    writers always parse a whole file."""
    import json
    import threading

    folder = str(tmp_path / "m")
    model = SEED_MODELS["deepseek_v3_mtp"]
    model.write(folder, max_len=4096)
    stop = threading.Event()
    errors: list[Exception] = []

    def rewrite() -> None:
        while not stop.is_set():
            model.write(folder, max_len=4096)

    writers = [threading.Thread(target=rewrite) for _ in range(2)]
    for w in writers:
        w.start()
    try:
        for _ in range(300):
            for name in ("config.json", "generation_config.json"):
                try:
                    with open(os.path.join(folder, name)) as f:
                        json.load(f)
                except Exception as e:  # any failure to parse is the defect
                    errors.append(e)
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert errors == []
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]

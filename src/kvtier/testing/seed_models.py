"""Dummy-weight model folders (config.json only) that keep the seed architectures' real KV-cache
and state geometry, for bare runs and restore checks on the GPU host (vLLM 0.25.1).

Each writer keeps every number that shapes what vLLM registers - hidden size, attention head
counts and head dims, MLA ranks, indexer head dim and top-k, linear-attention heads, state and
conv dims, the layer-kind pattern - and reduces only what does not: layer count, expert count,
top-k of the router where the expert count forces it, vocabulary. The docstrings name the public
config.json each number comes from. Checked against 0.25.1's model code (every ``config.X`` the
model reads is present: tests/test_seed_models.py) and parsed with vLLM 0.32's config classes.

``SEED_MODELS`` adds the engine arguments a seed needs beyond vLLM's defaults (fp8 KV where the
seed ran fp8, speculative decoding for MTP, a kernel choice where the gpu-kit lacks vLLM's
default kernel), so a tool can start each one the way it ran; a docstring says where a run
on the H200 differs from the seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.testing.models import _write  # one writer of dummy-weight model folders

VOCAB = 4096  # every seed: reduced vocabulary (token-id prompts, no tokenizer)


def _common(architecture: str, model_type: str, max_len: int) -> dict[str, Any]:
    return {"architectures": [architecture], "model_type": model_type, "vocab_size": VOCAB,
            "max_position_embeddings": max_len, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def kimi_linear(path: str, layers: int = 4, max_len: int = 8192) -> str:
    """``KimiLinearForCausalLM``: KDA linear attention + MLA (the layout of Kimi-K3, seed 004).

    Source: moonshotai/Kimi-Linear-48B-A3B-Instruct config.json. Kept: hidden_size 2304,
    num_attention_heads 32 (= num_key_value_heads), MLA kv_lora_rank 512, q_lora_rank null,
    qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, mla_use_nope true;
    linear_attn_config num_heads 32, head_dim 128, short_conv_kernel_size 4 (so each KDA layer
    holds a 32x128x128 recurrent state plus q/k/v conv states of width 3); the 3:1 KDA/MLA
    pattern (real: MLA at 1-based layers 4, 8, ..., 24, 27); first_k_dense_replace 1,
    moe_intermediate_size 1024, intermediate_size 9216, num_shared_experts 1, sigmoid router,
    routed_scaling_factor 2.446. Reduced: 27 -> ``layers`` layers (default 4: KDA 1, 2, 3;
    MLA 4, one pattern period; ``layers=27`` keeps the real count and pattern, 20 KDA and 7
    MLA layers), 256 -> 8 experts (8 -> 2 per token), vocab 163840 -> 4096.
    """
    full = [i for i in range(4, layers + 1, 4)]
    if layers == 27:
        full.append(27)  # the real model ends on an MLA layer
    kda = [i for i in range(1, layers + 1) if i not in full]
    return _write(path, {
        **_common("KimiLinearForCausalLM", "kimi_linear", max_len),
        "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": layers,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "first_k_dense_replace": 1, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_experts": 8,
        "num_experts_per_token": 2, "num_shared_experts": 1, "routed_scaling_factor": 2.446,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full,
                               "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    })


def qwen3_next(path: str, layers: int = 4, max_len: int = 8192) -> str:
    """``Qwen3NextForCausalLM``: gated delta-net (linear attention) + gated full attention.

    Source: Qwen/Qwen3-Next-80B-A3B-Instruct config.json. Kept: hidden_size 2048,
    num_attention_heads 16, num_key_value_heads 2, head_dim 256, partial_rotary_factor 0.25,
    rope_theta 1e7; linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim
    128, linear_value_head_dim 128, linear_conv_kernel_dim 4 (conv state 3 x 8192, SSM state
    32 x 128 x 128 per layer); full_attention_interval 4 (layers 3, 7, ... are full attention);
    moe_intermediate_size 512, shared_expert_intermediate_size 512, decoder_sparse_step 1.
    Reduced: 48 -> ``layers`` layers (default 4: one period, three delta-net layers and one
    full-attention layer), 512 -> 8 experts (10 -> 2 per token), vocab 151936 -> 4096.

    Started with ``gdn_prefill_backend="triton"`` (``SEED_MODELS``): on SM90 0.25.1's "auto"
    picks FlashInfer's GDN prefill (``qwen_gdn_linear_attn.py:_resolve_gdn_prefill_backend``),
    which the gpu-kit lacks; "triton" selects FLA's Triton ``chunk_gated_delta_rule``. The
    kernel choice leaves the cache geometry (conv and SSM state shapes) as it is.
    """
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
             for i in range(layers)]
    return _write(path, {
        **_common("Qwen3NextForCausalLM", "qwen3_next", max_len),
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25, "attention_bias": False, "attention_dropout": 0.0,
        "full_attention_interval": 4, "layer_types": types,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    })


def _deepseek_v3_mla(layers: int) -> dict[str, Any]:
    """DeepSeek-V3 attention and MoE geometry (deepseek-ai/DeepSeek-V3 and V3.2-Exp share it):
    hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64,
    v_head_dim 128, YaRN factor 40 over 4096, moe_intermediate_size 2048, intermediate 18432.
    Reduced: layers, 256 -> 8 routed experts (8 -> 2 per token, n_group 8 -> 1 so that the
    grouped router stays valid), first_k_dense_replace 3 -> 1 (layer 0 dense, the rest MoE)."""
    return {
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": layers, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "attention_bias": False, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
    }


def deepseek_v32(path: str, layers: int = 2, max_len: int = 8192) -> str:
    """``DeepseekV32ForCausalLM``: MLA + the DSA lightning indexer (one KV-cache group holding
    MLA and indexer caches). On CUDA the indexer needs DeepGEMM
    (0.25.1 ``model_executor/layers/sparse_attn_indexer.py:728-732``).

    Source: deepseek-ai/DeepSeek-V3.2-Exp config.json: the V3 geometry (``_deepseek_v3_mla``)
    plus index_n_heads 64, index_head_dim 128, index_topk 2048. Reduced: 61 -> ``layers``
    layers, experts as in ``_deepseek_v3_mla``, vocab 129280 -> 4096. Runs in bf16 (the
    FLASH_ATTN_MLA_SPARSE row of issue 14; GLM below covers fp8).
    """
    return _write(path, {
        **_common("DeepseekV32ForCausalLM", "deepseek_v32", max_len), **_deepseek_v3_mla(layers),
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
        "num_nextn_predict_layers": 0,
    })


def glm_moe_dsa(path: str, layers: int = 2, max_len: int = 8192) -> str:
    """``GlmMoeDsaForCausalLM`` (GLM-5.x, seeds 000/001): MLA + DSA indexer, fp8 KV.

    Source: zai-org/GLM-5 config.json (as mirrored by xLLM's glm_moe_dsa defaults): hidden 6144,
    64 heads (= KV heads), q_lora_rank 2048, kv_lora_rank 512, qk_nope_head_dim 192,
    qk_rope_head_dim 64, v_head_dim 256, index_n_heads 32, index_head_dim 128, index_topk 2048,
    indexer_rope_interleave true, rope_theta 1e6, moe_intermediate_size 2048, intermediate 12288,
    sigmoid noaux_tc router, routed_scaling_factor 2.5. Reduced: 78 -> ``layers`` layers,
    first_k_dense_replace 3 -> 1, 256 -> 8 experts (8 -> 2 per token), vocab 154880 -> 4096,
    num_nextn_predict_layers 1 -> 0 (MTP is covered by ``deepseek_v3_mtp``). The seeds ran
    ``--kv-cache-dtype fp8`` (the 656-byte ``fp8_ds_mla`` rows, FLASHMLA_SPARSE).

    On pristine 0.25.1 every DSA model with fp8 KV fails at start-up, whatever its config:
    FLASHMLA_SPARSE rewrites the cache dtype to ``fp8_ds_mla`` (656 B/token), but
    ``MLAAttention.get_kv_cache_spec`` leaves ``kv_quant_mode`` NONE, so the runner reshapes
    the pages with ``cache_dtype_str="auto"`` as 576 elements (``gpu_model_runner.py:7192``;
    vllm-project/vllm#48378, fixed by #48379 after 0.25.1). tools/gpu_bare_run.py applies
    #48379's fix on 0.25.x and records it.
    """
    return _write(path, {
        **_common("GlmMoeDsaForCausalLM", "glm_moe_dsa", max_len),
        "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 64,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "head_dim": 64, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "attention_bias": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
        "indexer_rope_interleave": True, "num_nextn_predict_layers": 0,
    })


def minimax_m3(path: str, max_len: int = 8192, layers: int = 4, dense_layers: int = 1) -> str:
    """``MiniMaxM3SparseForCausalLM`` (seed 003): dense K/V layers, sparse K/V layers and the
    sparse layers' index-key caches, fp8 KV and fp8 index cache as the seed ran.

    Source: the MiniMax-M3-preview ``text_config`` as mirrored by vLLM 0.25.1's
    ``transformers_utils/configs/minimax_m3.py`` defaults (no public config.json found):
    hidden 6144, 64 query heads, 4 KV heads, head_dim 128, partial rotary 0.5 (64 dims),
    rope_theta 5e6, sparse_index_dim 128, sparse_num_index_heads 4, sparse_topk_blocks 16,
    sparse_block_size 128, init/local blocks 0/1, intermediate 3072, dense intermediate 12288,
    4 experts per token, swigluoai. Written as the outer ``minimax_m3_vl`` config (vLLM has no
    config class for a bare ``minimax_m3_text``), without vision. Reduced: 60 -> ``layers``
    layers, the first ``dense_layers`` of them dense attention + dense MLP and the rest sparse
    attention + MoE (real: 60 and 3; default 4 and 1), 128 -> 8 experts, vocab 200064 ->
    4096, no MTP module.

    Differs from the seed on Hopper: the index-key cache is bf16, (nb, bs, 128) at 256 B per
    token per sparse layer instead of the seed's fp8 128 B. 0.25.1 has two indexer impls
    (``models/minimax_m3/common/indexer.py:select_indexer_impl_cls``): MSA (fmha_sm100 score +
    Triton top-k, bf16 or fp8 index cache) only on SM100 with top-k blocks in 4/8/16/32, and
    Triton (bf16 only) everywhere else. The dense and sparse K/V stay fp8 (per-tensor scales):
    the Triton main impl, the one on Hopper, dequantizes fp8 K/V itself.
    """
    if not 0 < dense_layers < layers:
        raise ValueError(f"{dense_layers} dense layers of {layers}: M3 needs both kinds")
    pattern = [0] * dense_layers + [1] * (layers - dense_layers)
    text = {
        "model_type": "minimax_m3_text", "architectures": ["MiniMaxM3SparseForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": 6144, "intermediate_size": 3072,
        "dense_intermediate_size": 12288, "shared_intermediate_size": 3072,
        "num_hidden_layers": len(pattern), "num_attention_heads": 64, "num_key_value_heads": 4,
        "head_dim": 128, "max_position_embeddings": max_len, "rms_norm_eps": 1e-6,
        "use_gemma_norm": True, "attention_output_gate": False, "rope_theta": 5000000,
        "rotary_dim": 64, "partial_rotary_factor": 0.5, "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 7.0, "use_qk_norm": True,
        "qk_norm_type": "per_head", "num_local_experts": 8, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "scoring_func": "sigmoid", "use_routing_bias": True,
        "routed_scaling_factor": 2.0, "num_mtp_modules": 0, "moe_layer_freq": pattern,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": 128, "sparse_num_index_heads": 4,
            "sparse_topk_blocks": 16, "sparse_block_size": 128,
            "sparse_disable_index_value": pattern, "sparse_score_type": "max",
            "sparse_init_block": 0, "sparse_local_block": 1, "sparse_attention_freq": pattern},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    return _write(path, {
        "architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3_vl",
        "text_config": text, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    })


def deepseek_v3_mtp(path: str, layers: int = 2, max_len: int = 8192) -> str:
    """``DeepseekV3ForCausalLM`` with one MTP layer (``num_nextn_predict_layers`` 1), served as
    its own draft (``DeepSeekMTPModel``, FLASH_ATTN_MLA) with 3 speculative tokens as in seed
    001. Source: deepseek-ai/DeepSeek-V3 config.json (``_deepseek_v3_mla``; num_nextn 1 is
    real). Reduced: 61 -> ``layers`` target layers, experts, vocab 129280 -> 4096.
    """
    return _write(path, {
        **_common("DeepseekV3ForCausalLM", "deepseek_v3", max_len), **_deepseek_v3_mla(layers),
        "num_nextn_predict_layers": 1,
    })


@dataclass(frozen=True)
class SeedModel:
    """One seed architecture: how to write it and how it has to be started.

    ``engine_args`` are the ``LLM(...)`` arguments the seed ran with beyond vLLM's defaults
    (fp8 KV, speculative decoding); ``needs`` names what the GPU host must provide."""

    name: str
    architecture: str
    write: Callable[..., str]  # (path, *, max_len=...) -> the folder
    engine_args: dict[str, Any] = field(default_factory=dict)
    needs: str = ""


SEED_MODELS: dict[str, SeedModel] = {m.name: m for m in (
    SeedModel("kimi_linear", "KimiLinearForCausalLM", kimi_linear),
    SeedModel("qwen3_next", "Qwen3NextForCausalLM", qwen3_next,
              engine_args={"gdn_prefill_backend": "triton"}),
    SeedModel("deepseek_v32", "DeepseekV32ForCausalLM", deepseek_v32,
              needs="DeepGEMM with its JIT headers and a CUDA compiler (DSA indexer)"),
    SeedModel("glm_moe_dsa", "GlmMoeDsaForCausalLM", glm_moe_dsa,
              engine_args={"kv_cache_dtype": "fp8"},
              needs="DeepGEMM with its JIT headers and a CUDA compiler (DSA indexer); "
                    "transformers with GlmMoeDsaConfig; on 0.25.1 the fp8_ds_mla spec fix "
                    "(vllm-project/vllm#48379)"),
    # block_size 128 (the sparse block): vLLM 0.25.1 takes the block size from the first
    # non-SSM layer's backend, a dense FLASH_ATTN layer (16), and then finds no kernel block
    # size for the sparse and index caches, which take only 128 (`No common block size for
    # 16`, select_common_block_size; H200, 2026-12-01)
    SeedModel("minimax_m3", "MiniMaxM3SparseForCausalLM", minimax_m3,
              engine_args={"kv_cache_dtype": "fp8", "block_size": 128,
                           "attention_config": {"indexer_kv_dtype": "bf16"}}),
    SeedModel("deepseek_v3_mtp", "DeepseekV3ForCausalLM", deepseek_v3_mtp,
              engine_args={"speculative_config": {"method": "mtp",
                                                  "num_speculative_tokens": 3}}),
)}

"""Tiny dummy-weight model folders (config.json only) for vLLM's CPU build.

CPU attention needs head_dim >= 32 and block sizes that are multiples of 32. Float32: on
AVX2 hosts without AVX-512/AMX it is much faster than bfloat16 (docs/design.md §5).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def _write(path: str, config: dict[str, Any]) -> str:
    """Writes the folder's two JSON files, each under a temporary name then renamed: engines
    started at once on the same folder (a check's kvtier, cold and control processes) may
    rewrite it while another reads it, and must never read half a file (H200 2026-12-02: an
    engine failed with "config.json is not a valid JSON file")."""
    os.makedirs(path, exist_ok=True)
    _write_json(os.path.join(path, "config.json"), config)
    _write_json(os.path.join(path, "generation_config.json"),
                {"bos_token_id": 1, "eos_token_id": 2})
    return path


def _write_json(path: str, obj: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def tiny_llama(path: str, layers: int = 2, hidden: int = 256, vocab: int = 1024,
               max_len: int = 8192) -> str:
    """A Llama-style model: 4 query heads, 2 KV heads, head_dim 64."""
    return _write(path, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    })


def tiny_deepseek_v2(path: str, layers: int = 2) -> str:
    """DeepSeek-V2-Lite-shaped MLA model (kv_lora_rank 512 + rope 64 = 576-wide latent rows),
    2 layers, the second a small MoE."""
    return _write(path, {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": layers,
        "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "scoring_func": "softmax", "topk_method": "greedy", "norm_topk_prob": False,
        "rope_theta": 10000.0, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False, "attention_bias": False,
    })


def tiny_deepseek_v3_mtp(path: str, layers: int = 2) -> str:
    """:func:`tiny_deepseek_v2`'s MLA shape as ``DeepseekV3ForCausalLM`` with one MTP layer
    (``num_nextn_predict_layers`` 1), served as its own draft (``--speculative-config
    '{"method": "mtp"}'``); vLLM registers the draft layer as ``model.layers.{layers}``."""
    return _write(path, {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1, "vocab_size": 1024, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_method": "greedy",
        "norm_topk_prob": False, "rope_theta": 10000.0, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "attention_bias": False,
    })


def tiny_gemma2(path: str, layers: int = 4, window: int = 128) -> str:
    """Gemma-2-style model: layers alternate sliding-window (even) and full attention (odd),
    which vLLM serves as two KV-cache groups."""
    return _write(path, {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "num_hidden_layers": layers, "vocab_size": 1024,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "sliding_window": window,
        "query_pre_attn_scalar": 64, "attn_logit_softcapping": None,
        "final_logit_softcapping": None, "torch_dtype": "float32", "bos_token_id": 1,
        "eos_token_id": 2, "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 10000.0,
    })

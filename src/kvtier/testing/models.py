"""Tiny dummy-weight model folders (config.json only) for vLLM's CPU build.

CPU attention needs head_dim >= 32 and block sizes that are multiples of 32. Float32: on
AVX2 hosts without AVX-512/AMX it is about 4x faster than bfloat16 (DESIGN.md §5).
"""

from __future__ import annotations

import json
import os
from typing import Any


def _write(path: str, config: dict[str, Any]) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return path


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

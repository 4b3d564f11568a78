"""The layouts real models register, for ``kvtier bench transfer``: each cache exactly as
vLLM 0.25.1 hands it to a connector (``register_kv_caches``) on the H200, at the model's real
layer count and at kvtier's own chunk for it (the default ``chunk_tokens``: the smallest
multiple of the block size of at least 256 tokens), whatever ``--chunks`` asks.

Where the numbers come from:

- the H200 registrations of the 4-layer seed configurations
  (:mod:`kvtier.testing.seed_models`): ``bench/results/2026-12-01-bare-gpu-h200-vllm025/run2/
  {deepseek_v32,glm_moe_dsa,deepseek_v3_mtp,kimi_linear}.json`` (every tensor's shape,
  dtype and strides) and kvtier's worker census of the same configurations
  (``bench/results/2026-12-01-gpu-h200-session3/check-*/seed/*_kvtier.json``: groups, block
  size, bytes per block; MiniMax-M3's only record: its bare run2 stopped before registering);
- the real layer counts and patterns from the public configs the seed docstrings name, and
  vLLM 0.25.1's model code (``.cache/vllm-0.25.1``) for which layer registers what.

``tests/test_gpu_bench_transfer.py`` builds every family at the census's layer counts and
checks its bytes per block (and, where run2 recorded them, its tensor shapes) against those
files. ``smoke`` builds the census configuration itself (a few MB on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvtier.bench.transfer.cases import CacheCase, _attn, _Sizing


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float32": 4, "uint8": 1}[dtype]


def _row_bytes(spec: tuple[tuple[int, ...], str]) -> int:
    """Bytes of one block of a cache given as (shape without the block axis, dtype)."""
    shape, dtype = spec
    return math.prod(shape) * _itemsize(dtype)


def _one_group(family: str, z: _Sizing, block_size: int,
               rows: dict[str, tuple[tuple[int, ...], str]], kv_cache_dtype: str, note: str,
               scalar_scales: tuple[str, ...] = ()) -> CacheCase:
    """One full-attention group of every cache in ``rows`` (layer -> block shape, dtype),
    chunks of kvtier's default chunk tokens, and enough distinct blocks for ``z.span`` bytes
    per direction (an odd count: the block axis is never ambiguous). ``scalar_scales``: the
    layers holding vLLM's per-tensor ``_k_scale``/``_v_scale`` (scalars, 1.0)."""
    from kvtier.geometry import resolve_chunk_tokens

    bpc = resolve_chunk_tokens(None, [block_size]) // block_size
    block_bytes = sum(_row_bytes(s) for s in rows.values())
    chunks = -(-z.span // (bpc * block_bytes))
    nb = max(17, 2 * chunks * bpc + 8) | 1
    tensors: dict[str, Any] = {nm: ((nb, *shape), dt) for nm, (shape, dt) in rows.items()}
    return CacheCase(family, z.chunk, tensors, [("full", block_size, list(rows))], nb, [bpc],
                     scales={nm: ((), "float32") for nm in scalar_scales},
                     note=note, kv_cache_dtype=kv_cache_dtype)


def _indexer(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


def dsa_rows(layers: int, mla_row: tuple[tuple[int, ...], str]
             ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every layer's MLA cache and its DSA indexer's key cache, as 0.25.1 registers them in one
    ``UniformTypeKVCacheSpecs`` group (block 64, sparse MLA): the indexer cache
    ``(nb, 64, 132)`` uint8, 128 fp8 values and one float32 scale per token (index_head_dim
    128 in 128-wide quant blocks), one per layer when the config has no ``index_topk_freq``
    (``deepseek_v2.py``: ``_skip_topk``)."""
    rows: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(layers):
        rows[_indexer(i)] = ((64, 132), "uint8")
        rows[_attn(i)] = mla_row
    return rows


def deepseek_v32(family: str, z: _Sizing, layers: int | None = None) -> CacheCase:
    """DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, bf16, FLASH_ATTN_MLA_SPARSE): 61 layers of
    MLA ``(nb, 64, 576)`` bf16 and indexer ``(nb, 64, 132)`` uint8 (run2/deepseek_v32.json at
    2 layers; census 164,352 bytes per block there). 5,012,736 bytes per block; chunk = 4
    blocks (256 tokens, 20.1 MB), pieces of 73,728 and 8,448 bytes."""
    n = layers if layers is not None else (61 if not z.smoke else 2)
    return _one_group(family, z, 64, dsa_rows(n, ((64, 576), "bfloat16")), "auto",
                      f"{n} MLA + {n} indexer caches, block 64")


def glm_moe_dsa(family: str, z: _Sizing, layers: int | None = None) -> CacheCase:
    """GLM-5 (``GlmMoeDsaForCausalLM``, ``--kv-cache-dtype fp8``, FLASHMLA_SPARSE): 78 layers
    (zai-org/GLM-5 config.json) of ``fp8_ds_mla`` rows ``(nb, 64, 656)`` uint8 (512 fp8 latent
    values, 4 float32 scales, 64 bf16 rope values per token) and indexer ``(nb, 64, 132)``
    uint8 (run2/glm_moe_dsa.json at 2 layers; census 100,864 bytes per block there).
    3,933,696 bytes per block; chunk = 4 blocks (15.7 MB). GLM-5.2 (seed 000) registers 21
    indexers for its 78 layers (IndexCache, ``index_topk_freq``); not modelled here."""
    n = layers if layers is not None else (78 if not z.smoke else 2)
    return _one_group(family, z, 64, dsa_rows(n, ((64, 656), "uint8")), "fp8_ds_mla",
                      f"{n} fp8_ds_mla MLA + {n} indexer caches, block 64")


M3_DENSE_LAYERS, M3_LAYERS = 3, 60


def minimax_m3_rows(dense: int, sparse: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """MiniMax-M3 on the H200 with the seed's engine arguments (``kv_cache_dtype=fp8``,
    ``block_size=128``, ``indexer_kv_dtype=bf16``, the Triton indexer Hopper runs): dense
    layers (``MiniMaxM3Attention``, FLASH_ATTN: ``(nb, 2, 128, 4, 128)`` fp8 as uint8) first,
    then sparse layers, each with its block-compact sparse K/V (``MiniMaxM3SparseBackend``:
    ``(nb, 2, bs, H, D)`` = ``(nb, 2, 128, 4, 128)`` fp8) and its index-key cache
    ``...self_attn.attn.index_cache`` (``MiniMaxM3IndexerBackend``: ``(nb, 128, 128)`` bf16)
    (``models/minimax_m3/{nvidia/model.py,common/sparse_attention.py,common/indexer.py}``)."""
    rows: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(dense + sparse):
        rows[_attn(i)] = ((2, 128, 4, 128), "uint8")
        if i >= dense:
            rows[_attn(i) + ".index_cache"] = ((128, 128), "bfloat16")
    return rows


def minimax_m3(family: str, z: _Sizing, dense: int | None = None,
               sparse: int | None = None) -> CacheCase:
    """MiniMax-M3 (``MiniMaxM3SparseForCausalLM``): 60 layers, 0-2 dense and 3-59 sparse
    (``sparse_attention_freq`` ``[0]*3 + [1]*57``, 0.25.1's ``configs/minimax_m3.py``), so
    60 K/V caches of 131,072 bytes per block and 57 index caches of 32,768: 9,732,096 bytes
    per 128-token block; chunk = 2 blocks (19.5 MB). The census (1 dense + 3 sparse layers,
    7 caches) read 622,592 bytes per block. The fp8 scales are per tensor: the dense
    layers hold vLLM's scalar ``_k_scale``/``_v_scale`` (kvtier keys them, they are no block
    bytes); the sparse impl reads raw e4m3 and keeps no scale tensor."""
    d = dense if dense is not None else (M3_DENSE_LAYERS if not z.smoke else 1)
    s = sparse if sparse is not None else (M3_LAYERS - M3_DENSE_LAYERS if not z.smoke else 3)
    return _one_group(family, z, 128, minimax_m3_rows(d, s), "fp8",
                      f"{d} dense + {s} sparse K/V, {s} index caches, block 128",
                      scalar_scales=tuple(_attn(i) for i in range(d)))


def deepseek_v3_mtp(family: str, z: _Sizing, layers: int | None = None) -> CacheCase:
    """DeepSeek-V3 with its MTP draft (``speculative_config`` method ``mtp``, 3 tokens;
    FLASH_ATTN_MLA, block 16): 61 target layers and the draft's layer
    ``model.layers.61.self_attn.attn``, all MLA ``(nb, 16, 576)`` bf16 in one group
    (run2/deepseek_v3_mtp.json: 2 target + 1 draft; census 55,296 bytes per block there).
    1,142,784 bytes per block; chunk = 16 blocks (18.3 MB)."""
    n = layers if layers is not None else (61 if not z.smoke else 2)
    rows = {_attn(i): ((16, 576), "bfloat16") for i in range(n + 1)}
    return _one_group(family, z, 16, rows, "auto", f"{n} target + 1 MTP draft layer, block 16")


def kimi_linear(family: str, z: _Sizing) -> CacheCase:
    """Kimi-Linear's registered layout as vLLM 0.25.1 gives it to a connector on the H200
    (bench/results/2026-12-01-bare-gpu-h200-vllm025/run2/kimi_linear.json, scaled to the real
    27 layers): 7 MLA layers ``(nb, 1888, 576)`` bf16 and 20 KDA layers whose page of 2,174,976
    bytes holds the q/k/v conv state ``(3, 12288)`` bf16 then the recurrent state
    ``(32, 128, 128)`` float32 (4 KiB of padding at the end). The block size (1,888 tokens) is
    what vLLM chose to make both page sizes equal, so the chunk is one block (15.2 MB of KV)
    whatever ``chunk`` asks, and every chunk carries its boundary's state object (20 pages,
    43.5 MB), as a boundary at every chunk would: 74% of the bytes moved are state. Blocks
    are distinct per direction (the loads are spot-checked)."""
    n_mla, n_kda = (7, 20) if not z.smoke else (2, 3)
    bs, page = (1888, 2174976) if not z.smoke else (16, 18432 + 4096)
    conv, rec = ((3, 12288), (32, 128, 128)) if not z.smoke else ((3, 64), (2, 16, 32))
    width = 576 if not z.smoke else 16
    boundary = n_mla * bs * width * 2 + n_kda * (math.prod(conv) * 2 + math.prod(rec) * 4)
    chunks = -(-z.span // boundary)  # KV chunk + its state object
    nb = max(17, 2 * chunks + 8) | 1  # distinct blocks for every chunk and state, per direction
    mla = [_attn(i) for i in range(n_mla)]
    kda = [f"model.layers.{i}.self_attn" for i in range(n_mla, n_mla + n_kda)]
    tensors: dict[str, Any] = {nm: ((nb, bs, width), "bfloat16") for nm in mla}
    for nm in kda:
        tensors[nm] = [((nb, *conv), "bfloat16"), ((nb, *rec), "float32")]
    return CacheCase(family, z.chunk, tensors, [("full", bs, mla), ("state", bs, kda)],
                     nb, [1, 1], state_every=1, page_bytes={nm: page for nm in kda},
                     note=f"chunk = one {bs}-token block + its state object")


BUILDERS: dict[str, Callable[[str, _Sizing], CacheCase]] = {
    "kimi_linear": kimi_linear, "deepseek_v32": deepseek_v32, "glm_moe_dsa": glm_moe_dsa,
    "minimax_m3": minimax_m3, "deepseek_v3_mtp": deepseek_v3_mtp,
}

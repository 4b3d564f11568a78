"""The sparse seed families at unit level, from vLLM 0.25.1's own backend shapes (the committed
table tests/data/vllm025_kv_layouts.json, as the H200 runs register them), for what cannot run
end to end on CPU (0.32's CPU build refuses sparse attention) (issue 14):

- DSA on Hopper, one KV-cache group of MLA and indexer caches: FLASHMLA_SPARSE's 656-byte
  ``fp8_ds_mla`` rows and FLASH_ATTN_MLA_SPARSE's bf16 rows, each beside
  DEEPSEEK_V32_INDEXER's 132-byte rows;
- GLM-5.2's 78 MLA and 21 indexer caches in one group: the slab is sized by bytes per block,
  not by a layer count;
- MiniMax-M3: dense fp8 K/V, block-compact sparse fp8 K/V ``(nb, 2, bs, H, D)`` with
  per-tensor scales, and the fp8 index cache, one group;
- ATOM-style scale tensors on the layer that kvtier cannot map: the connector refuses to
  start with one ``kvtier: ...`` line naming the layer, the tensor, its shape and strides.

Each layout is checked with :func:`_kvcheck.check_group`: kvtier's segments move exactly the
bytes vLLM addresses as each block (single-backend layouts: tests/test_layout_vllm025.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _kvcheck import BlockAddresser, check_group
from kvtier.config import KvtierConfig
from kvtier.geometry import Geometry
from kvtier.layout import GroupKind, GroupSpec, Layout, build_layout
from test_layout_vllm025 import RECORDS, TABLE, addresser, block_dim, build

NB = TABLE["num_blocks"]


def record(backend: str, cache_dtype: str, block_size: int, **params: Any) -> dict[str, Any]:
    """The table's record of ``backend`` in its identity stride order (one layer tensor)."""
    for r in RECORDS:
        p = r["params"]
        if (r["backend"] == backend and p["cache_dtype_str"] == cache_dtype
                and p["block_size"] == block_size and not p.get("include_num_layers_dimension")
                and r["stride_order"] in (None, list(range(len(r["shape"]))))
                and all(p.get(k) == v for k, v in params.items())):
            return r
    raise LookupError(f"{backend} {cache_dtype} block {block_size} {params}")


def one_group(layers: dict[str, dict[str, Any]], kv_cache_dtype: str,
              objects: dict[str, object] | None = None) -> tuple[Layout, list[BlockAddresser]]:
    """The layers (name -> record) registered as one full-attention group, and vLLM's
    addressing of each block in kvtier's format order (layer number, then role)."""
    kvs = {n: build(r) for n, r in layers.items()}
    block_size = next(iter(layers.values()))["params"]["block_size"]
    spec = GroupSpec(GroupKind.FULL, block_size, tuple(kvs))
    lay = build_layout(kvs, [spec], NB, kv_cache_dtype=kv_cache_dtype, layers=objects,
                       block_axes={n: block_dim(r) for n, r in layers.items()})
    order = sorted(kvs, key=lambda n: (int(n.split(".")[2]), "index" in n))
    return lay, [addresser(kvs[n], block_dim(layers[n])) for n in order]


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def indexer(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


@pytest.mark.parametrize("backend, kv_cache_dtype, row_bytes", [
    ("FLASHMLA_SPARSE", "fp8_ds_mla", 656),  # 512 fp8 + 4 float32 scales + 64 bf16 rope
    ("FLASH_ATTN_MLA_SPARSE", "auto", 576 * 2),  # bf16 latent rows
])
def test_dsa_sparse_mla_and_indexer_in_one_group(backend: str, kv_cache_dtype: str,
                                                 row_bytes: int) -> None:
    mla = record(backend, kv_cache_dtype, 64)
    index = record("DEEPSEEK_V32_INDEXER", "fp8", 64)
    assert index["shape"] == [NB, 64, 132]  # 128 fp8 keys + one float32 scale per token
    layers = {}
    for i in range(2):
        layers[attn(i)] = mla
        layers[indexer(i)] = index
    lay, addressers = one_group(layers, kv_cache_dtype)
    g = lay.group(0)
    assert g.bytes_per_block == 2 * 64 * (row_bytes + 132)
    assert [(s.layer_index, s.role) for s in g.segments] == [
        (0, "kv"), (0, "index"), (1, "kv"), (1, "index")]
    check_group(g, addressers, count=4)


def test_glm52_78_mla_and_21_indexer_caches_are_sized_by_bytes() -> None:
    # GLM-5.2 (seed 000): 78 MLA layers with fp8_ds_mla rows and 21 indexer caches in one
    # group. Which layers carry an indexer does not change the sizes; here every third.
    mla = record("FLASHMLA_SPARSE", "fp8_ds_mla", 64)
    index = record("DEEPSEEK_V32_INDEXER", "fp8", 64)
    layers: dict[str, dict[str, Any]] = {attn(i): mla for i in range(78)}
    layers.update({indexer(3 * k): index for k in range(21)})
    lay, addressers = one_group(layers, "fp8_ds_mla")
    g = lay.group(0)
    per_block = 64 * (78 * 656 + 21 * 132)
    assert g.bytes_per_block == per_block
    assert sum(s.role == "index" for s in g.segments) == 21
    chunk = 256
    geo = Geometry.of_layout(lay, chunk)
    assert geo.chunk_bytes(0) == chunk // 64 * per_block
    config = KvtierConfig(dram_size="512MiB")
    (cls,) = geo.slab_layout(config, 1).classes
    assert cls.slot_bytes == geo.chunk_bytes(0)
    assert cls.num_slots == 512 * 2**20 // cls.stride
    # a tier that took 99 layers of the largest row would size slots 3.4% too large
    # (and one that took 78 would cut 21 indexer rows off every chunk)
    assert 99 * 656 * 64 * (chunk // 64) != cls.slot_bytes != 78 * 656 * 64 * (chunk // 64)
    check_group(g, addressers, count=2)


class _Layer:
    """An attention layer as the runner sees it: vLLM's per-tensor fp8 scales."""

    def __init__(self, k_scale: float, v_scale: float) -> None:
        self._k_scale = torch.tensor(k_scale)
        self._v_scale = torch.tensor(v_scale)


def test_minimax_m3_dense_sparse_and_index_caches_in_one_group() -> None:
    # MiniMax-M3 on vLLM (not ATOM): a dense layer's fp8 K/V (FLASH_ATTN), sparse layers'
    # block-compact fp8 K/V (nb, 2, bs, H, D) and their fp8 index caches (nb, bs, 132).
    dense = record("FLASH_ATTN", "fp8", 16, num_kv_heads=2, kv_cache_layout="NHD")
    sparse = record("MINIMAX_M3_SPARSE", "fp8", 16)
    index = record("MINIMAX_M3_INDEXER", "fp8", 16)
    assert sparse["shape"] == [NB, 2, 16, 2, 128] and index["shape"] == [NB, 16, 132]
    layers = {attn(0): dense, attn(1): sparse, attn(2): sparse,
              "model.layers.1.self_attn.indexer.index_cache": index,
              "model.layers.2.self_attn.indexer.index_cache": index}
    objects: dict[str, object] = {attn(i): _Layer(0.5, 0.25) for i in range(3)}
    lay, addressers = one_group(layers, "fp8", objects)
    g = lay.group(0)
    assert g.bytes_per_block == 16 * (3 * 2 * 2 * 128 + 2 * 132)
    # K and V regions live inside each block: one run per layer; the index cache after it
    assert [(s.layer_index, s.role) for s in g.segments] == [
        (0, "kv"), (1, "kv"), (1, "index"), (2, "kv"), (2, "index")]
    # per-tensor scales are no bytes of a block: they are part of the format (namespace)
    assert lay.fixed_scales == {f"{attn(i)}.{s}": v for i in range(3)
                                for s, v in (("_k_scale", 0.5), ("_v_scale", 0.25))}
    objects[attn(1)] = _Layer(0.5, 0.125)
    assert one_group(layers, "fp8", objects)[0].fingerprint != lay.fingerprint
    check_group(g, addressers, count=4)


class _AtomLayer(torch.nn.Module):
    """ATOM-style: per-token-per-head fp8 scales kept on the layer in a tensor whose leading
    axis is not the block axis (heads first)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.k_scale = torch.rand(num_blocks, 16, 2).permute(2, 1, 0)  # (heads, tokens, nb)
        self._k_scale = torch.tensor(1.0)


def test_a_scale_on_the_layer_kvtier_cannot_map_refuses_to_start() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.vllm.connector import KvtierConnector
    from kvtier.vllm.startup import StartupError
    from tests.harness.compat import LAYERS
    from tests.test_connector_startup import _configs

    cfg, kvc = _configs("recompute", {"dram_size": "8MiB"})
    layer = _AtomLayer(kvc.num_blocks)
    cfg.compilation_config.static_forward_context = {LAYERS[0]: layer}
    c = KvtierConnector(cfg, KVConnectorRole.WORKER, kvc)
    kvs = {n: torch.zeros(kvc.num_blocks, 2, 16, 1, 1) for n in LAYERS}
    with pytest.raises(StartupError) as e:
        c.register_kv_caches(kvs)
    line = str(e.value)
    assert line.startswith("kvtier: ") and "\n" not in line
    for part in (LAYERS[0], "'k_scale'", str(tuple(layer.k_scale.shape)),
                 str(tuple(layer.k_scale.stride())), "without the kvtier connector"):
        assert part in line, (part, line)
    assert c.worker_side.worker is None  # nothing was started

"""The restore check's byte-level negative controls (kvtier.testing.controls) around the real
CPU engine, on caches vLLM 0.32's own code allocates with the real row shapes: each switch
leaves exactly the bytes it names unrestored (they keep the fill pattern), every other byte
of every restored block is restored, and nothing else changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import customize_attention_spec

from _families import drain, make_mover
from _vllm032 import LAYOUTS, Allocated, allocate
from kvtier.layout import GroupKind, GroupSpec, Layout, build_layout
from kvtier.protocol import Job, TransferOp
from kvtier.testing.controls import (
    ByteMask,
    MaskedLoads,
    draft_layers,
    fp8_ds_mla_scale_bytes,
    indexer_layers,
    layer_bytes,
    per_token_head_scale_bytes,
)
from kvtier.transfer import ThreadedTransferEngine
from test_layout_vllm032 import attn, dense_spec, mla_spec

NB = 37
FILL = 0x47
SRC, DST = [3, 4], [20, 31]  # one chunk of two blocks, restored into other blocks


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Elements as bytes: shape ``t.shape + (element size,)``."""
    return t.contiguous().view(torch.uint8).view(*t.shape, t.element_size())


def round_trip(kv_caches: dict[str, torch.Tensor], lay: Layout, mask: ByteMask | None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], MaskedLoads]:
    """Random caches; save blocks SRC as one chunk; fill every byte with FILL; load the chunk
    into blocks DST with ``mask`` on. Returns each layer's source blocks (before) and all its
    blocks (after), as bytes."""
    gen = torch.Generator().manual_seed(7)
    for t in kv_caches.values():
        st = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        st.copy_(torch.randint(0, 256, (st.numel(),), dtype=torch.uint8, generator=gen))
    before = {n: _bytes(t[SRC]).clone() for n, t in kv_caches.items()}
    chunk = 2 * lay.groups[0].spec.block_size
    mover = make_mover(lay, chunk, [2], 1, pin=False)
    engine = MaskedLoads(ThreadedTransferEngine(mover), lay)
    try:
        engine.save(Job(1, "r", [TransferOp(0, 0, SRC)]))
        assert drain(engine, {1})[1].ok
        for t in kv_caches.values():
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(FILL)
        engine.mask = mask
        engine.load(Job(2, "r", [TransferOp(0, 0, DST)]))
        assert drain(engine, {2})[2].ok
    finally:
        engine.close()
        mover.slab.close()
    after = {n: _bytes(t).clone() for n, t in kv_caches.items()}
    return before, after, engine


def check(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
          unrestored: Callable[[str, torch.Tensor], torch.Tensor]) -> int:
    """Every layer: the blocks DST hold the source bytes except where ``unrestored(name,
    block bytes)`` is True, which hold FILL; every other block is FILL. Returns the number of
    unrestored bytes."""
    n = 0
    for name, src in before.items():
        got = after[name][DST]
        keep = unrestored(name, got)
        assert torch.equal(got[~keep], src[~keep]), f"{name}: a byte outside the mask differs"
        assert bool((got[keep] == FILL).all()), f"{name}: a masked byte was restored"
        others = [b for b in range(NB) if b not in DST]
        assert bool((after[name][others] == FILL).all()), f"{name}: another block changed"
        n += int(keep.sum())
    return n


def nothing(name: str, b: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(b, dtype=torch.bool)


def sparse_mla_with_indexer(layout: KVCacheLayout) -> Allocated:
    """GLM-5.x / DeepSeek-V3.2 DSA: fp8_ds_mla 656-byte rows and the indexer's 132-byte rows
    (128 fp8 keys, one float32 scale), one group (test_layout_vllm032 cites the lines)."""
    sparse = replace(mla_spec(FlashMLASparseBackend, 64, "fp8_ds_mla", dtype=torch.uint8),
                     is_index_group_leader=True)
    index = customize_attention_spec(DeepseekV32IndexerBackend, MLAAttentionSpec(
        block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER))
    specs = {}
    for i in range(2):
        specs[attn(i)] = sparse
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = index
    return allocate(specs, layout, NB)


def layout_of(a: Allocated, kv_cache_dtype: str) -> Layout:
    return build_layout(a.kv_caches, a.group_specs(), a.num_blocks, kv_cache_dtype)


BLOCK_COMPACT = [lay for lay in LAYOUTS if lay.is_block_compact]


@pytest.mark.parametrize("layout", BLOCK_COMPACT, ids=lambda x: x.name)
def test_no_mask_restores_every_byte(layout: KVCacheLayout) -> None:
    a = sparse_mla_with_indexer(layout)
    before, after, engine = round_trip(a.kv_caches, layout_of(a, "fp8_ds_mla"), None)
    assert check(before, after, nothing) == 0 and engine.masked == 0


@pytest.mark.parametrize("layout", BLOCK_COMPACT, ids=lambda x: x.name)
def test_fp8_ds_mla_scales_alone_are_left_unrestored(layout: KVCacheLayout) -> None:
    a = sparse_mla_with_indexer(layout)
    mla = [n for n in a.kv_caches if n.endswith(".attn")]
    assert a.kv_caches[mla[0]].shape[-1] == 656
    mask = fp8_ds_mla_scale_bytes(a.kv_caches, mla)

    def scales(name: str, b: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros_like(b, dtype=torch.bool)
        if name in mla:
            keep[..., 512:528, :] = True  # (block, 1, 64 tokens, 656 bytes, 1)
        return keep

    before, after, engine = round_trip(a.kv_caches, layout_of(a, "fp8_ds_mla"), mask)
    n = check(before, after, scales)
    assert n == engine.masked == len(DST) * len(mla) * 64 * 16


@pytest.mark.parametrize("layout", BLOCK_COMPACT, ids=lambda x: x.name)
def test_skipping_the_indexer_cache_leaves_exactly_its_bytes(layout: KVCacheLayout) -> None:
    a = sparse_mla_with_indexer(layout)
    idx = indexer_layers(a.kv_caches)
    assert idx == [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(2)]
    one = idx[:1]  # one named segment: layer 0's indexer; layer 1's is restored
    before, after, engine = round_trip(a.kv_caches, layout_of(a, "fp8_ds_mla"),
                                       layer_bytes(a.kv_caches, one))

    def layer(name: str, b: torch.Tensor) -> torch.Tensor:
        return torch.full_like(b, name in one, dtype=torch.bool)

    assert check(before, after, layer) == engine.masked == len(DST) * 64 * 132


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_per_token_head_scales_alone_are_left_unrestored(layout: KVCacheLayout) -> None:
    spec = dense_spec(TritonAttentionBackend, dtype=torch.uint8,
                      kv_cache_dtype="fp8_per_token_head")
    a = allocate({attn(i): spec for i in range(2)}, layout, NB)
    # vLLM 0.32: (blocks, heads, tokens, [K 64 fp8 | K scale | V 64 fp8 | V scale])
    assert a.kv_caches[attn(0)].shape == (NB, 2, 16, 2 * (64 + 4))
    names = list(a.kv_caches)
    before, after, engine = round_trip(a.kv_caches, layout_of(a, "fp8_per_token_head"),
                                       per_token_head_scale_bytes(a.kv_caches, names))

    def scales(name: str, b: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros_like(b, dtype=torch.bool)
        keep[..., 64:68, :] = True
        keep[..., 132:136, :] = True
        return keep

    assert check(before, after, scales) == engine.masked == len(DST) * 2 * 2 * 16 * 2 * 4
    # They are the bytes the backend reads as its scales: its own views see the fill.
    impl = TritonAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2,
                               alibi_slopes=None, sliding_window=None,
                               kv_cache_dtype="fp8_per_token_head")
    filled = torch.full((4,), FILL, dtype=torch.uint8).view(torch.float32)
    kv = a.kv_caches[attn(0)]
    saved = kv[DST].clone()
    impl._ensure_scale_caches(kv)  # sets every scale to 1.0
    kv[DST] = saved
    assert impl._k_scale_cache is not None and impl._v_scale_cache is not None
    assert bool((impl._k_scale_cache[DST] == filled).all())
    assert bool((impl._v_scale_cache[DST] == filled).all())


def test_per_token_head_scales_of_the_vllm025_layout() -> None:
    # vLLM 0.25.1's TRITON_ATTN fp8_per_token_head shape from the committed table of its
    # backends (tests/data/vllm025_kv_layouts.json): (blocks, 2, tokens, heads, 128 + 4).
    shape = (NB, 2, 16, 1, 132)
    kvs = {attn(i): torch.empty(shape, dtype=torch.uint8) for i in range(2)}
    spec = GroupSpec(GroupKind.FULL, 16, tuple(kvs))
    lay = build_layout(kvs, [spec], NB, "fp8_per_token_head")
    before, after, engine = round_trip(kvs, lay, per_token_head_scale_bytes(kvs, list(kvs)))

    def scales(name: str, b: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros_like(b, dtype=torch.bool)
        keep[..., 128:, :] = True
        return keep

    assert check(before, after, scales) == engine.masked == len(DST) * 2 * 2 * 16 * 4


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_draft_layers_alone_are_left_unrestored(layout: KVCacheLayout) -> None:
    # DeepSeek-V3 with one MTP layer: two target MLA layers and the draft's, one group
    # (bench/results/2026-12-01-bare-gpu-h200-vllm025/run2/deepseek_v3_mtp.json).
    spec = mla_spec(FlashMLABackend, 64)
    a = allocate({attn(i): spec for i in range(3)}, layout, NB)
    drafts = draft_layers(a.kv_caches, num_target_layers=2)
    assert drafts == [attn(2)]
    before, after, engine = round_trip(a.kv_caches, layout_of(a, "auto"),
                                       layer_bytes(a.kv_caches, drafts))

    def layer(name: str, b: torch.Tensor) -> torch.Tensor:
        return torch.full_like(b, name in drafts, dtype=torch.bool)

    assert check(before, after, layer) == engine.masked == len(DST) * 64 * 576 * 2


def test_a_mask_needs_the_rows_it_names() -> None:
    a = allocate({attn(0): mla_spec(FlashMLABackend, 64)}, KVCacheLayout.LBHNC, NB)
    with pytest.raises(ValueError, match="not fp8_ds_mla rows"):
        fp8_ds_mla_scale_bytes(a.kv_caches, [attn(0)])


def test_indexer_layers_finds_minimax_m3_index_caches() -> None:
    """MiniMax-M3's index cache registers under its attention layer's name in vLLM 0.25.1
    (``...self_attn.attn.index_cache``): the control found none of them on the H200 and
    refused (2026-12-01); dense and sparse K/V are not index caches."""
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn",
             "model.layers.1.self_attn.attn.index_cache", "model.layers.3.self_attn.attn",
             "model.layers.3.self_attn.attn.index_cache"]
    assert indexer_layers(names) == [names[2], names[4]]

"""Layout families of docs/design.md §2.2 on vLLM 0.32, each built by vLLM's own code.

Every test goes specs -> ``get_kv_cache_groups`` -> ``get_kv_cache_config_from_groups`` ->
``allocate_kv_cache`` (which calls ``create_kv_cache_views``) and then checks, with
:func:`_kvcheck.check_group`, that kvtier's segments move exactly the bytes vLLM addresses as
each block (poison everything, random scattered blocks, bit-identical round trip).
Specs are built the way the layers build them (file:line of vLLM 0.32 cited at each test).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import pytest
import torch
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import (
    add_kv_sharing_layers_to_kv_cache_groups,
    customize_attention_spec,
    select_common_block_size,
)

from _kvcheck import BlockAddresser, check_group, phys_bytes
from _vllm032 import LAYOUTS, Allocated, allocate
from kvtier.codec import gather, scatter
from kvtier.layout import GroupKind, Layout, LayoutError, build_layout
from kvtier.vllm.block_axes import registered_block_axes

NB = 37  # a prime: no other dimension of these caches is a multiple of it
BLOCK_COMPACT = [lay for lay in LAYOUTS if lay.is_block_compact]
BLOCK_OUTER = [lay for lay in LAYOUTS if lay.is_block_outermost]


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def dense_spec(backend: type, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
               kv_cache_dtype: str = "auto", heads: int = 2, head_size: int = 64,
               ) -> FullAttentionSpec:
    """The spec Attention.get_kv_cache_spec builds (layers/attention/attention.py:606), after
    the runner's customize_attention_spec (worker/utils.py:476)."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype,
        kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
    )
    return customize_attention_spec(backend, spec)


def mla_spec(backend: type, block_size: int, kv_cache_dtype: str = "auto",
             head_size: int = 576, dtype: torch.dtype = torch.bfloat16) -> MLAAttentionSpec:
    """MLAAttention.get_kv_cache_spec (layers/attention/mla_attention.py:1350)."""
    spec = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=head_size,
        dtype=dtype, cache_dtype_str=kv_cache_dtype,
        kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
        state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(kv_cache_dtype),
    )
    return customize_attention_spec(backend, spec)


def layout_of(a: Allocated, kv_cache_dtype: str = "auto",
              layers: dict[str, object] | None = None) -> Layout:
    return build_layout(a.kv_caches, a.group_specs(), a.num_blocks,
                        kv_cache_dtype=kv_cache_dtype, layers=layers)


def check_all_groups(a: Allocated, lay: Layout, extra: dict[str, list[BlockAddresser]]
                     | None = None) -> None:
    """check_group on every group; addressers are the group's layers in layer order."""
    for gid, g in enumerate(a.config.kv_cache_groups):
        names = sorted(g.layer_names, key=lambda n: (int(n.split(".")[2]), n))
        addressers: list[BlockAddresser] = []
        for n in names:
            addressers.append(a.addresser(n, gid))
            addressers += (extra or {}).get(n, [])
        check_group(lay.group(gid), addressers, seed=gid)


# --- dense attention: FlashAttention NHD/HND, and every KVCacheLayout -------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_flash_attention_every_layout(layout: KVCacheLayout) -> None:
    # 12 KV heads: head-outer layouts (LHBNC, BHLNC) give 12 pieces per layer, whose format
    # order must be numeric (piece 10 after piece 9, not after piece 1).
    specs = {attn(i): dense_spec(FlashAttentionBackend, heads=12) for i in range(3)}
    a = allocate(specs, layout, NB)
    lay = layout_of(a)
    g = lay.group(0)
    assert g.bytes_per_block == 3 * specs[attn(0)].page_size_bytes
    check_all_groups(a, lay)
    if layout.is_block_outermost and layout.is_block_compact:
        # BLHNC/BLNHC: the layers of a block share one buffer region: one run per block.
        assert len(g.segments) == 1 and g.segments[0].run == g.bytes_per_block
    if layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC):  # legacy HND / NHD
        assert len(g.segments) == 3


def test_nhd_and_hnd_differ_in_fingerprint_only_by_layout() -> None:
    specs = {attn(i): dense_spec(FlashAttentionBackend) for i in range(2)}
    nhd = layout_of(allocate(specs, KVCacheLayout.LBNHC, NB))
    hnd = layout_of(allocate(specs, KVCacheLayout.LBHNC, NB))
    assert nhd.fingerprint != hnd.fingerprint  # the byte order inside a block differs
    again = layout_of(allocate(specs, KVCacheLayout.LBNHC, 53))
    assert again.fingerprint == nhd.fingerprint  # the block count is not the format


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC],
                         ids=lambda x: x.name)
def test_kernel_block_ratio_dim0_is_blocks_times_ratio(layout: KVCacheLayout) -> None:
    # FlashMLA runs 64-token kernel blocks only (mla/flashmla.py): a 128-token manager block
    # is split in two, so the registered dim 0 is 2 * num_blocks.
    spec = mla_spec(FlashMLABackend, block_size=128)
    kbs = select_common_block_size(128, [FlashMLABackend], [spec])
    assert kbs == 64
    specs = {attn(i): spec for i in range(2)}
    a = allocate(specs, layout, NB, kernel_block_sizes=[kbs])
    assert a.kv_caches[attn(0)].shape[0] == 2 * NB
    lay = layout_of(a)
    assert lay.group(0).num_blocks == NB
    assert lay.group(0).bytes_per_block == 2 * spec.page_size_bytes
    check_all_groups(a, lay)


def test_cpu_backend_layout_and_kernel_blocks() -> None:
    # CPU_ATTN reads head-major block interiors only (cpu_attn.py:73) with 32-multiple blocks.
    (layout,) = CPUAttentionBackend.supported_kv_cache_layouts()
    spec = dense_spec(CPUAttentionBackend, block_size=32, dtype=torch.float32, head_size=32)
    a = allocate({attn(i): spec for i in range(2)}, layout, NB)
    lay = layout_of(a)
    check_all_groups(a, lay)
    # The CPU kernels' own view: [nb, H, 2*bs, hs] (cpu_attn.py:415) — the same block bytes.
    kv = a.kv_caches[attn(1)]
    nb, h, bs, _ = kv.shape
    cpu_view = kv.view((nb, h, bs * 2, -1))
    check_group(lay.group(0), [a.addresser(attn(0), 0), lambda b: cpu_view[b]], seed=3)
    # CPU MLA takes 16-token kernel blocks (mla/cpu_mla.py): a 64-token block is 4 of them.
    mspec = mla_spec(CPUMLABackend, block_size=64, dtype=torch.float32)
    kbs = select_common_block_size(64, [CPUMLABackend], [mspec])
    m = allocate({attn(i): mspec for i in range(2)}, layout, NB, kernel_block_sizes=[kbs])
    assert m.ratio(0) == 4
    check_all_groups(m, layout_of(m))


# --- tiny block counts: the block axis vLLM declares, never one guessed from sizes -----------

def check_every_block(a: Allocated, lay: Layout) -> None:
    """check_group on every block of every group (the default sample is empty for 1 block)."""
    for gid, g in enumerate(a.config.kv_cache_groups):
        names = sorted(g.layer_names, key=lambda n: (int(n.split(".")[2]), n))
        check_group(lay.group(gid), [a.addresser(n, gid) for n in names], seed=gid,
                    ids=list(range(a.num_blocks)), blocks_per_chunk=1)


def tiny_layout(a: Allocated) -> Layout:
    """What the connector builds: block axes from kvtier.vllm.block_axes."""
    axes = registered_block_axes(a.kv_caches, a.config, {}, "auto")
    assert axes == {n: 0 for n in a.kv_caches}  # axis 0 of the registered [B, ...] views
    return build_layout(a.kv_caches, a.group_specs(), a.num_blocks, block_axes=axes)


def assert_sizes_do_not_decide(a: Allocated) -> None:
    """kvtier's core refuses to take the block axis from the sizes of these caches."""
    with pytest.raises(LayoutError, match="ambiguous"):
        layout_of(a)


@pytest.mark.parametrize("num_blocks", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_tiny_block_counts_dense(layout: KVCacheLayout, num_blocks: int) -> None:
    """With one block a head-outer layout (LHBNC) lost half of each block: its head dimension
    has the block axis' stride and was neither inside nor outside the block."""
    specs = {attn(i): dense_spec(FlashAttentionBackend, heads=2) for i in range(2)}
    a = allocate(specs, layout, num_blocks)
    lay = tiny_layout(a)
    assert lay.group(0).bytes_per_block == 2 * specs[attn(0)].page_size_bytes
    check_every_block(a, lay)
    assert lay.fingerprint == layout_of(allocate(specs, layout, NB)).fingerprint
    assert_sizes_do_not_decide(a)


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_tiny_block_counts_with_kernel_blocks(num_blocks: int) -> None:
    spec = mla_spec(FlashMLABackend, block_size=128)  # two 64-token kernel blocks per block
    a = allocate({attn(i): spec for i in range(2)}, KVCacheLayout.LBHNC, num_blocks,
                 kernel_block_sizes=[64])
    assert a.kv_caches[attn(0)].shape[0] == 2 * num_blocks
    lay = tiny_layout(a)
    assert lay.group(0).num_blocks == num_blocks
    assert lay.group(0).bytes_per_block == 2 * spec.page_size_bytes
    check_every_block(a, lay)
    assert_sizes_do_not_decide(a)


def mamba2_spec() -> MambaSpec:
    """A small mamba2 layer's state spec (block 64, align mode), from vLLM's own calculators."""
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=256, n_groups=1, num_heads=8, head_dim=32,
        state_size=16, conv_kernel=4)
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(torch.bfloat16, "auto", "float32")
    return MambaSpec(block_size=64, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align")


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_tiny_block_counts_with_recurrent_state(num_blocks: int) -> None:
    mamba = mamba2_spec()
    full = dense_spec(FlashAttentionBackend, block_size=64)
    specs: dict[str, KVCacheSpec] = {"model.layers.0.mixer": mamba, attn(1): full}
    a = allocate(specs, KVCacheLayout.LBHNC, num_blocks)
    lay = tiny_layout(a)
    sid = [g.kind for g in a.group_specs()].index(GroupKind.STATE)
    assert lay.group(sid).bytes_per_block == mamba.state_content_size_bytes
    check_every_block(a, lay)
    assert_sizes_do_not_decide(a)


# --- MLA ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_mla_bf16_and_fp8(layout: KVCacheLayout, kv_cache_dtype: str) -> None:
    dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8  # STR_DTYPE_TO_TORCH
    spec = mla_spec(FlashMLABackend, block_size=64, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    a = allocate({attn(i): spec for i in range(3)}, layout, NB)
    kv = a.kv_caches[attn(0)]
    assert kv.shape == (NB, 1, 64, 576) and kv.dtype == dtype
    lay = layout_of(a, kv_cache_dtype=kv_cache_dtype)
    assert lay.group(0).bytes_per_block == 3 * 64 * 576 * dtype.itemsize
    check_all_groups(a, lay)


class _IndexerCache:
    """DeepseekV32IndexerCache.bind_kv_cache (models/deepseek_v2.py:655): [B,1,N,C]->[B,N,C]."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache.squeeze(1)


@pytest.mark.parametrize("layout", BLOCK_COMPACT, ids=lambda x: x.name)
def test_sparse_mla_fp8_rows_with_indexer_layer(layout: KVCacheLayout) -> None:
    # Attention: fp8_ds_mla, 656-byte uint8 rows (flashmla_sparse.py:80, mla_attention.py:1365).
    sparse = replace(mla_spec(FlashMLASparseBackend, 64, "fp8_ds_mla", dtype=torch.uint8),
                     is_index_group_leader=True)
    # Indexer cache: its own layer, 128 fp8 + 4 scale bytes (deepseek_v2.py:731, :658).
    index = customize_attention_spec(DeepseekV32IndexerBackend, MLAAttentionSpec(
        block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER))
    idx = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(2)]
    specs: dict[str, KVCacheSpec] = {attn(0): sparse, idx[0]: index, attn(1): sparse,
                                     idx[1]: index}
    a = allocate(specs, layout, NB)
    assert len(a.config.kv_cache_groups) == 1  # one group: indexer blocks travel with KV
    assert a.kv_caches[attn(0)].shape == (NB, 1, 64, 656)
    lay = layout_of(a, kv_cache_dtype="fp8_ds_mla")
    g = lay.group(0)
    assert g.bytes_per_block == 2 * 64 * (656 + 132)
    # Format order: layer 0's latent rows, layer 0's indexer, layer 1's, layer 1's indexer.
    assert [(s.layer_index, s.role) for s in g.segments] == [
        (0, "kv"), (0, "index"), (1, "kv"), (1, "index")]
    check_all_groups(a, lay)
    # The indexer kernels' squeezed view addresses the same bytes.
    ic = _IndexerCache(a.kv_caches[idx[1]]).kv_cache
    out = torch.empty(g.bytes_per_block, dtype=torch.uint8)
    gather(g, [5], 1, out)
    tail = out[-64 * 132:]
    assert torch.equal(tail, phys_bytes(ic[5]))


# --- fp8 with per-token-head scales ------------------------------------------------------------

class _Layer(torch.nn.Module):
    """An attention layer as the runner sees it: per-tensor scales and the backend impl."""

    def __init__(self, impl: object | None = None, **tensors: torch.Tensor) -> None:
        super().__init__()
        self.impl = impl
        self._k_scale = torch.tensor(1.0)
        self._v_scale = torch.tensor(1.0)
        for k, v in tensors.items():
            setattr(self, k, v)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_fp8_per_token_head_inline_scales_are_not_segments(layout: KVCacheLayout) -> None:
    # TritonAttentionBackend.customize_spec pads each head with a float32 scale per K/V side
    # (triton_attn.py:284); the impl carves alias views out of it at the first forward
    # (_ensure_scale_caches, triton_attn.py:390).
    spec = dense_spec(TritonAttentionBackend, dtype=torch.uint8,
                      kv_cache_dtype="fp8_per_token_head")
    assert spec.state_content_bytes == 2 * (64 + 4)
    a = allocate({attn(i): spec for i in range(2)}, layout, NB)
    # Before the first forward: the layers hold only their per-tensor scales.
    plain = layout_of(a, "fp8_per_token_head", {attn(i): _Layer() for i in range(2)})
    impls: list[TritonAttentionImpl] = []
    for i in range(2):
        impl = TritonAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2,
                                   alibi_slopes=None, sliding_window=None,
                                   kv_cache_dtype="fp8_per_token_head")
        impl._ensure_scale_caches(a.kv_caches[attn(i)])
        assert impl._k_scale_cache is not None and impl._k_scale_cache.shape == (NB, 16, 2)
        impls.append(impl)
    lay = layout_of(a, "fp8_per_token_head", {attn(i): _Layer(impls[i]) for i in range(2)})
    assert [s.describe for s in lay.group(0).segments] == [
        s.describe for s in plain.group(0).segments]
    assert lay.group(0).bytes_per_block == plain.group(0).bytes_per_block
    assert lay.fingerprint == plain.fingerprint
    check_all_groups(a, lay)
    # The scales are inside the block: one written through the alias view is gathered, and
    # scattering the block back restores it.
    g = lay.group(0)
    v_scales = impls[0]._v_scale_cache
    assert v_scales is not None
    v_scales[11, 3, 1] = 1234.5
    saved = torch.empty(g.bytes_per_block, dtype=torch.uint8)
    gather(g, [11], 1, saved)
    v_scales[11].fill_(7.0)
    scatter(g, [11], 1, saved)
    assert float(v_scales[11, 3, 1]) == 1234.5


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_fp8_scales_as_separate_tensors_on_the_layer(layout: KVCacheLayout) -> None:
    # ROCm/ATOM style: fp8 cache plus k_scale/v_scale (num_blocks, block_size, heads) float32
    # tensors kept on the attention layer.
    spec = dense_spec(TritonAttentionBackend, dtype=torch.uint8, kv_cache_dtype="fp8_e4m3")
    a = allocate({attn(i): spec for i in range(2)}, layout, NB)
    layers: dict[str, object] = {
        attn(i): _Layer(k_scale=torch.rand(NB, 16, 2), v_scale=torch.rand(NB, 16, 2))
        for i in range(2)
    }
    lay = layout_of(a, kv_cache_dtype="fp8_e4m3", layers=layers)
    g = lay.group(0)
    assert g.bytes_per_block == 2 * (spec.page_size_bytes + 2 * 16 * 2 * 4)
    # each layer's cache bytes, then its K scales, then its V scales
    assert [(s.layer_index, s.role) for s in g.segments if "scale" in s.role] == [
        (0, "k_scale"), (0, "v_scale"), (1, "k_scale"), (1, "v_scale")]
    last = {i: max(j for j, s in enumerate(g.segments) if s.layer_index == i and
                   "scale" not in s.role) for i in range(2)}
    assert [g.segments[last[i] + 1].role for i in range(2)] == ["k_scale", "k_scale"]
    assert lay.fixed_scales == {f"{attn(i)}.{s}": 1.0 for i in range(2)
                                for s in ("_k_scale", "_v_scale")}
    extra: dict[str, list[BlockAddresser]] = {
        attn(i): [lambda b, i=i: layers[attn(i)].k_scale[b],  # type: ignore[attr-defined]
                  lambda b, i=i: layers[attn(i)].v_scale[b]]  # type: ignore[attr-defined]
        for i in range(2)
    }
    check_all_groups(a, lay, extra)
    # A fixed per-tensor scale is part of the format: another value, another fingerprint.
    layers[attn(1)]._k_scale = torch.tensor(0.5)  # type: ignore[attr-defined]
    assert layout_of(a, "fp8_e4m3", layers).fingerprint != lay.fingerprint


def test_unmappable_scale_tensor_is_an_error_naming_layer_shape_strides() -> None:
    spec = dense_spec(TritonAttentionBackend, dtype=torch.uint8, kv_cache_dtype="fp8")
    a = allocate({attn(0): spec}, KVCacheLayout.LBHNC, NB)
    bad = torch.rand(2, 16, 5).transpose(0, 2)  # per-head-per-token, no block axis
    with pytest.raises(LayoutError) as e:
        layout_of(a, "fp8", {attn(0): _Layer(k_scale=bad)})
    msg = str(e.value)
    assert attn(0) in msg and "k_scale" in msg
    assert str(tuple(bad.shape)) in msg and str(tuple(bad.stride())) in msg


# --- sliding window beside full attention -----------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_sliding_window_group_beside_full_group(layout: KVCacheLayout) -> None:
    full = dense_spec(FlashAttentionBackend)
    swa = customize_attention_spec(FlashAttentionBackend, SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128))
    specs: dict[str, KVCacheSpec] = {attn(i): (full if i % 2 == 0 else swa) for i in range(4)}
    a = allocate(specs, layout, NB)
    kinds = [g.kind for g in a.group_specs()]
    assert kinds == [GroupKind.FULL, GroupKind.SLIDING_WINDOW]
    lay = layout_of(a)
    assert lay.group(1).spec.sliding_window == 128
    assert {s.layer_index for s in lay.group(0).segments} <= {0, 2}
    assert {s.layer_index for s in lay.group(1).segments} <= {1, 3}
    check_all_groups(a, lay)


# --- recurrent state -----------------------------------------------------------------------------

class _Mamba2(MambaBase):
    """The real MambaBase.bind_kv_cache (mamba/abstract.py:28) with a mamba2 state geometry."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...],
                 dtypes: tuple[torch.dtype, ...]) -> None:
        self._shapes, self._dtypes = shapes, dtypes

    def get_state_shape(self) -> Iterable[tuple[int, ...]]:
        return self._shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self._dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA2

    def get_kv_cache_spec(self, vllm_config: object) -> KVCacheSpec | None:
        raise NotImplementedError


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_recurrent_state_beside_attention(layout: KVCacheLayout) -> None:
    mamba = mamba2_spec()
    full = dense_spec(FlashAttentionBackend, block_size=64)
    names = {0: "model.layers.0.mixer", 1: attn(1), 2: "model.layers.2.mixer", 3: attn(3)}
    specs: dict[str, KVCacheSpec] = {n: (mamba if "mixer" in n else full)
                                     for n in names.values()}
    if layout.is_block_outermost and not layout.is_block_compact:
        # Block-outer packing of mixed page sizes needs block-compact pages: vLLM refuses
        # (kv_cache_utils.validate_kv_cache_layout), so there is nothing to register.
        with pytest.raises(ValueError, match="cannot express"):
            allocate(specs, layout, NB)
        return
    a = allocate(specs, layout, NB)
    gs = a.group_specs()
    assert GroupKind.STATE in [g.kind for g in gs]
    lay = layout_of(a)
    sid = [g.kind for g in gs].index(GroupKind.STATE)
    state = lay.group(sid)
    assert state.bytes_per_block == 2 * mamba.state_content_size_bytes  # padding not moved
    assert all(s.role == "state" for s in state.segments)
    check_all_groups(a, lay)
    # Through the mamba layer's own per-state views (conv, then ssm), the same bytes.
    addressers: list[BlockAddresser] = []
    for n in sorted(a.config.kv_cache_groups[sid].layer_names):
        layer = _Mamba2(mamba.shapes, mamba.dtypes)
        layer.bind_kv_cache(a.kv_caches[n])
        addressers += [lambda b, t=t: t[b] for t in layer.kv_cache]
    check_group(state, addressers, seed=9)


# --- cross-layer sharing -------------------------------------------------------------------------

def test_cross_layer_kv_sharing_moves_shared_bytes_once() -> None:
    specs = {attn(i): dense_spec(FlashAttentionBackend) for i in range(2)}
    a = allocate(specs, KVCacheLayout.LBHNC, NB)
    alone = layout_of(a)
    # gpu_model_runner.initialize_kv_cache_tensors: kv_caches[layer] = kv_caches[target]
    add_kv_sharing_layers_to_kv_cache_groups({attn(2): attn(0)}, a.config.kv_cache_groups)
    a.kv_caches[attn(2)] = a.kv_caches[attn(0)]
    shared = layout_of(a)
    assert shared.group(0).bytes_per_block == alone.group(0).bytes_per_block
    check_group(shared.group(0), [a.addresser(attn(0), 0), a.addresser(attn(1), 0)])


def test_fingerprint_covers_dtype_string_block_size_and_order() -> None:
    specs = {attn(i): dense_spec(FlashAttentionBackend) for i in range(2)}
    a = allocate(specs, KVCacheLayout.LBHNC, NB)
    base = layout_of(a, kv_cache_dtype="auto")
    assert layout_of(a, kv_cache_dtype="fp8_e5m2").fingerprint != base.fingerprint
    big = allocate({attn(i): dense_spec(FlashAttentionBackend, block_size=32)
                    for i in range(2)}, KVCacheLayout.LBHNC, NB)
    assert layout_of(big).fingerprint != base.fingerprint
    # Renaming layers reorders segments (layer-numeric order): another format.
    swapped = {attn(1): a.kv_caches[attn(0)], attn(0): a.kv_caches[attn(1)]}
    other = build_layout(swapped, a.group_specs(), NB)
    assert other.group(0).segments[0].offset != base.group(0).segments[0].offset
    # Dict order never matters.
    reordered = dict(reversed(list(a.kv_caches.items())))
    assert build_layout(reordered, a.group_specs(), NB).fingerprint == base.fingerprint

"""Layout only: ``KimiK3ForConditionalGeneration`` and ``Glm5NextForCausalLM`` (GLM-5.3-Flash,
seed 001) exist only in vLLM 0.32, whose CPU build cannot run them (CUDA/ROCm kernels; KDA + MLA
has no prefix caching on CPUs without AMX). What they register is covered here from 0.32's own
model code: each spec comes from the real layer class's ``get_kv_cache_spec``
(``vllm/models/kimi_k3/nvidia/{kda,mla}.py``, ``vllm/models/glm5next/common/{kda,attention}.py``)
on a layer object holding only the attributes that method reads; vLLM groups and allocates them
(``tests/_vllm032.py``); then kvtier's adapter (``kvtier.vllm.groups.engine_groups``), layout,
geometry and planner take them. GLM-5-Next stops at vLLM's page-size unification (see
:func:`test_glm5next_specs_and_kvtier_groups`): its specs and kvtier's groups are checked.

Block sizes: in align mode vLLM raises the attention block so that one attention page holds one
state object, and gives the state groups the same block (``HybridAttentionMambaModelConfig``,
``model_executor/models/config.py``); :func:`hybrid_block_size` does the same arithmetic.
Geometry: Kimi-K3's text layers are Kimi-Linear's (KDA 32 heads x 128, conv kernel 4; MLA
latent 512 + rope 64), as in ``kvtier.testing.seed_models.kimi_linear``; GLM-5-Next's
indexer keys are 128 fp8 values + 4 scale bytes per pooled entry, ``index_kpool`` 4 (seed 001:
"instead of 4").
"""

from __future__ import annotations

import hashlib
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from _vllm032 import allocate
from kvtier.geometry import Geometry, resolve_chunk_tokens
from kvtier.index.base import Entry
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.layout import GroupKind, build_layout
from kvtier.planner import Decline, find_hit
from kvtier.policy import make_policy
from kvtier.slab import SlotAllocator
from kvtier.vllm.groups import engine_groups


@pytest.fixture(scope="module", autouse=True)
def _forget_numba_after_the_module() -> Any:
    """Kimi-K3's layer code imports numba (through vLLM's jit_monitor), and with it llvmlite.
    vLLM 0.32's Triton kernel rebinding, run at every engine start, scans every module's
    namespace and fails on llvmlite's ``ffi.lib`` (its ``__getattr__`` answers ``__dict__``),
    so an engine started later in the same process (the e2e tests, when the suite runs in
    several workers) would not start. Afterwards the modules this test pulled in leave
    ``sys.modules`` (the objects stay alive where referenced)."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("numba", "llvmlite"):
            del sys.modules[name]


def _glm5next_modules() -> tuple[Any, Any]:
    """GLM-5-Next's layer modules without its package ``__init__`` (which imports the
    multimodal model, hence torchvision, absent here)."""
    import vllm.models as vm

    name = "vllm.models.glm5next"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(os.path.dirname(vm.__file__), "glm5next")]
        sys.modules[name] = pkg
    from vllm.models.glm5next.common import attention, kda

    return attention, kda


NB = 37  # a prime: no other dimension is a multiple of it
KDA_HEADS, KDA_HEAD_DIM, CONV = 32, 128, 4
MLA_HEAD = 512 + 64  # kv_lora_rank + qk_rope_head_dim
KPOOL = 4
ALIGN = 16  # attention block sizes are multiples of the kernel block


def layer(cls: type, **attrs: Any) -> Any:
    """A layer object of the real class with only the attributes its spec method reads."""
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    for k, v in attrs.items():
        object.__setattr__(obj, k, v)
    return obj


@dataclass
class _ModelDtype:
    dtype: torch.dtype = torch.bfloat16


def hybrid_block_size(state_bytes: int, attn_bytes_per_token: int) -> int:
    """The smallest multiple of :data:`ALIGN` tokens whose attention page holds one state
    object (what HybridAttentionMambaModelConfig picks for align mode)."""
    per = attn_bytes_per_token * ALIGN
    return -(-state_bytes // per) * ALIGN


def config(block_size: int) -> VllmConfig:
    cc = CacheConfig(block_size=block_size, mamba_cache_mode="align")
    cc.mamba_block_size = block_size
    return VllmConfig(cache_config=cc)


def kda_spec(cls: type, vc: VllmConfig, backend: str) -> MambaSpec:
    lay = layer(cls, model_config=_ModelDtype(), cache_config=vc.cache_config, tp_size=1,
                num_heads=KDA_HEADS, head_dim=KDA_HEAD_DIM, conv_size=CONV, num_spec=0,
                kda_prefill_backend=backend)
    spec = lay.get_kv_cache_spec(vc)
    assert isinstance(spec, MambaSpec)
    return spec


def state_bytes(backend: str, cls: type) -> int:
    return kda_spec(cls, config(ALIGN), backend).page_size_bytes


def kimi_k3_specs(backend: str, kv_cache_dtype: str = "bfloat16") -> dict[str, KVCacheSpec]:
    """One pattern period of Kimi-K3's text model: KDA layers 0-2, MLA layer 3."""
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    mla_bytes = 656 if kv_cache_dtype == "fp8_ds_mla" else MLA_HEAD * 2
    vc = config(hybrid_block_size(state_bytes(backend, KimiK3DeltaAttention), mla_bytes))
    mla = layer(MultiHeadLatentAttention, kv_cache_dtype=kv_cache_dtype, head_size=MLA_HEAD,
                non_causal_multi_token_decode=False).get_kv_cache_spec(vc)
    specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.self_attn": kda_spec(KimiK3DeltaAttention, vc, backend)
        for i in range(3)}
    specs["model.layers.3.self_attn.attn"] = mla
    return specs


def glm5next_specs(backend: str) -> dict[str, KVCacheSpec]:
    """One period of GLM-5-Next: linear-attention (KDA) layers 0-2; layer 3 MLA with the
    pooled indexer keys (``tokens_per_state`` = kpool) and the indexer's tail ring."""
    attention, kda = _glm5next_modules()
    vc = config(hybrid_block_size(state_bytes(backend, kda.Glm5NextLinearAttention),
                                  MLA_HEAD * 2))
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    mla = layer(MLAAttention, kv_cache_dtype="bfloat16", head_size=MLA_HEAD,
                sliding_window=None, indexer=object(),  # the layer has an indexer
                non_causal_multi_token_decode=False).get_kv_cache_spec(vc)
    keys = layer(attention.Glm5NextIndexerCache, head_dim=128 + 128 // 128 * 4,
                 dtype=torch.uint8, cache_config=vc.cache_config,
                 _index_kpool=KPOOL).get_kv_cache_spec(vc)
    ring = layer(attention.Glm5NextTailCache, head_dim=128, dtype=torch.bfloat16,
                 cache_config=vc.cache_config, _index_kpool=KPOOL).get_kv_cache_spec(vc)
    specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.self_attn": kda_spec(kda.Glm5NextLinearAttention, vc, backend)
        for i in range(3)}
    specs.update({"model.layers.3.self_attn.attn": mla,
                  "model.layers.3.self_attn.indexer.k_cache": keys,
                  "model.layers.3.self_attn.indexer.tail_cache": ring})
    return specs


MODELS = {"kimi_k3": kimi_k3_specs}  # GLM-5-Next: see test_glm5next_* below
BACKENDS = ["triton", "flashkda"]  # flashkda adds a prefill checkpoint block per request


def _registered(specs: dict[str, KVCacheSpec]) -> tuple[Any, Any, Any]:
    a = allocate(specs, KVCacheLayout.LBHNC, NB)
    groups = engine_groups(a.config)
    caches = {n: a.kv_caches[n] for g in groups.specs for n in g.layer_names}
    return a, groups, build_layout(caches, list(groups.specs), a.num_blocks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kimi_k3_registered_groups_and_kvtier_groups(backend: str) -> None:
    specs = kimi_k3_specs(backend)
    a, groups, _ = _registered(specs)
    vllm_kinds = sorted(type(g.kv_cache_spec).__name__ for g in a.config.kv_cache_groups)
    assert vllm_kinds == ["MLAAttentionSpec"] + ["MambaSpec"] * 3  # KDA state per layer
    kinds = [g.kind for g in groups.specs]
    assert kinds.count(GroupKind.STATE) == 3 and kinds.count(GroupKind.FULL) == 1
    state = [s for s in specs.values() if isinstance(s, MambaSpec)]
    assert {s.mamba_cache_mode for s in state} == {"align"}
    assert {s.num_prefill_checkpoint_blocks for s in state} == {int(backend == "flashkda")}


def test_kimi_k3_fp8_ds_mla_rows_are_656_bytes() -> None:
    specs = kimi_k3_specs("triton", kv_cache_dtype="fp8_ds_mla")
    _, groups, lay = _registered(specs)
    (full,) = [g for g, s in zip(lay.groups, groups.specs) if s.kind is GroupKind.FULL]
    assert full.bytes_per_block == 656 * full.spec.block_size


@pytest.mark.parametrize("backend", BACKENDS)
def test_glm5next_specs_and_kvtier_groups(backend: str) -> None:
    """GLM-5-Next's layers register KDA state (align), MLA as the leader of an index group,
    the pooled indexer keys (MLA-typed, ``tokens_per_state`` = kpool: a quarter of the rows)
    and the tail ring (``CircularBufferSpec``, not prefix-cacheable). vLLM 0.32's page-size
    unification refuses these pages together (the indexer page, 33 bytes per token, divides
    no MLA page of 1,152 bytes per token, and MLA pages cannot be padded): the real
    GLM-5.3-Flash numbers are not public here, so kvtier's adapter is checked on the groups
    vLLM would form (one per spec type), not on allocated tensors."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    specs = glm5next_specs(backend)
    by_kind: dict[tuple[str, int], list[str]] = {}
    for name, spec in specs.items():
        by_kind.setdefault((type(spec).__name__, spec.page_size_bytes), []).append(name)
    keys = specs["model.layers.3.self_attn.indexer.k_cache"]
    mla = specs["model.layers.3.self_attn.attn"]
    assert isinstance(keys, MLAAttentionSpec) and keys.tokens_per_state == KPOOL
    assert isinstance(mla, MLAAttentionSpec) and mla.is_index_group_leader
    ring = specs["model.layers.3.self_attn.indexer.tail_cache"]
    assert isinstance(ring, CircularBufferSpec) and not ring.prefix_cacheable
    with pytest.raises(NotImplementedError, match="page size is not divisible"):
        allocate(specs, KVCacheLayout.LBHNC, NB)
    kvc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names, specs[names[0]]) for names in by_kind.values()])
    groups = engine_groups(kvc)
    kinds = sorted(g.kind.value for g in groups.specs)
    assert kinds == ["full", "full", "state"]  # MLA, pooled keys, the KDA layers' state
    assert all("tail_cache" not in n for g in groups.specs for n in g.layer_names)
    (state,) = [g for g in groups.specs if g.kind is GroupKind.STATE]
    assert len(state.layer_names) == 3
    chunk = resolve_chunk_tokens(None, [g.block_size for g in groups.specs])
    assert chunk % mla.block_size == 0 and chunk % KPOOL == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_layout_moves_state_objects_and_pages(model: str, backend: str) -> None:
    specs = MODELS[model](backend)
    a, groups, lay = _registered(specs)
    for g, gs in zip(lay.groups, groups.specs):
        spec = a.config.kv_cache_groups[groups.engine_ids[g.group_id]].kv_cache_spec
        per_layer = g.bytes_per_block // len(gs.layer_names)
        if gs.kind is GroupKind.STATE:
            # one state object (conv + recurrent) per block, the page padding not moved
            assert isinstance(spec, MambaSpec)
            assert per_layer == spec.state_content_size_bytes < spec.page_size_bytes
            assert all(s.role == "state" for s in g.segments)
        else:
            assert per_layer == spec.page_size_bytes


@pytest.mark.parametrize("model", sorted(MODELS))
def test_geometry_chunks_at_the_common_block_and_a_hit_needs_every_state(model: str) -> None:
    specs = MODELS[model]("triton")
    _, groups, lay = _registered(specs)
    sizes = [g.block_size for g in groups.specs]
    assert len(set(sizes)) == 1 and sizes[0] % ALIGN == 0  # align: one block for all groups
    chunk = resolve_chunk_tokens(None, sizes)
    assert chunk == sizes[0] * max(1, -(-256 // sizes[0]))
    geo = Geometry.of_layout(lay, chunk)
    assert all(geo.blocks_per_chunk(g) == 1 for g in geo.state_groups)
    assert len(geo.state_groups) == 3
    # a user chunk that is not a multiple of the block is refused, a multiple accepted
    with pytest.raises(Exception, match="multiple"):
        resolve_chunk_tokens(sizes[0] + ALIGN, sizes)
    assert resolve_chunk_tokens(3 * sizes[0], sizes) == 3 * sizes[0]
    # planner: KV of two chunks in every KV group, state of chunk 1 in all but one state
    # group -> the hit falls back to boundary 1, where every state group has its object
    idx = MemoryIndex([GroupIndexSpec(i, make_policy("lru", 16), chained=g.kind is GroupKind.FULL,
                                      boundary_state=g.kind is GroupKind.STATE)
                       for i, g in enumerate(geo.groups)], SlotAllocator([16] * len(geo.groups)))
    keys = [hashlib.blake2b(f"{model}{i}".encode(), digest_size=16).digest() for i in range(2)]
    reserved = []  # every write reserved before any commits, as a save's chunk does
    for g in geo.kv_groups + geo.state_groups:
        for j in range(2):
            if j == 1 and g == geo.state_groups[-1]:
                continue
            e = idx.reserve(g, keys[j], keys[j - 1] if j and g in geo.full_groups else None)
            assert isinstance(e, Entry), e
            reserved.append(e)
    committed = [idx.commit(e) for e in reserved]
    assert committed.count(False) == 2  # key 1's incomplete state set is dropped whole
    hit = find_hit(idx, geo, keys, 2 * chunk + 1, 0)
    assert hit.ok and hit.boundary == 1, hit
    assert find_hit(idx, geo, keys[:1], chunk, 0).reason is Decline.TOO_SHORT

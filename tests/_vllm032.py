"""Build KV caches exactly the way vLLM 0.32 builds them, with vLLM's own functions.

``allocate(specs, layout, num_blocks)`` runs the engine's path from per-layer specs to the
tensors a KV connector receives in ``register_kv_caches``:

- ``vllm.v1.core.kv_cache_utils.get_kv_cache_groups`` (grouping, page-size unification),
- ``vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups`` (``KVCacheTensor`` offsets,
  layer and block strides for the layout; ``num_gpu_blocks_override`` fixes ``num_blocks``),
- ``vllm.v1.worker.utils.allocate_kv_cache`` (one backing buffer, then
  ``vllm.v1.kv_cache_interface.create_kv_cache_views`` per ``KVCacheTensor``).

Only the translation from vLLM's groups to kvtier's :class:`GroupSpec` is ours (it is what
the connector's adapter does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from _kvcheck import BlockAddresser
from kvtier.layout import GroupKind, GroupSpec

LAYOUTS = list(KVCacheLayout)


@dataclass
class Allocated:
    kv_caches: dict[str, torch.Tensor]
    config: KVCacheConfig
    layout: KVCacheLayout
    kernel_block_sizes: list[int] | None

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    def group_specs(self) -> list[GroupSpec]:
        return [to_group_spec(g.kv_cache_spec, g.layer_names) for g in self.config.kv_cache_groups]

    def ratio(self, group_id: int) -> int:
        """Kernel blocks per manager block of a group (dim 0 is num_blocks times this)."""
        spec = self.config.kv_cache_groups[group_id].kv_cache_spec
        if not self.kernel_block_sizes:
            return 1
        return spec.block_size // self.kernel_block_sizes[group_id]

    def addresser(self, name: str, group_id: int) -> BlockAddresser:
        """Block ``b`` of layer ``name`` as vLLM addresses it (manager block -> kernel blocks)."""
        kv = self.kv_caches[name]
        r = self.ratio(group_id)
        assert kv.shape[0] == self.num_blocks * r
        if r == 1:
            return lambda b: kv[b]
        return lambda b: kv[b * r : (b + 1) * r]


def vllm_config(layout: KVCacheLayout, num_blocks: int, disable_hybrid: bool = False) -> VllmConfig:
    cc = CacheConfig(num_gpu_blocks_override=num_blocks)
    cc.kv_cache_layout = layout.name
    vc = VllmConfig(cache_config=cc)
    vc.scheduler_config.disable_hybrid_kv_cache_manager = disable_hybrid
    return vc


def allocate(
    specs: Mapping[str, KVCacheSpec],
    layout: KVCacheLayout,
    num_blocks: int,
    kernel_block_sizes: Sequence[int] | None = None,
) -> Allocated:
    vc = vllm_config(layout, num_blocks)
    groups = get_kv_cache_groups(vc, dict(specs))
    page = max(g.kv_cache_spec.page_size_bytes for g in groups)
    cfg = get_kv_cache_config_from_groups(vc, groups, available_memory=page * 4096)
    assert cfg.num_blocks == num_blocks
    kbs = list(kernel_block_sizes) if kernel_block_sizes is not None else None
    kv = allocate_kv_cache(cfg, torch.device("cpu"), layout, kbs)
    return Allocated(kv_caches=kv, config=cfg, layout=layout, kernel_block_sizes=kbs)


def to_group_spec(spec: KVCacheSpec, layer_names: Sequence[str]) -> GroupSpec:
    first = spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        first = next(iter(spec.kv_cache_specs.values()))
    if isinstance(first, MambaSpec):
        return GroupSpec(GroupKind.STATE, spec.block_size, tuple(layer_names))
    if isinstance(first, SlidingWindowSpec):
        return GroupSpec(
            GroupKind.SLIDING_WINDOW, spec.block_size, tuple(layer_names), first.sliding_window
        )
    return GroupSpec(GroupKind.FULL, spec.block_size, tuple(layer_names))

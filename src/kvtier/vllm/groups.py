"""vLLM's KV-cache groups, as kvtier sees them.

Only groups whose blocks are prefix-cacheable and transferable take part; kvtier numbers
them 0..n-1 in engine order and keeps the map both ways. Sliding-window specs become
sliding-window groups, mamba-like specs recurrent-state groups, every other attention spec
(MLA, sparse MLA, indexer caches, full attention with an emulated window) a full group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.layout import GroupKind, GroupSpec


class UnsupportedModel(ValueError):
    """A KV-cache group kvtier cannot serve: the connector stays off, the engine serves."""


@dataclass(frozen=True)
class EngineGroups:
    specs: tuple[GroupSpec, ...]
    engine_ids: tuple[int, ...]  # kvtier group i is engine group engine_ids[i]
    num_engine_groups: int

    def to_kvtier(self, per_engine_group: Any) -> list[list[int]]:
        """Select kvtier's groups from an engine tuple of per-group block-id lists."""
        return [list(per_engine_group[e]) for e in self.engine_ids]


def _kind_of(spec: Any) -> tuple[GroupKind, int | None]:
    name = type(spec).__name__
    inner = getattr(spec, "kv_cache_specs", None)
    if inner:  # UniformTypeKVCacheSpecs: every layer of the group shares the spec kind
        kinds = {_kind_of(s) for s in inner.values()}
        if len(kinds) != 1:
            raise UnsupportedModel(f"mixed spec kinds in one group: {sorted(map(str, kinds))}")
        return kinds.pop()
    if "Mamba" in name or hasattr(spec, "mamba_type"):
        return GroupKind.STATE, None
    if "SlidingWindow" in name:
        return GroupKind.SLIDING_WINDOW, int(spec.sliding_window)
    if name in ("ChunkedLocalAttentionSpec", "CrossAttentionSpec", "EncoderOnlyAttentionSpec",
                "CircularBufferSpec", "SinkFullAttentionSpec", "RSWASpec"):
        raise UnsupportedModel(f"KV-cache spec {name} is not supported by kvtier yet")
    return GroupKind.FULL, None


def engine_groups(kv_cache_config: Any) -> EngineGroups:
    groups = list(kv_cache_config.kv_cache_groups)
    transfer = getattr(kv_cache_config, "transfer_group_ids", None)
    specs, ids = [], []
    for gid, g in enumerate(groups):
        spec = g.kv_cache_spec
        if transfer is not None and gid not in transfer:
            continue
        if not getattr(spec, "prefix_cacheable", True):
            continue
        kind, window = _kind_of(spec)
        specs.append(GroupSpec(kind, int(spec.block_size), tuple(g.layer_names), window))
        ids.append(gid)
    if not specs:
        raise UnsupportedModel("the model has no prefix-cacheable KV-cache group")
    return EngineGroups(tuple(specs), tuple(ids), len(groups))

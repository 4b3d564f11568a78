"""What to do about a request: how much kvtier can supply, whether loading pays, what to save.

Pure functions over the index and plain numbers; the connector calls them.

- :func:`find_hit`: the longest boundary (in whole chunks) kvtier can restore beyond the HBM
  hit: every full-attention group stores the whole prefix, every sliding-window group the
  window before the boundary, and the recurrent state of the boundary is present when the
  model has any; never at or below the HBM hit, never the last prompt token.
- :func:`decide_load`: a cost model. Loading costs the bytes over the measured host link plus
  one engine step of parking; not loading costs the prefill of those tokens. No fixed floor.
- :func:`chunks_to_save`: newly computed full chunks, prompt only or generated tokens too.

Every declined hit carries a :class:`Decline` reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvtier.config import KvtierConfig
from kvtier.index.base import Index
from kvtier.layout import GroupKind
from kvtier.slab import SlabLayout, lay_out_slab


class Decline(str, Enum):
    TOO_SHORT = "prompt_shorter_than_a_chunk"
    UNSAVEABLE = "extra_keys_not_supported"
    MISS = "not_stored"
    NOT_BEYOND_HBM = "not_beyond_hbm_hit"
    WINDOW_MISSING = "sliding_window_not_stored"
    STATE_MISSING = "recurrent_state_not_stored"
    NOT_WORTH_IT = "recompute_is_cheaper"
    FAILED_BEFORE = "load_failed_before"
    LOAD_BOUND = "too_many_loads_in_flight"
    LOADS_DISABLED = "loads_disabled"
    DEFERRED = "lookup_deferred"


@dataclass(frozen=True)
class GroupGeometry:
    kind: GroupKind
    block_size: int
    bytes_per_block: int  # on one rank
    sliding_window: int | None = None


@dataclass(frozen=True)
class Geometry:
    """The model as the planner sees it: chunk size and the groups' shapes (index order)."""

    chunk_tokens: int
    groups: tuple[GroupGeometry, ...]

    def __post_init__(self) -> None:
        for g in self.groups:
            if self.chunk_tokens % g.block_size:
                raise ValueError(
                    f"chunk_tokens {self.chunk_tokens} is not a multiple of block size "
                    f"{g.block_size}: use a multiple of {lcm_block_size(self.groups)}"
                )

    def blocks_per_chunk(self, group: int) -> int:
        return self.chunk_tokens // self.groups[group].block_size

    def chunk_bytes(self, group: int) -> int:
        g = self.groups[group]
        if g.kind is GroupKind.STATE:
            return g.bytes_per_block
        return self.blocks_per_chunk(group) * g.bytes_per_block

    @property
    def kv_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.kind is not GroupKind.STATE]

    @property
    def state_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.kind is GroupKind.STATE]

    def window_chunks(self, group: int, boundary: int) -> range:
        """Chunks of a sliding-window group needed to continue at ``boundary``."""
        w = self.groups[group].sliding_window or 0
        first = max(0, (boundary * self.chunk_tokens - w) // self.chunk_tokens)
        return range(first, boundary)


def lcm_block_size(groups: Sequence[GroupGeometry]) -> int:
    from math import lcm

    out = 1
    for g in groups:
        out = lcm(out, g.block_size)
    return out


@dataclass(frozen=True)
class Hit:
    boundary: int  # chunks restored from 0 (the HBM part is skipped when loading)
    tokens: int  # tokens beyond the HBM hit
    reason: Decline | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None and self.tokens > 0

    @staticmethod
    def declined(reason: Decline) -> Hit:
        return Hit(0, 0, reason)


def find_hit(
    index: Index,
    geometry: Geometry,
    keys: Sequence[bytes],
    num_prompt_tokens: int,
    hbm_tokens: int,
) -> Hit:
    c = geometry.chunk_tokens
    max_b = min((num_prompt_tokens - 1) // c, len(keys))
    if max_b <= 0:
        return Hit.declined(Decline.TOO_SHORT)
    upper = max_b
    for g in geometry.kv_groups:
        if geometry.groups[g].kind is GroupKind.FULL:
            matched = index.match(g, keys[:upper])
            if matched is None:
                return Hit.declined(Decline.DEFERRED)
            upper = min(upper, matched)
    if upper == 0:
        return Hit.declined(Decline.MISS)
    min_b = hbm_tokens // c + 1
    if upper < min_b:
        return Hit.declined(Decline.NOT_BEYOND_HBM)
    first_failure: Decline | None = None
    for b in range(upper, min_b - 1, -1):
        failure = _boundary_failure(index, geometry, keys, b)
        if failure is None:
            return Hit(b, b * c - hbm_tokens)
        first_failure = first_failure or failure
    return Hit.declined(first_failure or Decline.MISS)


def _boundary_failure(
    index: Index, geometry: Geometry, keys: Sequence[bytes], b: int
) -> Decline | None:
    for g, gg in enumerate(geometry.groups):
        if gg.kind is GroupKind.SLIDING_WINDOW:
            if not all(index.is_ready(g, keys[j]) for j in geometry.window_chunks(g, b)):
                return Decline.WINDOW_MISSING
        elif gg.kind is GroupKind.STATE and not index.is_ready(g, keys[b - 1]):
            return Decline.STATE_MISSING
    return None


def load_bytes(geometry: Geometry, boundary: int, hbm_tokens: int) -> int:
    """Bytes one rank reads to restore tokens [hbm_tokens, boundary * chunk_tokens)."""
    end = boundary * geometry.chunk_tokens
    total = 0
    for g, gg in enumerate(geometry.groups):
        if gg.kind is GroupKind.STATE:
            total += gg.bytes_per_block
            continue
        start = hbm_tokens
        if gg.kind is GroupKind.SLIDING_WINDOW:
            start = max(start, geometry.window_chunks(g, boundary).start * geometry.chunk_tokens)
        first_block = start // gg.block_size
        total += max(0, end // gg.block_size - first_block) * gg.bytes_per_block
    return total


@dataclass
class CostEstimates:
    """Measured rates, smoothed; the connector feeds them every step."""

    link_gbps: float
    prefill_seconds_per_token: float
    step_seconds: float
    alpha: float = 0.2

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.link_gbps += self.alpha * (nbytes / seconds / 1e9 - self.link_gbps)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            per = seconds / tokens
            self.prefill_seconds_per_token += self.alpha * (per - self.prefill_seconds_per_token)

    def observe_step(self, seconds: float) -> None:
        if seconds > 0:
            self.step_seconds += self.alpha * (seconds - self.step_seconds)


@dataclass(frozen=True)
class LoadCost:
    load_seconds: float
    recompute_seconds: float

    @property
    def pays(self) -> bool:
        return self.load_seconds < self.recompute_seconds


def load_cost(geometry: Geometry, hit: Hit, hbm_tokens: int, est: CostEstimates) -> LoadCost:
    nbytes = load_bytes(geometry, hit.boundary, hbm_tokens)
    load_s = nbytes / (est.link_gbps * 1e9) + est.step_seconds
    return LoadCost(load_s, hit.tokens * est.prefill_seconds_per_token)


def decide_load(
    geometry: Geometry,
    hit: Hit,
    hbm_tokens: int,
    est: CostEstimates,
    use_cost_model: bool = True,
) -> Hit:
    """``hit`` if loading it pays (or the cost model is off), else declined NOT_WORTH_IT."""
    if not hit.ok or not use_cost_model:
        return hit
    if load_cost(geometry, hit, hbm_tokens, est).pays:
        return hit
    return Hit.declined(Decline.NOT_WORTH_IT)


def chunks_to_save(
    chunk_tokens: int,
    num_keys: int,
    first_unsaved: int,
    computed_tokens: int,
    num_prompt_tokens: int,
    save_generated: bool,
) -> range:
    """Chunk indices that became full and computed and were not considered before.

    ``computed_tokens`` counts tokens whose KV will be in the cache after this step; the keys
    cover only tokens known so far, so a chunk whose last token is not yet sampled waits.
    """
    limit = computed_tokens if save_generated else min(computed_tokens, num_prompt_tokens)
    last = min(limit // chunk_tokens, num_keys)
    return range(first_unsaved, max(first_unsaved, last))


def make_slab_layout(config: KvtierConfig, geometry: Geometry, num_shards: int) -> SlabLayout:
    """The slab layout both halves derive, identically, from config and KV layout."""
    kv = [geometry.chunk_bytes(g) for g in geometry.kv_groups]
    state = [geometry.chunk_bytes(g) for g in geometry.state_groups]
    return lay_out_slab(
        config.dram_size, kv, num_shards=num_shards,
        state_slot_bytes=max(state) if state else None, state_bytes=config.state_size,
    )


def slot_classes(geometry: Geometry) -> list[int]:
    kv = geometry.kv_groups
    out = [0] * len(geometry.groups)
    for i, g in enumerate(kv):
        out[g] = i
    for g in geometry.state_groups:
        out[g] = len(kv)
    return out

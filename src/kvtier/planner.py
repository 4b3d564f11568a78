"""What to do about a request: how much kvtier can supply, whether loading pays, what to save.

Pure functions over the index and the :class:`~kvtier.geometry.Geometry`; the scheduler
calls them.

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

from kvtier.geometry import Geometry, GroupGeometry, make_slab_layout
from kvtier.index.base import Index
from kvtier.layout import GroupKind

# Geometry, GroupGeometry and make_slab_layout live in kvtier.geometry; they stay importable
# from here, where the planner's callers (and the step (a) unit tests) have always found them.
__all__ = [
    "CostEstimates", "Decline", "Geometry", "GroupGeometry", "Hit", "LoadCost",
    "chunks_to_save", "decide_load", "find_hit", "load_bytes", "load_cost", "make_slab_layout",
    "promotion_gain",
]


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
    PREPARE_TIMEOUT = "prepare_timed_out"
    PREPARE_FAILED = "prepare_failed"


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
    for g in geometry.full_groups:
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


_MISSING: dict[GroupKind, Decline] = {
    GroupKind.FULL: Decline.MISS,
    GroupKind.SLIDING_WINDOW: Decline.WINDOW_MISSING,
    GroupKind.STATE: Decline.STATE_MISSING,
}
"""Why a hit at a boundary fails when a group lacks a chunk it needs there."""


def _boundary_failure(
    index: Index, geometry: Geometry, keys: Sequence[bytes], b: int
) -> Decline | None:
    for g, gg in enumerate(geometry.groups):
        if not all(index.is_ready(g, keys[j]) for j in geometry.chunks_checked_at(g, b)):
            return _MISSING[gg.kind]
    return None


def load_bytes(geometry: Geometry, boundary: int, hbm_tokens: int) -> int:
    """Bytes one rank reads to restore tokens [hbm_tokens, boundary * chunk_tokens)."""
    return geometry.load_bytes(boundary, hbm_tokens)


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


def promotion_gain(geometry: Geometry, via: Hit, dram_hit: Hit, hbm_tokens: int,
                   est: CostEstimates, read_seconds: float) -> float:
    """Seconds a promotion saves beyond what the DRAM hit ``dram_hit`` saves on its own: the
    promotion reads the lower tiers for ``read_seconds`` (each tier's own rate and latency,
    :func:`kvtier.tiers.cost.stacked_read_seconds`), defers the lookup one engine step, then
    loads the longer hit ``via`` from DRAM like any hit. Above 0: promoting pays."""
    v = load_cost(geometry, via, hbm_tokens, est)
    saving = v.recompute_seconds - v.load_seconds - read_seconds - est.step_seconds
    dram_saving = 0.0
    if dram_hit.ok:
        d = load_cost(geometry, dram_hit, hbm_tokens, est)
        dram_saving = d.recompute_seconds - d.load_seconds
    return saving - max(dram_saving, 0.0)


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
    volatile_tail: bool = False,
) -> range:
    """Chunk indices that became full and computed and were not considered before.

    ``computed_tokens`` counts tokens whose KV will be in the cache after this step; the keys
    cover only tokens known so far, so a chunk whose last token is not yet sampled waits.

    ``volatile_tail`` (EAGLE/MTP drafts): the draft KV of a chunk's last position is final
    once the token after it is accepted and the draft re-run over it, which a rejected
    speculation can postpone by a step. A chunk whose next token is a prompt token or the
    first sampled one is final when computed; a chunk of generated tokens waits until the
    whole next chunk is computed (vLLM's OffloadingConnector excludes the trailing chunk of
    draft groups while decoding, for the same reason).
    """
    limit = computed_tokens if save_generated else min(computed_tokens, num_prompt_tokens)
    last = min(limit // chunk_tokens, num_keys)
    if volatile_tail:
        last = min(last, max(num_prompt_tokens, computed_tokens - chunk_tokens) // chunk_tokens)
    return range(first_unsaved, max(first_unsaved, last))

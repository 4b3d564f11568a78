"""Chunk and group geometry: the one value both halves agree on before anything is stored.

A :class:`Geometry` is the chunk size (tokens) and the shape of every KV-cache group (kind,
block size, bytes per block on one rank, window), in kvtier's group order, plus the layout
fingerprint that names the byte format. A worker builds it once from its
:class:`~kvtier.layout.Layout` (:meth:`Geometry.of_layout`); it travels to the scheduler
half in the start-up handshake unchanged, and everything else is derived from it: blocks per
chunk, chunk bytes, slot classes, the slab layout, and which blocks a chunk covers for a save
or a load.

Contracts (docs/design.md §2):
- ``chunk_tokens`` is a multiple of every group's block size (:func:`resolve_chunk_tokens`
  picks or checks it; the constructor refuses anything else).
- A full-attention or sliding-window group's chunk is ``chunk_tokens / block_size`` blocks;
  a recurrent-state group's chunk is **one** block: the state after the chunk's last token.
- Slot classes: one per KV group (full or window), in group order, then one shared by every
  state group.
- Per-kind behaviour (which chunks a load restores, which blocks a save reads, which chunks
  must be ready for a hit) lives in one rule object per :class:`~kvtier.layout.GroupKind`
  here, so that the scheduler and the planner never branch on the kind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.config import ConfigError, KvtierConfig
from kvtier.layout import GroupKind, Layout
from kvtier.protocol import SKIP, SaveDrop
from kvtier.slab import SlabLayout, lay_out_slab

DEFAULT_MIN_CHUNK_TOKENS = 256
"""The default chunk is the smallest multiple of the block sizes' LCM at least this long."""

NULL_BLOCK = 0
"""vLLM's placeholder block id (skipped sliding-window positions)."""


def resolve_chunk_tokens(configured: int | None, block_sizes: Sequence[int]) -> int:
    """The chunk size (tokens) for KV-cache groups with these block sizes.

    ``configured`` is the ``chunk_tokens`` setting. Unset: the smallest multiple of the block
    sizes' LCM that is at least :data:`DEFAULT_MIN_CHUNK_TOKENS`. Set: it must be a multiple
    of every block size; otherwise a :class:`~kvtier.config.ConfigError` says which values
    would work.
    """
    if not block_sizes or any(b <= 0 for b in block_sizes):
        raise ConfigError(f"block sizes must be positive, got {list(block_sizes)}")
    lcm = math.lcm(*block_sizes)
    if configured is None:
        return lcm * max(1, -(-DEFAULT_MIN_CHUNK_TOKENS // lcm))
    if configured % lcm:
        lower = configured // lcm * lcm
        upper = lower + lcm
        choices = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise ConfigError(
            f"kvtier setting 'chunk_tokens' ({configured}) is not a multiple of "
            f"every KV-cache block size {sorted(set(block_sizes))} (their LCM is {lcm}): "
            f"write chunk_tokens={choices}, or leave it unset"
        )
    return configured


@dataclass(frozen=True)
class GroupGeometry:
    """One KV-cache group's shape: ``block_size`` in tokens, ``bytes_per_block`` on one rank,
    ``sliding_window`` in tokens (sliding-window groups only)."""

    kind: GroupKind
    block_size: int
    bytes_per_block: int
    sliding_window: int | None = None


@dataclass(frozen=True)
class Geometry:
    """The chunk size and the groups' shapes (kvtier group order); see the module docstring.

    Plain ints, strings and enums: it is pickled into the worker metadata of the handshake and
    compared across ranks.
    """

    chunk_tokens: int
    groups: tuple[GroupGeometry, ...]
    fingerprint: str = ""

    def __post_init__(self) -> None:
        for g in self.groups:
            if self.chunk_tokens % g.block_size:
                raise ValueError(
                    f"chunk_tokens {self.chunk_tokens} is not a multiple of block size "
                    f"{g.block_size}: use a multiple of {lcm_block_size(self.groups)}"
                )

    @classmethod
    def of_layout(cls, layout: Layout, chunk_tokens: int) -> Geometry:
        """The geometry of a worker's KV layout at ``chunk_tokens`` tokens per chunk."""
        return cls(chunk_tokens, tuple(
            GroupGeometry(g.spec.kind, g.spec.block_size, g.bytes_per_block,
                          g.spec.sliding_window)
            for g in layout.groups), layout.fingerprint)

    # -- per group ---------------------------------------------------------------------------
    def _rules(self, group: int) -> _KindRules:
        return _RULES[self.groups[group].kind]

    def blocks_per_chunk(self, group: int) -> int:
        """Blocks one chunk of ``group`` covers (1 for a recurrent-state group)."""
        return self._rules(group).blocks_per_chunk(self, group)

    def chunk_bytes(self, group: int) -> int:
        """Bytes of one chunk of ``group`` on one rank (one slot of its class)."""
        return self.blocks_per_chunk(group) * self.groups[group].bytes_per_block

    @property
    def kv_groups(self) -> list[int]:
        """Groups holding per-token KV (full attention and sliding window)."""
        return [i for i, g in enumerate(self.groups) if g.kind is not GroupKind.STATE]

    @property
    def full_groups(self) -> list[int]:
        """Full-attention groups: they store the whole prefix, chained parent to child."""
        return [i for i, g in enumerate(self.groups) if g.kind is GroupKind.FULL]

    @property
    def state_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.kind is GroupKind.STATE]

    @property
    def slot_classes(self) -> tuple[int, ...]:
        """The slab size class of each group: one per KV group, then one for all state."""
        kv = self.kv_groups
        out = [len(kv)] * len(self.groups)
        for i, g in enumerate(kv):
            out[g] = i
        return tuple(out)

    def window_chunks(self, group: int, boundary: int) -> range:
        """Chunks of a sliding-window group needed to continue at ``boundary``."""
        w = self.groups[group].sliding_window or 0
        first = max(0, (boundary * self.chunk_tokens - w) // self.chunk_tokens)
        return range(first, boundary)

    # -- what a hit, a load and a save cover -------------------------------------------------
    def chunks_checked_at(self, group: int, boundary: int) -> range:
        """Chunks of ``group`` that must be stored for a hit ending at chunk ``boundary``,
        beyond the full-attention prefix (which the index matches as a chain)."""
        return self._rules(group).chunks_checked_at(self, group, boundary)

    def chunks_to_load(self, group: int, first_chunk: int, boundary: int) -> range:
        """Chunks of ``group`` a load restores to continue at ``boundary``, when the chunks
        below ``first_chunk`` are already in HBM."""
        return self._rules(group).chunks_to_load(self, group, first_chunk, boundary)

    def blocks_to_load(self, group: int, table: Sequence[int], chunk: int,
                       hbm_tokens: int) -> list[int]:
        """The block ids chunk ``chunk`` of ``group`` is written into, from the request's
        block table; :data:`~kvtier.protocol.SKIP` where a block must not be written
        (below ``hbm_tokens``: the HBM hit's blocks, shared; or the null block)."""
        return self._rules(group).blocks_to_load(self, group, table, chunk, hbm_tokens)

    def blocks_to_save(self, group: int, table: Sequence[int], chunk: int,
                       computed_tokens: int, computed_before: int | None = None
                       ) -> list[int] | SaveDrop | None:
        """The block ids chunk ``chunk`` of ``group`` is saved from, once ``computed_tokens``
        tokens are in the cache: None when the group has nothing to save for this chunk (a
        state that does not exist there, a window already past), or why the whole chunk
        must be dropped. ``computed_before``: the tokens computed before this step, where
        known; a sliding-window group's blocks that left the window then were released by
        vLLM in this step's scheduling (and may already hold another request's KV), which
        ``table`` (kvtier's own copy, never told) does not show."""
        return self._rules(group).blocks_to_save(self, group, table, chunk, computed_tokens,
                                                 computed_before)

    def load_bytes(self, boundary: int, hbm_tokens: int) -> int:
        """Bytes one rank reads to restore tokens [hbm_tokens, boundary * chunk_tokens)."""
        return sum(self._rules(g).load_bytes(self, g, boundary, hbm_tokens)
                   for g in range(len(self.groups)))

    # -- the slab ----------------------------------------------------------------------------
    def slab_layout(self, config: KvtierConfig, num_shards: int) -> SlabLayout:
        """The slab layout both halves derive, identically, from config and geometry."""
        kv = [self.chunk_bytes(g) for g in self.kv_groups]
        state = [self.chunk_bytes(g) for g in self.state_groups]
        return lay_out_slab(
            config.dram_size, kv, num_shards=num_shards,
            state_slot_bytes=max(state) if state else None, state_bytes=config.state_size,
            checksum_entries=[self.blocks_per_chunk(g) for g in self.kv_groups]
            + ([1] if state else []),
        )


def lcm_block_size(groups: Sequence[GroupGeometry]) -> int:
    return math.lcm(*(g.block_size for g in groups)) if groups else 1


def make_slab_layout(config: KvtierConfig, geometry: Geometry, num_shards: int) -> SlabLayout:
    """:meth:`Geometry.slab_layout` as a function."""
    return geometry.slab_layout(config, num_shards)


# -- per-kind rules ----------------------------------------------------------------------------
class _KindRules:
    """Full attention: the whole prefix, ``blocks_per_chunk`` blocks per chunk."""

    def blocks_per_chunk(self, geo: Geometry, g: int) -> int:
        return geo.chunk_tokens // geo.groups[g].block_size

    def chunks_checked_at(self, geo: Geometry, g: int, boundary: int) -> range:
        return range(0)  # the prefix chain, matched by the index

    def chunks_to_load(self, geo: Geometry, g: int, first_chunk: int, boundary: int) -> range:
        return range(first_chunk, boundary)

    def first_load_token(self, geo: Geometry, g: int, boundary: int, hbm_tokens: int) -> int:
        return hbm_tokens

    def blocks_to_load(self, geo: Geometry, g: int, table: Sequence[int], chunk: int,
                       hbm_tokens: int) -> list[int]:
        bpc = self.blocks_per_chunk(geo, g)
        first = chunk * bpc
        ids = list(table[first:first + bpc])
        first_needed = hbm_tokens // geo.groups[g].block_size  # below: the HBM hit, shared
        if len(ids) == bpc and first >= first_needed and NULL_BLOCK not in ids:
            return ids
        ids += [NULL_BLOCK] * (bpc - len(ids))
        return [SKIP if first + i < first_needed or b == NULL_BLOCK else b
                for i, b in enumerate(ids)]

    def blocks_to_save(self, geo: Geometry, g: int, table: Sequence[int], chunk: int,
                       computed_tokens: int, computed_before: int | None = None
                       ) -> list[int] | SaveDrop | None:
        bpc = self.blocks_per_chunk(geo, g)
        ids = list(table[chunk * bpc:(chunk + 1) * bpc])
        if len(ids) < bpc or NULL_BLOCK in ids:
            return self.missing_blocks()
        return ids

    def missing_blocks(self) -> SaveDrop | None:
        return SaveDrop.BLOCKS_MISSING  # a hole in the prefix: later chunks are orphans

    def load_bytes(self, geo: Geometry, g: int, boundary: int, hbm_tokens: int) -> int:
        gg = geo.groups[g]
        start = self.first_load_token(geo, g, boundary, hbm_tokens)
        end = boundary * geo.chunk_tokens
        return max(0, end // gg.block_size - start // gg.block_size) * gg.bytes_per_block


class _WindowRules(_KindRules):
    """Sliding window: only the chunks of the window before the boundary."""

    def chunks_checked_at(self, geo: Geometry, g: int, boundary: int) -> range:
        return geo.window_chunks(g, boundary)

    def chunks_to_load(self, geo: Geometry, g: int, first_chunk: int, boundary: int) -> range:
        return range(max(first_chunk, geo.window_chunks(g, boundary).start), boundary)

    def first_load_token(self, geo: Geometry, g: int, boundary: int, hbm_tokens: int) -> int:
        return max(hbm_tokens, geo.window_chunks(g, boundary).start * geo.chunk_tokens)

    def missing_blocks(self) -> SaveDrop | None:
        return None  # out of the window already: not needed for any later hit

    def blocks_to_save(self, geo: Geometry, g: int, table: Sequence[int], chunk: int,
                       computed_tokens: int, computed_before: int | None = None
                       ) -> list[int] | SaveDrop | None:
        if computed_before is not None:
            # vLLM frees a window group's block k once (k + 1) * block_size <=
            # computed - window + 1 (SlidingWindowManager.get_num_skipped_tokens, both
            # versions; 0.32 frees at most that many), replacing it by the null block in its
            # table only: a chunk whose first block went then is not the request's any more.
            # Those positions are out of the window of every boundary at or after this chunk's
            # end, so no hit needs them; but a stored chunk must hold its own bytes throughout.
            gg = geo.groups[g]
            released = max(0, computed_before - (gg.sliding_window or 0) + 1) // gg.block_size
            if chunk * self.blocks_per_chunk(geo, g) < released:
                return None
        return super().blocks_to_save(geo, g, table, chunk, computed_tokens, computed_before)


class _StateRules(_KindRules):
    """Recurrent state: one block per chunk, the state after the chunk's last token."""

    def blocks_per_chunk(self, geo: Geometry, g: int) -> int:
        return 1

    @staticmethod
    def _state_block(geo: Geometry, g: int, table: Sequence[int], chunk: int) -> int:
        """The block holding the state after ``(chunk + 1) * chunk_tokens`` tokens."""
        return table[(chunk + 1) * geo.chunk_tokens // geo.groups[g].block_size - 1]

    def chunks_checked_at(self, geo: Geometry, g: int, boundary: int) -> range:
        return range(boundary - 1, boundary)

    def chunks_to_load(self, geo: Geometry, g: int, first_chunk: int, boundary: int) -> range:
        return range(boundary - 1, boundary)

    def blocks_to_load(self, geo: Geometry, g: int, table: Sequence[int], chunk: int,
                       hbm_tokens: int) -> list[int]:
        return [self._state_block(geo, g, table, chunk)]

    def blocks_to_save(self, geo: Geometry, g: int, table: Sequence[int], chunk: int,
                       computed_tokens: int, computed_before: int | None = None
                       ) -> list[int] | SaveDrop | None:
        if computed_tokens != (chunk + 1) * geo.chunk_tokens:
            return None  # state exists only where a step ended exactly
        return [self._state_block(geo, g, table, chunk)]

    def load_bytes(self, geo: Geometry, g: int, boundary: int, hbm_tokens: int) -> int:
        return geo.groups[g].bytes_per_block


_RULES: dict[GroupKind, _KindRules] = {
    GroupKind.FULL: _KindRules(),
    GroupKind.SLIDING_WINDOW: _WindowRules(),
    GroupKind.STATE: _StateRules(),
}

"""kvtier.geometry: one value for chunk and group geometry, built from a real layout, with the
per-kind rules the scheduler and planner use (which chunks a load restores, which blocks a
save reads or a load writes, which chunks a hit needs)."""

from __future__ import annotations

import pickle

import pytest

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV
from kvtier.config import ConfigError
from kvtier.geometry import NULL_BLOCK, Geometry, GroupGeometry, resolve_chunk_tokens
from kvtier.layout import GroupKind
from kvtier.protocol import SKIP, SaveDrop

C = 64
FULL = GroupGeometry(GroupKind.FULL, 16, 100)
WINDOW = GroupGeometry(GroupKind.SLIDING_WINDOW, 16, 10, sliding_window=100)
STATE = GroupGeometry(GroupKind.STATE, 64, 7)
GEO = Geometry(C, (FULL, WINDOW, STATE))


def test_of_a_real_layout_a_state_chunk_is_one_block() -> None:
    kv = SmallKV()
    geo = Geometry.of_layout(kv.layout, CHUNK_TOKENS)
    assert geo.fingerprint == kv.layout.fingerprint
    assert [geo.blocks_per_chunk(g) for g in range(2)] == [2, 1]
    assert [geo.chunk_bytes(g) for g in range(2)] == [
        2 * kv.layout.groups[0].bytes_per_block, kv.layout.groups[1].bytes_per_block]
    assert geo.slot_classes == (0, 1)
    slab = geo.slab_layout(CONFIG, 1)
    assert [c.slot_bytes for c in slab.classes] == [geo.chunk_bytes(0), geo.chunk_bytes(1)]
    assert pickle.loads(pickle.dumps(geo)) == geo  # it travels in the handshake


def test_chunk_size_is_checked_once() -> None:
    with pytest.raises(ValueError, match="multiple of 48"):
        Geometry(64, (GroupGeometry(GroupKind.FULL, 16, 1), GroupGeometry(GroupKind.FULL, 48, 1)))
    assert resolve_chunk_tokens(None, [16, 48]) == 288
    with pytest.raises(ConfigError, match="chunk_tokens=48 or 96"):
        resolve_chunk_tokens(50, [16, 48])


def test_seed_004_chunk_is_the_lcm_with_the_state_group_block_size() -> None:
    """1,536-token attention groups beside a 3,072-token KDA state group: 3,072 is the least
    valid chunk (the seed needed it); 1,536 is refused naming it."""
    sizes = [1536, 1536, 3072]
    assert resolve_chunk_tokens(None, sizes) == 3072
    assert resolve_chunk_tokens(6144, sizes) == 6144
    with pytest.raises(ConfigError, match=r"chunk_tokens=3072, or leave it unset"):
        resolve_chunk_tokens(1536, sizes)


def test_slot_classes_one_per_kv_group_then_one_for_all_state() -> None:
    geo = Geometry(C, (STATE, FULL, STATE, WINDOW))
    assert geo.slot_classes == (2, 0, 2, 1)
    assert geo.kv_groups == [1, 3] and geo.full_groups == [1] and geo.state_groups == [0, 2]


def test_which_chunks_a_load_restores_and_a_hit_needs() -> None:
    # boundary 5 (320 tokens), 2 chunks in HBM; the window (100 tokens) reaches chunk 3
    assert GEO.chunks_to_load(0, 2, 5) == range(2, 5)
    assert GEO.chunks_to_load(1, 2, 5) == range(3, 5)
    assert GEO.chunks_to_load(2, 2, 5) == range(4, 5)
    assert GEO.chunks_checked_at(0, 5) == range(0)  # the prefix chain: matched by the index
    assert GEO.chunks_checked_at(1, 5) == range(3, 5)
    assert GEO.chunks_checked_at(2, 5) == range(4, 5)


def test_which_blocks_a_save_reads() -> None:
    table = [1, 2, 3, 4, 5, 6, 7, 8]
    assert GEO.blocks_to_save(0, table, 1, 128) == [5, 6, 7, 8]
    assert GEO.blocks_to_save(0, [1, 2, 3], 0, 64) == SaveDrop.BLOCKS_MISSING
    assert GEO.blocks_to_save(0, [1, NULL_BLOCK, 3, 4], 0, 64) == SaveDrop.BLOCKS_MISSING
    assert GEO.blocks_to_save(1, [NULL_BLOCK, NULL_BLOCK, 3, 4], 0, 64) is None  # out of window
    state_table = [11, 12, 13]  # one state block per 64 tokens
    assert GEO.blocks_to_save(2, state_table, 1, 128) == [12]
    assert GEO.blocks_to_save(2, state_table, 1, 130) is None  # no state ends there


def test_a_window_chunk_whose_blocks_vllm_released_before_the_step_is_not_saved() -> None:
    """vLLM frees window block k once (k + 1) * 16 <= computed - 100 + 1, in the scheduling of
    the step, and tells no connector (its own table gets the null block): kvtier's copy still
    shows the block. Chunk 1 (blocks 4-7) completing in a step that starts at 180 computed
    tokens: block 4 (tokens 64-79) went at 80 + 99 = 179, so it is not saved; from 178 it
    is still the request's."""
    table = list(range(1, 13))
    assert GEO.blocks_to_save(1, table, 1, 192, computed_before=180) is None
    assert GEO.blocks_to_save(1, table, 1, 192, computed_before=178) == [5, 6, 7, 8]
    assert GEO.blocks_to_save(1, table, 1, 192) == [5, 6, 7, 8]  # unknown: as before
    assert GEO.blocks_to_save(0, table, 1, 192, computed_before=180) == [5, 6, 7, 8]  # full


def test_which_blocks_a_load_writes() -> None:
    table = [1, 2, 3, 4, 5, 6, 7, 8]
    assert GEO.blocks_to_load(0, table, 1, 0) == [5, 6, 7, 8]
    assert GEO.blocks_to_load(0, table, 1, 96) == [SKIP, SKIP, 7, 8]  # below: the HBM hit
    assert GEO.blocks_to_load(1, [0, 0, 0, 0, 5, 6], 1, 0) == [5, 6, SKIP, SKIP]
    assert GEO.blocks_to_load(2, [11, 12, 13], 2, 0) == [13]


def test_load_bytes_per_kind() -> None:
    # full: blocks 6..19 (14 x 100); window: chunk 3 on (blocks 12..19, 8 x 10); state: 7
    assert GEO.load_bytes(5, 96) == 14 * 100 + 8 * 10 + 7

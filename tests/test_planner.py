"""The planner: hit size, every decline reason, the cost model and save choices."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.config import KvtierConfig
from kvtier.geometry import resolve_chunk_tokens
from kvtier.index.base import Entry
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.layout import GroupKind
from kvtier.planner import (
    CostEstimates,
    Decline,
    Geometry,
    GroupGeometry,
    chunks_to_save,
    decide_load,
    find_hit,
    load_bytes,
    load_cost,
)
from kvtier.policy import make_policy
from kvtier.slab import SlotAllocator

C = 64  # tokens per chunk
KiB = 1024


def keys_for(n: int, seed: str = "p") -> list[bytes]:
    out, parent = [], b"ns"
    for i in range(n):
        parent = hashlib.blake2b(parent + f"{seed}{i}".encode(), digest_size=16).digest()
        out.append(parent)
    return out


def make(groups: list[GroupGeometry], slots: int = 64) -> tuple[MemoryIndex, Geometry]:
    geo = Geometry(C, tuple(groups))
    specs = []
    for i, g in enumerate(groups):
        specs.append(GroupIndexSpec(
            i, make_policy("lru", slots), chained=g.kind is GroupKind.FULL,
            boundary_state=g.kind is GroupKind.STATE))
    return MemoryIndex(specs, SlotAllocator([slots] * len(groups))), geo


def store(idx: MemoryIndex, group: int, keys: list[bytes], chunks: range) -> None:
    for j in chunks:
        parent = keys[j - 1] if j > 0 and idx.groups[group].chained else None
        e = idx.reserve(group, keys[j], parent)
        assert isinstance(e, Entry), e
        idx.commit(e)


FULL = GroupGeometry(GroupKind.FULL, 16, 2048 * KiB)  # Llama-3-8B: 128 KiB per token
SWA = GroupGeometry(GroupKind.SLIDING_WINDOW, 16, 128 * KiB, sliding_window=100)
STATE = GroupGeometry(GroupKind.STATE, 64, 4 * 2**20)


def test_whole_chunks_only_and_never_the_last_prompt_token() -> None:
    idx, geo = make([FULL])
    keys = keys_for(4)
    store(idx, 0, keys, range(4))
    # 4 full chunks stored, prompt of exactly 4 chunks: the last token must be computed
    hit = find_hit(idx, geo, keys, num_prompt_tokens=4 * C, hbm_tokens=0)
    assert hit.ok and hit.boundary == 3 and hit.tokens == 3 * C
    hit = find_hit(idx, geo, keys, num_prompt_tokens=4 * C + 1, hbm_tokens=0)
    assert hit.boundary == 4 and hit.tokens == 4 * C


def test_hit_counts_only_tokens_beyond_the_hbm_hit() -> None:
    idx, geo = make([FULL])
    keys = keys_for(4)
    store(idx, 0, keys, range(4))
    hit = find_hit(idx, geo, keys, 4 * C + 10, hbm_tokens=C + 16)
    assert hit.boundary == 4 and hit.tokens == 4 * C - (C + 16)


def test_reason_too_short() -> None:
    idx, geo = make([FULL])
    assert find_hit(idx, geo, [], C, 0).reason is Decline.TOO_SHORT


def test_reason_miss() -> None:
    idx, geo = make([FULL])
    assert find_hit(idx, geo, keys_for(3), 3 * C + 1, 0).reason is Decline.MISS


def test_reason_not_beyond_hbm() -> None:
    idx, geo = make([FULL])
    keys = keys_for(4)
    store(idx, 0, keys, range(2))
    assert find_hit(idx, geo, keys, 4 * C + 1, hbm_tokens=2 * C).reason is Decline.NOT_BEYOND_HBM
    assert find_hit(idx, geo, keys, 4 * C + 1, hbm_tokens=3 * C).reason is Decline.NOT_BEYOND_HBM


def test_sliding_window_needs_only_the_window_before_the_boundary() -> None:
    idx, geo = make([FULL, SWA])
    keys = keys_for(6)
    store(idx, 0, keys, range(6))
    store(idx, 1, keys, range(3, 6))  # window 100 tokens < 2 chunks: chunks 4,5 suffice
    hit = find_hit(idx, geo, keys, 6 * C + 1, 0)
    assert hit.ok and hit.boundary == 6
    idx2, _ = make([FULL, SWA])
    store(idx2, 0, keys, range(6))
    store(idx2, 1, keys, range(0, 3))  # window chunks missing at every boundary past 3+...
    hit = find_hit(idx2, geo, keys, 6 * C + 1, 0)
    assert hit.boundary == 3  # falls back to a boundary whose window is stored
    idx3, _ = make([FULL, SWA])
    store(idx3, 0, keys, range(6))
    assert find_hit(idx3, geo, keys, 6 * C + 1, 0).reason is Decline.WINDOW_MISSING


def test_recurrent_state_of_the_boundary_must_be_present() -> None:
    idx, geo = make([FULL, STATE])
    keys = keys_for(5)
    store(idx, 0, keys, range(5))
    assert find_hit(idx, geo, keys, 5 * C + 1, 0).reason is Decline.STATE_MISSING
    store(idx, 1, keys, range(2, 3))  # state stored at boundary 3 only
    hit = find_hit(idx, geo, keys, 5 * C + 1, 0)
    assert hit.ok and hit.boundary == 3


def test_every_state_group_of_the_boundary_must_be_present() -> None:
    """Three state groups (a 4-layer Qwen3-Next on vLLM 0.32): boundary 4 has two of its
    three states written and the third still writing, boundary 2 its whole set."""
    idx, geo = make([STATE, STATE, STATE, FULL])
    keys = keys_for(5)
    store(idx, 3, keys, range(5))
    whole = [idx.reserve(g, keys[1], None) for g in (0, 1, 2)]  # a set: reserved, then committed
    assert all(isinstance(e, Entry) and idx.commit(e) for e in whole)
    writing = [idx.reserve(g, keys[3], None) for g in (0, 1, 2)]
    for e in writing[:2]:
        assert isinstance(e, Entry) and idx.commit(e)
    hit = find_hit(idx, geo, keys, 5 * C + 1, 0)
    assert hit.ok and hit.boundary == 2  # boundary 4 is a miss, never a partial restore
    assert isinstance(writing[2], Entry) and idx.commit(writing[2])
    assert find_hit(idx, geo, keys, 5 * C + 1, 0).boundary == 4


def test_load_bytes_count_blocks_beyond_hbm_and_window_and_state() -> None:
    geo = Geometry(C, (FULL, SWA, STATE))
    # full: blocks 1..15 (16 tokens each, hbm 16 tokens), swa: window chunks 2..3 = 8 blocks
    n = load_bytes(geo, boundary=4, hbm_tokens=16)
    assert n == 15 * FULL.bytes_per_block + 8 * SWA.bytes_per_block + STATE.bytes_per_block


def test_cost_model_accepts_at_50gbps_and_declines_at_half_a_gbps() -> None:
    idx, geo = make([FULL])
    keys = keys_for(20)
    store(idx, 0, keys, range(20))
    hit = find_hit(idx, geo, keys, 20 * C + 1, 0)
    fast = CostEstimates(link_gbps=50, prefill_seconds_per_token=50e-6, step_seconds=0.02)
    slow = CostEstimates(link_gbps=0.5, prefill_seconds_per_token=50e-6, step_seconds=0.02)
    assert decide_load(geo, hit, 0, fast).ok
    declined = decide_load(geo, hit, 0, slow)
    assert declined.reason is Decline.NOT_WORTH_IT and declined.tokens == 0
    assert decide_load(geo, hit, 0, slow, use_cost_model=False).ok


def test_a_one_chunk_hit_behind_a_large_hbm_hit_is_declined_when_parking_costs_more() -> None:
    idx, geo = make([FULL])
    keys = keys_for(40)
    store(idx, 0, keys, range(40))
    est = CostEstimates(link_gbps=50, prefill_seconds_per_token=50e-6, step_seconds=0.02)
    one_chunk = find_hit(idx, geo, keys, 40 * C + 1, hbm_tokens=39 * C)
    assert one_chunk.tokens == C
    cost = load_cost(geo, one_chunk, 39 * C, est)
    assert cost.recompute_seconds < cost.load_seconds  # 3.2 ms of prefill vs a 20 ms step
    assert decide_load(geo, one_chunk, 39 * C, est).reason is Decline.NOT_WORTH_IT
    many = find_hit(idx, geo, keys, 40 * C + 1, hbm_tokens=0)
    assert decide_load(geo, many, 0, est).ok  # the same store, a large hit pays


def test_estimates_follow_measurements() -> None:
    est = CostEstimates(link_gbps=20, prefill_seconds_per_token=50e-6, step_seconds=0.02)
    for _ in range(50):
        est.observe_transfer(55 * 10**9, 1.0)
        est.observe_prefill(1000, 0.036)
        est.observe_step(0.01)
    assert est.link_gbps == pytest.approx(55, rel=1e-3)
    assert est.prefill_seconds_per_token == pytest.approx(36e-6, rel=1e-3)
    assert est.step_seconds == pytest.approx(0.01, rel=1e-3)


def test_chunks_to_save_prompt_only_or_with_generated_tokens() -> None:
    # prompt of 3.5 chunks, computed 5 chunks' worth (1.5 chunks generated)
    assert chunks_to_save(C, 5, 0, 5 * C, int(3.5 * C), save_generated=False) == range(0, 3)
    assert chunks_to_save(C, 5, 0, 5 * C, int(3.5 * C), save_generated=True) == range(0, 5)
    # never twice: resume from the first unsaved chunk
    assert chunks_to_save(C, 5, 3, 5 * C, int(3.5 * C), save_generated=True) == range(3, 5)
    # keys not yet known for the last chunk: wait
    assert chunks_to_save(C, 4, 3, 5 * C, 0, save_generated=True) == range(3, 4)
    assert chunks_to_save(C, 5, 5, 5 * C, 0, True) == range(5, 5)


def test_chunk_size_must_be_a_multiple_of_every_block_size() -> None:
    with pytest.raises(ValueError, match="multiple of 48"):
        Geometry(64, (GroupGeometry(GroupKind.FULL, 16, 1), GroupGeometry(GroupKind.FULL, 48, 1)))
    default = KvtierConfig().chunk_tokens  # unset: smallest multiple of the LCM >= 256
    assert resolve_chunk_tokens(default, [16, 48]) == 288
    assert resolve_chunk_tokens(default, [32]) == 256
    assert resolve_chunk_tokens(default, [544]) == 544


def test_every_decline_reason_is_covered() -> None:
    """The connector-level reasons (FAILED_BEFORE, LOAD_BOUND, LOADS_DISABLED, DEFERRED,
    UNSAVEABLE) are exercised by the connector tests, the preparation's (PREPARE_TIMEOUT,
    PREPARE_FAILED) by tests/test_prepare.py; this lists all of them."""
    assert {r.name for r in Decline} == {
        "TOO_SHORT", "UNSAVEABLE", "MISS", "NOT_BEYOND_HBM", "WINDOW_MISSING", "STATE_MISSING",
        "NOT_WORTH_IT", "FAILED_BEFORE", "LOAD_BOUND", "LOADS_DISABLED", "DEFERRED",
        "PREPARE_TIMEOUT", "PREPARE_FAILED",
    }

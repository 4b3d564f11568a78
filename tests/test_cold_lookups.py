"""Cache-aware admission's connector half (kvtier.vllm.cold_lookups) on vLLM 0.32's real block
pool: HBM is short when the pool's free blocks (evictable cached ones included) cannot hold
the request from scratch; busy after a step that scheduled tokens or with loads in flight;
only cold lookups are deferred."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool

from kvtier.config import KvtierConfig
from kvtier.vllm.cold_lookups import ColdLookups

CONFIG = KvtierConfig(dram_size="1MiB", defer_cold_requests=True, defer_max_steps=2)


@dataclass
class Req:
    request_id: str
    num_tokens: int


@dataclass
class Out:
    total_num_scheduled_tokens: int


def _cold(pool_blocks: int = 21) -> tuple[ColdLookups, BlockPool]:
    cold = ColdLookups(CONFIG, priority=False, block_sizes=[16])
    pool = BlockPool(num_gpu_blocks=pool_blocks, enable_caching=True, hash_block_size=16)
    cold.bind_pool(pool)
    return cold, pool


def test_short_only_when_the_free_blocks_cannot_hold_the_request() -> None:
    cold, pool = _cold()  # 20 usable blocks (vLLM keeps one as its null block)
    assert pool.get_num_free_blocks() == 20
    assert not cold.hbm_short(320) and cold.hbm_short(321)
    pool.get_new_blocks(15)
    assert cold.hbm_short(81) and not cold.hbm_short(80)


def test_a_cold_lookup_is_deferred_only_while_busy_and_short_and_then_bounded() -> None:
    cold, pool = _cold()
    pool.get_new_blocks(15)
    big = Req("a", 200)
    assert not cold.defer(big, 0, 0)  # nothing ran yet
    cold.step_planned(Out(64), loading=False)
    assert cold.defer(big, 0, 0)
    assert not cold.defer(big, 32, 0) and not cold.defer(Req("w", 200), 0, 48)  # warm
    assert not cold.defer(Req("s", 64), 0, 0)  # it fits
    cold.step_planned(Out(0), loading=True)  # loads in flight: still busy
    assert cold.defer(big, 0, 0)
    cold.step_planned(Out(0), loading=False)
    assert not cold.busy and not cold.defer(Req("b", 200), 0, 0)
    cold.step_planned(Out(1), loading=False)
    assert not cold.defer(big, 0, 0)  # its third step: past defer_max_steps
    assert cold.deferrals.deferred == 2 and cold.deferrals.expired == 1


def test_never_under_the_priority_policy() -> None:
    cold = ColdLookups(CONFIG, priority=True, block_sizes=[16])
    pool = BlockPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=16)
    cold.bind_pool(pool)
    cold.step_planned(Out(8), loading=True)
    assert not cold.defer(Req("a", 1000), 0, 0)

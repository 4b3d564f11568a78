"""Cache-aware admission's connector half (kvtier.vllm.admission) on vLLM 0.32's real block
pool: a request fits when the pool's free blocks (evictable cached ones included) hold what it
needs beyond its HBM hit in every group (a state group: one block); busy after a step that
scheduled tokens or with loads in flight; deferred when it waits for a producer or does not
fit, only while busy, never under the priority policy, within its bounds."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool

from kvtier.config import KvtierConfig
from kvtier.layout import GroupKind, GroupSpec
from kvtier.vllm.admission import Admission, blocks_needed

CONFIG = KvtierConfig(dram_size="1MiB", cache_aware_admission=True, defer_max_steps=2)
FULL = GroupSpec(GroupKind.FULL, 16, ("l0",))


@dataclass
class Req:
    request_id: str
    num_tokens: int


@dataclass
class Out:
    total_num_scheduled_tokens: int


def _admission(pool_blocks: int = 21, priority: bool = False) -> tuple[Admission, BlockPool]:
    adm = Admission(CONFIG, priority=priority, groups=[FULL])
    pool = BlockPool(num_gpu_blocks=pool_blocks, enable_caching=True, hash_block_size=16)
    adm.bind_pool(pool)
    return adm, pool


def test_blocks_needed_beyond_the_hit_per_kind_of_group() -> None:
    assert blocks_needed([FULL], 320, 0) == 20 and blocks_needed([FULL], 321, 0) == 21
    assert blocks_needed([FULL], 321, 160) == 11  # the hit's 10 blocks are there
    window = GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("w",), sliding_window=64)
    assert blocks_needed([window], 1600, 0) == 5  # the window's 4 blocks and one more
    state = GroupSpec(GroupKind.STATE, 544, ("s",))
    assert blocks_needed([FULL, state, state], 320, 0) == 22  # one running state each


def test_fits_when_the_free_blocks_hold_what_it_needs_beyond_its_hit() -> None:
    adm, pool = _admission()  # 20 usable blocks (vLLM keeps one as its null block)
    assert pool.get_num_free_blocks() == 20
    assert adm.fits(320, 0) and not adm.fits(321, 0)
    pool.get_new_blocks(15)
    assert adm.fits(80, 0) and not adm.fits(81, 0) and adm.fits(160, 80)
    assert not adm.fits(400, 192)  # 13 blocks beyond a hit of less than half its prompt


def test_a_warm_request_is_never_deferred_for_room() -> None:
    """A request whose HBM hit covers half its prompt or more needs little beyond it: when even
    that does not fit, vLLM's scan stops at it (it goes first once room appears), and no
    deferral makes vLLM walk its long hit again every step."""
    adm, pool = _admission()
    pool.get_new_blocks(20)  # nothing free
    adm.step_planned(Out(64), loading=False)
    assert adm.fits(4000, 2000) and not adm.defer(Req("w", 4000), 2000)
    assert adm.defer(Req("w2", 4000), 2000, 3000)  # but it still waits for a producer
    assert adm.defer(Req("c", 4000), 1984)  # under half: deferred for room


def test_deferred_while_busy_when_it_does_not_fit_or_waits_for_a_producer() -> None:
    adm, pool = _admission()
    pool.get_new_blocks(15)
    big = Req("a", 200)
    assert not adm.defer(big, 0)  # nothing ran yet
    adm.step_planned(Out(64), loading=False)
    assert adm.defer(big, 0)  # does not fit
    assert not adm.defer(Req("s", 32), 0)  # fits with room to spare, nobody produces it
    assert adm.defer(Req("p", 64), 0, 32)  # fits, but a running request produces it
    assert not adm.defer(Req("h", 200), 160)  # its hit leaves 3 blocks to allocate
    adm.step_planned(Out(0), loading=True)  # loads in flight: still busy
    assert adm.defer(big, 0)
    adm.step_planned(Out(0), loading=False)
    assert not adm.busy and not adm.defer(Req("b", 200), 0, 160)
    adm.step_planned(Out(1), loading=False)
    assert not adm.defer(big, 0)  # its third step: past defer_max_steps
    c = adm.counters()
    assert c["admission_deferred"] == 3 and c["admission_expired"] == 1
    assert c["admission_waited_for_room"] == 2 and c["admission_waited_for_producer"] == 1


def test_room_is_held_for_the_requests_that_wait_for_a_producer() -> None:
    """A prompt of another prefix fits beside the first, but not beside the first's siblings:
    each sibling waiting for the first's prefix holds the blocks it will need beyond it, so
    the other prefix waits (the DeepSeek-V2-Lite run on the H200 went two prefixes at a time
    without this). A hold ends when its request is admitted, finishes, or has not waited in
    this step or the one before."""
    adm, pool = _admission(pool_blocks=31)  # 30 usable blocks of 16 tokens
    pool.get_new_blocks(12)  # the first prompt's 192 tokens, computing: 18 free
    adm.step_planned(Out(64), loading=False)
    other = Req("other", 192)  # 12 blocks
    # it fits, but would leave 6 free, less than it takes: the first time it is asked it
    # waits a step, so that the scan reaches the requests behind it
    assert adm.defer(other, 0)
    assert adm.defer(Req("s1", 320), 0, 192) and adm.defer(Req("s2", 320), 0, 192)
    assert adm.held_blocks() == 16 and adm.held_blocks("s1") == 8  # 8 beyond the prefix each
    assert adm.defer(other, 0)  # asked again: 18 - 16 held < 12: it would take the siblings' room
    assert not adm.defer(Req("small", 16), 0)  # 1 block: fits beside the held room
    adm.step_planned(Out(64), loading=False)
    assert not adm.defer(Req("s1", 320), 192)  # the prefix is in HBM: s1 is admitted
    assert adm.held_blocks() == 8
    adm.forget("s2")
    assert adm.held_blocks() == 0 and not adm.defer(other, 0)
    assert adm.defer(Req("s3", 320), 0, 192)
    adm.step_planned(Out(64), loading=False)
    assert adm.held_blocks() == 8  # waited in the step before
    adm.step_planned(Out(64), loading=False)
    assert adm.held_blocks() == 0  # not asked again for two steps: nothing held
    c = adm.counters()
    assert c["admission_waited_for_producer"] == 3 and c["admission_waited_for_room"] == 1
    assert c["admission_looked_ahead"] == 1


def test_a_look_ahead_at_tight_room_is_short() -> None:
    """With nobody waiting for a producer behind it, a request that leaves little room waits a
    step on its first ask, and while chunks are produced into HBM and a step after; one with
    room to spare, or warm, never waits."""
    adm, pool = _admission(pool_blocks=31)
    pool.get_new_blocks(12)  # 18 free
    adm.step_planned(Out(64), loading=False)
    assert adm.defer(Req("t", 192), 0)  # 12 of 18: a first look
    adm.step_planned(Out(64), loading=False)
    assert not adm.defer(Req("t", 192), 0)
    assert not adm.defer(Req("roomy", 128), 0)  # 8 of 18 leaves 10
    assert not adm.defer(Req("warm", 400), 200)  # half its prompt in HBM
    # while running requests produce prompt chunks into HBM, and a step after, a tight
    # request waits: the scan reaches the producers' waiters only when a prefill ends
    adm.step_planned(Out(64), loading=False, producing=True)
    assert adm.defer(Req("t2", 192), 0) and adm.defer(Req("t2", 192), 0)
    assert not adm.defer(Req("roomy", 128), 0)
    adm.step_planned(Out(64), loading=False)
    assert adm.defer(Req("t2", 192), 0)
    adm.step_planned(Out(64), loading=False)
    assert not adm.defer(Req("t2", 192), 0)
    assert adm.counters()["admission_looked_ahead"] == 4


def test_never_under_the_priority_policy() -> None:
    adm, _ = _admission(pool_blocks=5, priority=True)
    adm.step_planned(Out(8), loading=True)
    assert not adm.defer(Req("a", 1000), 0) and not adm.defer(Req("b", 8), 0, 8)


def test_the_old_setting_name_still_turns_it_on() -> None:
    assert KvtierConfig(dram_size="1MiB", defer_cold_requests=True).cache_aware_admission
    assert not KvtierConfig(dram_size="1MiB").cache_aware_admission

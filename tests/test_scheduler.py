"""The scheduler half driven by hand, one :class:`StepInput` per engine step, with integer
prompts and a two-group model (full attention + sliding window).

Every test goes through the scheduler's step-shaped entry points only (``lookup``,
``start_load``, ``schedule_step``, ``on_report``, ``request_finished``, ``reset``): what the
engine adapter calls. Workers are played by building the :class:`WorkerReport` they would send.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.config import KvtierConfig
from kvtier.layout import GroupKind
from kvtier.planner import Geometry, GroupGeometry, make_slab_layout
from kvtier.protocol import Job, StepPlan, WorkerReport
from kvtier.scheduler import (
    CachedRequest,
    NewRequest,
    OffloadScheduler,
    ScheduledTokens,
    StepInput,
)

C = 32  # chunk tokens: 2 blocks of 16 tokens per chunk in both groups
BLOCK = 16
BYTES_PER_BLOCK = 4096
GEOMETRY = Geometry(C, (
    GroupGeometry(GroupKind.FULL, BLOCK, BYTES_PER_BLOCK),
    GroupGeometry(GroupKind.SLIDING_WINDOW, BLOCK, BYTES_PER_BLOCK, sliding_window=C),
))
NAMESPACE = b"n" * 16


def make_scheduler(world_size: int = 1, **settings: object) -> OffloadScheduler:
    # cost_model off: every stored hit is taken, whatever the (default) link estimates say
    config = KvtierConfig(dram_size="4MiB", cost_model=False, **settings)  # type: ignore[arg-type]
    layout = make_slab_layout(config, GEOMETRY, world_size)
    return OffloadScheduler(config, GEOMETRY, NAMESPACE, layout, world_size=world_size)


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 1000 + i) % 50_000 + 1 for i in range(n)]


def table(first: int, n: int) -> list[list[int]]:
    """A block table of ``n`` blocks per group; group 1 lives 100 ids above group 0."""
    return [list(range(first, first + n)), list(range(first + 100, first + 100 + n))]


def new_step(sched: OffloadScheduler, req_id: str, prompt: Sequence[int], blocks: list[list[int]],
             computed_after: int) -> StepPlan:
    return sched.schedule_step(StepInput(
        new=[NewRequest(req_id, blocks)],
        scheduled=[ScheduledTokens(req_id, prompt, computed_after, len(prompt))]))


def ok(jobs: Sequence[Job], ranks: int = 1) -> dict[int, list[int]]:
    return {j.job_id: [ranks, 0] for j in jobs}


def stored(sched: OffloadScheduler, req_id: str, prompt: Sequence[int],
           blocks: list[list[int]]) -> None:
    """``req_id`` computes ``prompt`` in one step, every rank reports its saves, it finishes:
    the prompt's whole chunks are stored."""
    plan = new_step(sched, req_id, prompt, blocks, len(prompt))
    sched.on_report(WorkerReport(saves=ok(plan.saves)))
    sched.request_finished(req_id)


def test_save_commit_lookup_load_report() -> None:
    sched = make_scheduler()
    p = tokens(100)  # 3 whole chunks and 4 tokens
    sched.add_request("a")
    assert sched.lookup("a", p, 0) == 0  # nothing stored yet
    plan = new_step(sched, "a", p, table(1, 7), computed_after=100)
    assert [j.chunk for j in plan.saves] == [0, 1, 2]
    # every chunk of both groups, from the request's own blocks
    assert [[op.block_ids for op in j.ops] for j in plan.saves] == [
        [[1, 2], [101, 102]], [[3, 4], [103, 104]], [[5, 6], [105, 106]]]
    assert plan.fence == [] and plan.loads == []

    sched.add_request("b")
    assert sched.lookup("b", p, 0) == 0  # written but not reported: invisible
    sched.on_report(WorkerReport(saves=ok(plan.saves)))
    assert sched.stats.saves_committed == 3

    assert sched.lookup("b", p, 0) == 96  # never the last prompt token: 3 chunks
    job = sched.start_load("b", 96, table(20, 7))
    # full attention: every chunk; sliding window (32 tokens): only the window of chunk 2
    assert [(op.group, op.block_ids) for op in job.ops] == [
        (0, [20, 21]), (0, [22, 23]), (0, [24, 25]), (1, [124, 125])]
    plan = sched.schedule_step(StepInput(
        new=[NewRequest("b", table(20, 7))],
        scheduled=[ScheduledTokens("b", p, 100, 100)]))
    assert [j.job_id for j in plan.loads] == [job.job_id]
    assert plan.saves == []  # b's chunks are stored already: never twice
    sched.on_report(WorkerReport(loads=ok(plan.loads), bytes_loaded=1, load_seconds=1.0))
    assert (sched.stats.loads_ok, sched.stats.loaded_tokens) == (1, 96)
    for r in ("a", "b"):
        sched.request_finished(r)
    sched.check_drained()


def test_a_chunk_is_visible_only_when_every_rank_wrote_it_and_a_failure_aborts_it() -> None:
    sched = make_scheduler(world_size=2)
    p = tokens(70, seed=1)
    sched.add_request("a")
    plan = new_step(sched, "a", p, table(1, 5), computed_after=70)
    first, second = plan.saves
    sched.on_report(WorkerReport(saves={first.job_id: [1, 0], second.job_id: [1, 0]}))
    sched.add_request("b")
    assert sched.lookup("b", p, 0) == 0  # one rank of two reported
    sched.on_report(WorkerReport(saves={first.job_id: [1, 0], second.job_id: [0, 1]}))
    assert sched.lookup("b", p, 0) == C  # chunk 1 failed on a rank: only chunk 0 stored
    assert sched.stats.saves_failed == 1
    with pytest.raises(RuntimeError, match="unknown save job"):
        sched.on_report(WorkerReport(saves={first.job_id: [1, 0]}))  # finished already


def test_a_job_reported_more_than_once_per_rank_is_an_error() -> None:
    sched = make_scheduler()
    sched.add_request("a")
    plan = new_step(sched, "a", tokens(40), table(1, 3), computed_after=40)
    with pytest.raises(RuntimeError, match="more than once"):
        sched.on_report(WorkerReport(saves={plan.saves[0].job_id: [2, 0]}))


def test_a_step_that_reallocates_a_block_a_save_still_reads_fences_the_save() -> None:
    sched = make_scheduler()
    sched.add_request("a")
    plan_a = new_step(sched, "a", tokens(64), table(1, 4), computed_after=64)
    save0, save1 = plan_a.saves
    sched.request_finished("a")  # vLLM frees a's blocks; its saves are still in flight
    sched.add_request("c")
    # c gets block 3 (read by chunk 1's save) and fresh ones; its own save is not fenced
    plan = new_step(sched, "c", tokens(40, seed=2), [[3, 9, 10], [50, 51, 52]],
                    computed_after=40)
    assert plan.fence == [save1.job_id]
    assert sched.stats.fences == 1 and sched.stats.fences_after_finish == 1
    # copy targets are allocations too; block 0 (vLLM's null block) never fences
    plan = sched.schedule_step(StepInput(copy_targets=[[0, 1], [0]]))
    assert plan.fence == [save0.job_id]
    sched.on_report(WorkerReport(saves=ok([save0, save1])))
    sched.request_finished("c")
    sched.on_report(WorkerReport(saves=ok(plan.saves)))


def test_a_block_reused_by_another_group_fences_the_save_that_reads_it() -> None:
    """vLLM's hybrid allocator has one block pool for every group: a block that a save of the
    full group still reads can come back as a sliding-window block of another request (found
    by the reliability harness, scenario full+swa seed 13, two ranks)."""
    sched = make_scheduler()
    sched.add_request("a")
    plan_a = new_step(sched, "a", tokens(64), table(1, 4), computed_after=64)
    full_save = plan_a.saves[1]  # chunk 1: blocks 3-4 (full), 103-104 (window)
    assert 3 in full_save.ops[0].block_ids and full_save.ops[0].group == 0
    sched.request_finished("a")
    sched.add_request("c")
    # c's full group gets fresh blocks; its window group gets block 3
    plan = new_step(sched, "c", tokens(40, seed=2), [[60, 61, 62], [3, 51, 52]],
                    computed_after=40)
    assert plan.fence == [full_save.job_id]
    sched.on_report(WorkerReport(saves=ok(plan_a.saves)))
    sched.request_finished("c")
    sched.on_report(WorkerReport(saves=ok(plan.saves)))


def test_preemption_fences_the_requests_saves_and_its_resumed_table_is_used() -> None:
    sched = make_scheduler()
    p = tokens(100, seed=3)
    sched.add_request("a")
    sched.lookup("a", p, 0)
    first = new_step(sched, "a", p[:64], table(1, 7), computed_after=32).saves
    assert [j.chunk for j in first] == [0]
    plan = sched.schedule_step(StepInput(preempted=["a"]))
    assert plan.fence == [first[0].job_id]
    assert sched.stats.preempted_with_saves == 1
    # resumed with a whole new table: chunks saved before are not saved again
    plan = sched.schedule_step(StepInput(
        cached=[CachedRequest("a", table(30, 7), resumed=True)],
        scheduled=[ScheduledTokens("a", p, 100, 100)]))
    assert [(j.chunk, j.ops[0].block_ids) for j in plan.saves] == [(1, [32, 33]), (2, [34, 35])]
    sched.on_report(WorkerReport(saves=ok(first + plan.saves)))
    sched.request_finished("a")
    sched.check_drained()


def test_preempted_and_resumed_in_one_step_keeps_the_resumed_table() -> None:
    """The order rule of schedule_step: a preemption since the last step is applied before
    the same step's resumed table, whatever order the engine lists them in."""
    sched = make_scheduler()
    p = tokens(64, seed=4)
    sched.add_request("a")
    sched.lookup("a", p, 0)
    first = new_step(sched, "a", p, table(1, 4), computed_after=32).saves
    plan = sched.schedule_step(StepInput(
        cached=[CachedRequest("a", table(40, 4), resumed=True)],
        preempted=["a"],
        scheduled=[ScheduledTokens("a", p, 64, 64)]))
    assert first[0].job_id in plan.fence
    assert [(j.chunk, [op.block_ids for op in j.ops]) for j in plan.saves] == [
        (1, [[42, 43], [142, 143]])]
    assert not sched.stats.saves_dropped
    sched.on_report(WorkerReport(saves=ok(first + plan.saves)))


def test_appended_blocks_extend_the_table() -> None:
    sched = make_scheduler()
    p = tokens(70, seed=5)
    sched.add_request("a")
    plan = new_step(sched, "a", p[:32], [[1], [101]], computed_after=16)
    assert plan.saves == []  # chunk 0 is not computed yet
    plan = sched.schedule_step(StepInput(
        cached=[CachedRequest("a", [[2, 3, 4], [102, 103, 104]])],
        scheduled=[ScheduledTokens("a", p, 64, 70)]))
    assert [[op.block_ids for op in j.ops] for j in plan.saves] == [
        [[1, 2], [101, 102]], [[3, 4], [103, 104]]]


def test_a_missing_full_attention_block_drops_the_save_and_the_chunks_after_it() -> None:
    sched = make_scheduler()
    sched.add_request("a")
    plan = new_step(sched, "a", tokens(96, seed=6), [[1, 2, 3, 0, 5, 6], table(1, 6)[1]],
                    computed_after=96)
    assert [j.chunk for j in plan.saves] == [0]
    assert sched.stats.saves_dropped == {"blocks_missing": 1}


def test_a_full_save_queue_drops_saves_with_its_reason() -> None:
    sched = make_scheduler(max_pending_saves=1)
    sched.add_request("a")
    plan = new_step(sched, "a", tokens(100, seed=7), table(1, 7), computed_after=100)
    assert [j.chunk for j in plan.saves] == [0]
    assert sched.stats.saves_dropped == {"save_queue_full": 1}


def test_reset_while_a_load_is_pinned() -> None:
    sched = make_scheduler()
    p = tokens(100, seed=8)
    sched.add_request("a")
    plan = new_step(sched, "a", p, table(1, 7), computed_after=100)
    sched.on_report(WorkerReport(saves=ok(plan.saves)))
    sched.add_request("b")
    assert sched.lookup("b", p, 0) == 96
    job = sched.start_load("b", 96, table(20, 7))
    assert sched.occupancy()[0] == 6  # 3 chunks in 2 groups
    sched.reset()  # the load still reads 4 of those slots: they stay taken until it ends
    plan = sched.schedule_step(StepInput(new=[NewRequest("b", table(20, 7))]))
    assert plan.reset and [j.job_id for j in plan.loads] == [job.job_id]
    sched.add_request("c")
    assert sched.lookup("c", p, 0) == 0  # gone for lookups at once
    assert sched.occupancy()[0] == len(job.ops) == 4
    sched.on_report(WorkerReport(loads=ok([job])))
    assert sched.stats.loads_ok == 1 and sched.occupancy()[0] == 0
    for r in ("a", "b", "c"):
        sched.request_finished(r)
    sched.check_drained()


def test_a_failed_load_is_never_offered_again_to_that_request() -> None:
    sched = make_scheduler()
    p = tokens(70, seed=9)
    sched.add_request("a")
    plan = new_step(sched, "a", p, table(1, 5), computed_after=70)
    sched.on_report(WorkerReport(saves=ok(plan.saves)))
    sched.add_request("b")
    assert sched.lookup("b", p, 0) == 2 * C
    job = sched.start_load("b", 2 * C, table(20, 5))
    sched.schedule_step(StepInput(new=[NewRequest("b", table(20, 5))]))
    sched.on_report(WorkerReport(loads={job.job_id: [0, 1]}))
    assert sched.stats.loads_failed == 1
    assert sched.lookup("b", p, 0) == 0
    assert sched.stats.declined["load_failed_before"] == 1


def test_a_reused_request_id_starts_a_new_lifecycle() -> None:
    sched = make_scheduler()
    old_prompt, new_prompt = tokens(70, seed=10), tokens(70, seed=11)
    sched.add_request("x")
    old_saves = new_step(sched, "x", old_prompt, table(1, 5), computed_after=70).saves
    sched.request_finished("x")  # its saves are still in flight
    sched.add_request("x")  # vLLM reuses the id for another prompt
    assert sched.lookup("x", new_prompt, 0) == 0
    new_saves = new_step(sched, "x", new_prompt, table(10, 5), computed_after=70).saves
    assert [j.ops[0].block_ids for j in new_saves] == [[10, 11], [12, 13]]
    sched.on_report(WorkerReport(saves=ok(old_saves)))  # the old lifecycle ends...
    assert "x" in sched.requests  # ...and the new one is untouched
    sched.add_request("y")
    assert sched.lookup("y", old_prompt, 0) == 2 * C  # the old saves were committed
    sched.on_report(WorkerReport(saves=ok(new_saves)))
    for r in ("x", "y"):
        sched.request_finished(r)
    sched.check_drained()

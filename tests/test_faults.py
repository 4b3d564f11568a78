"""The test-only fault wrapper (kvtier.testing.faults) around the real CPU engine, through
the worker: each switch does what the end-to-end tests rely on, and only that."""

from __future__ import annotations

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV, same
from kvtier.protocol import Job, StepPlan, TransferOp
from kvtier.testing.faults import FaultyEngine, faulty_factory
from kvtier.worker import OffloadWorker


def make(kv: SmallKV) -> tuple[OffloadWorker, FaultyEngine]:
    worker = OffloadWorker(CONFIG, kv.layout, CHUNK_TOKENS, engine_factory=faulty_factory())
    assert isinstance(worker.engine, FaultyEngine)
    return worker, worker.engine


def run(worker: OffloadWorker, plan: StepPlan, drain: bool = True) -> dict[int, list[int]]:
    worker.fence(plan)
    worker.begin_step(plan)
    worker.end_step(plan)
    if drain:
        worker.drain()
    rep = worker.collect().report
    return {**rep.saves, **rep.loads}


def save(job_id: int, slot: int, blocks: list[int]) -> Job:
    return Job(job_id, "r", [TransferOp(0, slot, blocks)], chunk=slot)


def test_everything_off_is_the_engine_itself() -> None:
    kv = SmallKV(seed=10)
    worker, faults = make(kv)
    want = kv.attn_block(1)
    assert run(worker, StepPlan(1, saves=[save(1, 0, [1, 2])])) == {1: [1, 0]}
    kv.wipe()
    assert run(worker, StepPlan(2, loads=[Job(2, "r", [TransferOp(0, 0, [5, 6])])])) == {
        2: [1, 0]}
    assert same(kv.attn_block(5), want) and faults.injected == 0
    worker.close()


def test_raise_in_jobs_fails_that_many_jobs_without_running_them() -> None:
    kv = SmallKV(seed=11)
    worker, faults = make(kv)
    faults.raise_in_jobs = 1
    got = run(worker, StepPlan(1, saves=[save(1, 0, [1, 2]), save(2, 1, [3, 4])]))
    assert got == {1: [0, 1], 2: [1, 0]} and faults.injected == 1 and worker.failures == 1
    worker.close()


def test_fail_loads_reports_loads_that_ran_as_failed() -> None:
    kv = SmallKV(seed=12)
    worker, faults = make(kv)
    run(worker, StepPlan(1, saves=[save(1, 0, [1, 2])]))
    faults.fail_loads = 1
    loads = [Job(2, "r", [TransferOp(0, 0, [5, 6])]), Job(3, "s", [TransferOp(0, 0, [7, 8])])]
    assert run(worker, StepPlan(2, loads=loads)) == {2: [0, 1], 3: [1, 0]}
    assert same(kv.attn_block(5), kv.attn_block(1))  # it did run
    worker.close()


def test_skip_load_chunk_leaves_one_chunk_unwritten_and_reports_success() -> None:
    kv = SmallKV(seed=13)
    worker, faults = make(kv)
    run(worker, StepPlan(1, saves=[save(1, 0, [1, 2]), save(2, 1, [3, 4])]))
    kv.wipe(value=7.0)
    poison = kv.attn_block(10)
    faults.skip_load_chunk = 0
    load = Job(3, "r", [TransferOp(0, 0, [10, 11]), TransferOp(0, 1, [12, 13])])
    assert run(worker, StepPlan(2, loads=[load])) == {3: [1, 0]}
    assert same(kv.attn_block(10), poison)  # chunk 0 was skipped...
    assert not same(kv.attn_block(12), poison)  # ...chunk 1 was not
    worker.close()


def test_skip_state_loads_copies_the_kv_but_not_the_state_and_reports_success() -> None:
    kv = SmallKV(seed=15)
    worker, faults = make(kv)
    run(worker, StepPlan(1, saves=[Job(1, "r", [TransferOp(0, 0, [1, 2]),
                                                TransferOp(1, 0, [3])], chunk=0)]))
    kv.wipe(value=7.0)
    poison_attn, poison_state = kv.attn_block(10), kv.state_block(12)
    faults.skip_state_loads = True
    load = Job(2, "r", [TransferOp(0, 0, [10, 11]), TransferOp(1, 0, [12])])
    assert run(worker, StepPlan(2, loads=[load])) == {2: [1, 0]}  # reported successful
    assert not same(kv.attn_block(10), poison_attn)  # the KV came back...
    assert same(kv.state_block(12), poison_state)  # ...the state object did not
    assert faults.injected == 1
    faults.skip_state_loads = False
    assert run(worker, StepPlan(3, loads=[Job(3, "r", [TransferOp(1, 0, [12])])])) == {3: [1, 0]}
    assert not same(kv.state_block(12), poison_state)  # switched off: state restored
    worker.close()


def test_held_jobs_wait_their_steps_and_a_fence_releases_a_held_save() -> None:
    kv = SmallKV(seed=14)
    worker, faults = make(kv)
    faults.hold_steps = 2
    assert run(worker, StepPlan(1, saves=[save(1, 0, [1, 2]), save(2, 1, [3, 4])]),
               drain=False) == {}
    assert worker.pending() == 2
    got = run(worker, StepPlan(2, fence=[2]), drain=False)  # the fence hands job 2 over
    faults.inner.drain()
    got.update(worker.collect().report.saves)
    assert 2 in got and 1 not in got
    got.update(run(worker, StepPlan(3), drain=False))  # two ticks later job 1 runs
    faults.inner.drain()
    got.update(worker.collect().report.saves)
    assert got == {1: [1, 0], 2: [1, 0]}
    worker.close()

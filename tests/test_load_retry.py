"""Re-issued loads (kvtier.load_retry) on the real worker half and a real CPU KV cache, the
faults from kvtier.testing.faults: a load whose copy fails is re-submitted from its slots and
reported once, as a success when an attempt succeeds, as a failure (with its reason) after
the last; saves are never re-issued."""

from __future__ import annotations

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV, same
from kvtier.load_retry import LOAD_RETRIES, RetryingLoads, retrying_factory
from kvtier.protocol import Job, StepPlan, TransferOp
from kvtier.testing.faults import FaultyEngine, faulty_factory
from kvtier.worker import OffloadWorker, StepResult


def retrying_worker(kv: SmallKV) -> tuple[OffloadWorker, RetryingLoads, FaultyEngine]:
    worker = OffloadWorker(CONFIG, kv.layout, CHUNK_TOKENS,
                           engine_factory=retrying_factory(faulty_factory()))
    engine = worker.engine
    assert isinstance(engine, RetryingLoads) and isinstance(engine.inner, FaultyEngine)
    return worker, engine, engine.inner


def step(worker: OffloadWorker, plan: StepPlan) -> StepResult:
    """One engine step, the transfers given time to finish (as tests/test_worker.py)."""
    worker.fence(plan)
    worker.begin_step(plan)
    worker.end_step(plan)
    worker.drain()
    return worker.collect()


def save_job(job_id: int, slot: int, blocks: list[int], state_block: int) -> Job:
    return Job(job_id, "r", [TransferOp(0, slot, blocks), TransferOp(1, slot, [state_block])])


def load_plan(step_no: int, job_id: int) -> StepPlan:
    return StepPlan(step_no, loads=[Job(job_id, "r", [TransferOp(0, 0, [7, 8]),
                                                      TransferOp(1, 0, [9])])])


def collect_until_reported(worker: OffloadWorker, first: StepResult, steps: int = 6
                           ) -> list[StepResult]:
    """The collects that reported a load (a re-issued load is reported a collect later)."""
    results = [first]
    for _ in range(steps):
        worker.drain()
        results.append(worker.collect())
    return [r for r in results if r.report.loads]


def test_a_copy_error_once_is_reissued_and_reported_as_one_success() -> None:
    kv = SmallKV(seed=11)
    worker, engine, faulty = retrying_worker(kv)
    want = kv.attn_block(1) + kv.attn_block(2) + kv.state_block(3)
    step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)]))
    kv.wipe()
    faulty.raise_in_jobs = 1
    reported = collect_until_reported(worker, step(worker, load_plan(2, 2)))
    assert [r.report.loads for r in reported] == [{2: [1, 0]}]
    assert reported[0].finished_loads == {"r"} and reported[0].failed_loads == set()
    assert engine.reissued == 1 and faulty.injected == 1 and engine.take_errors() == {}
    assert same(kv.attn_block(7) + kv.attn_block(8) + kv.state_block(9), want)
    worker.close()


def test_a_load_failing_every_attempt_is_reported_failed_once_with_its_reason() -> None:
    kv = SmallKV(seed=12)
    worker, engine, faulty = retrying_worker(kv)
    step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)]))
    faulty.fail_loads = 1  # this job's every notice says failed
    reported = collect_until_reported(worker, step(worker, load_plan(2, 2)))
    assert [r.report.loads for r in reported] == [{2: [0, 1]}]
    assert reported[0].failed_loads == {"r"}
    assert engine.reissued == LOAD_RETRIES
    assert engine.take_errors() == {2: "kvtier test fault: load reported failed"}
    assert engine.take_errors() == {}  # taken once
    worker.close()


def test_a_failed_save_is_not_reissued() -> None:
    kv = SmallKV(seed=13)
    worker, engine, faulty = retrying_worker(kv)
    faulty.raise_in_jobs = 1
    res = step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)]))
    assert res.report.saves == {1: [0, 1]} and engine.reissued == 0
    assert faulty.injected == 1
    worker.close()

"""The null-copy engine (kvtier.testing.null_copy): the same jobs as the real engine reported
done, with the bytes the real engine moves, in the step they start, and no byte moved."""

from __future__ import annotations

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV, same
from kvtier.checksum import key_seed
from kvtier.protocol import Job, StepPlan, TransferOp
from kvtier.testing.null_copy import NullCopyEngine, null_copy_factory
from kvtier.transfer import EngineWrapper, TransferEngine, find_engine
from kvtier.worker import OffloadWorker, StepResult

KEY = bytes(range(16))
SAVE = Job(1, "s", [TransferOp(0, 0, [1, 2], key_seed(KEY)), TransferOp(1, 0, [3], key_seed(KEY))])
LOAD = Job(2, "s", [TransferOp(0, 0, [5, 6], key_seed(KEY)), TransferOp(1, 0, [7], key_seed(KEY))])


def _step(worker: OffloadWorker, plan: StepPlan, drain: bool) -> StepResult:
    worker.fence(plan)
    worker.begin_step(plan)
    worker.end_step(plan)
    if drain:
        worker.drain()
    return worker.collect()


def _save_then_load(null: bool) -> tuple[SmallKV, OffloadWorker, StepResult, StepResult]:
    kv = SmallKV(seed=5)
    factory = null_copy_factory(None, link_gbps=10.0) if null else None
    worker = OffloadWorker(CONFIG, kv.layout, CHUNK_TOKENS, engine_factory=factory)
    saved = _step(worker, StepPlan(1, saves=[SAVE]), drain=not null)  # null: no waiting
    loaded = _step(worker, StepPlan(2, loads=[LOAD]), drain=not null)
    return kv, worker, saved, loaded


def test_it_reports_the_real_engines_bytes_in_the_same_step_and_moves_none() -> None:
    real_kv, real, real_saved, real_loaded = _save_then_load(null=False)
    kv, worker, saved, loaded = _save_then_load(null=True)
    assert isinstance(worker.engine, NullCopyEngine)
    assert isinstance(worker.engine, EngineWrapper)
    assert find_engine(worker.engine, TransferEngine) is worker.engine
    assert saved.report.saves == real_saved.report.saves == {1: [1, 0]}
    assert loaded.report.loads == real_loaded.report.loads == {2: [1, 0]}
    assert loaded.finished_loads == real_loaded.finished_loads == {"s"}
    assert saved.report.bytes_stored == real_saved.report.bytes_stored > 0
    assert loaded.report.bytes_loaded == real_loaded.report.bytes_loaded > 0
    # the seconds are the bytes at the configured link rate: the planner's estimate stays put
    assert abs(loaded.report.load_seconds - loaded.report.bytes_loaded / 10e9) < 1e-12
    # the real engine restored blocks 5-7 from 1-3; null-copy left them as they were
    assert same(real_kv.attn_block(5), real_kv.attn_block(1))
    assert same(real_kv.state_block(7), real_kv.state_block(3))
    fresh = SmallKV(seed=5)
    for b in (5, 6):
        assert same(kv.attn_block(b), fresh.attn_block(b))
    assert same(kv.state_block(7), fresh.state_block(7))
    assert not same(kv.attn_block(5), kv.attn_block(1))
    assert worker.engine.report_steps == {0: 2} and worker.engine.jobs_reported == 2
    assert worker.pending() == 0
    worker.close()
    real.close()


def test_a_verify_job_and_a_fence_finish_at_once() -> None:
    kv = SmallKV(seed=1)
    worker = OffloadWorker(CONFIG, kv.layout, CHUNK_TOKENS,
                           engine_factory=null_copy_factory(None, link_gbps=10.0))
    verify = Job(3, "v", [TransferOp(0, 0, [-1, -1], key_seed(KEY))])
    res = _step(worker, StepPlan(1, saves=[SAVE], verifies=[verify], fence=[1]), drain=False)
    assert res.report.verifies == {3: [1, 0]} and not res.report.corrupt
    assert res.report.fences_waited == 0
    worker.close()

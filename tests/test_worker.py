"""The worker half on a real CPU KV cache, driven one step plan at a time (``fence``,
``begin_step``, ``end_step``, ``collect``): every job is reported exactly once per rank, as
the scheduler's :class:`WorkerReport` expects it, whatever the engine's notices do
(duplicated, lost), and a load that fails names its request and blocks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV, same
from kvtier.protocol import Job, StepPlan, TransferOp, WorkerReport
from kvtier.transfer import ChunkMover, Completion, ThreadedTransferEngine, TransferEngine
from kvtier.worker import REQUERY_STEPS, OffloadWorker, StepResult


class UnreliableNotices(TransferEngine):
    """A real CPU engine whose completion notices arrive twice, or the first one never.
    ``query`` answers from what the engine really finished (the ground truth)."""

    def __init__(self, mover: ChunkMover, duplicate: bool = False, lose: bool = False) -> None:
        self.inner = ThreadedTransferEngine(mover)
        self.duplicate, self.lose = duplicate, lose
        self.finished: dict[int, Completion] = {}

    def save(self, job: Job) -> None:
        self.inner.save(job)

    def load(self, job: Job) -> None:
        self.inner.load(job)

    def fence(self, job_ids: Sequence[int]) -> int:
        return self.inner.fence(job_ids)

    def poll(self) -> list[Completion]:
        out = []
        for c in self.inner.poll():
            self.finished[c.job_id] = c
            if not self.lose:
                out += [c, c] if self.duplicate else [c]
        return out

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        return [self.finished[j] for j in job_ids if j in self.finished]

    def pending(self) -> int:
        return self.inner.pending()

    def drain(self) -> None:
        self.inner.drain()

    def close(self) -> None:
        self.inner.close()


def make_worker(kv: SmallKV, engine: Callable[[ChunkMover], TransferEngine] | None = None,
                verify: bool = True, **kw: object) -> OffloadWorker:
    """``verify=False`` for tests of the job protocol that load slots never saved (those
    fail verification, as they should)."""
    config = CONFIG.model_copy(update={"verify_checksums": verify})
    return OffloadWorker(config, kv.layout, CHUNK_TOKENS, engine_factory=engine,
                         **kw)  # type: ignore[arg-type]


def step(worker: OffloadWorker, plan: StepPlan) -> StepResult:
    """One engine step as the adapter drives it, the transfers given time to finish."""
    worker.fence(plan)
    worker.begin_step(plan)
    worker.end_step(plan)
    worker.drain()
    return worker.collect()


def save_job(job_id: int, slot: int, blocks: list[int], state_block: int) -> Job:
    return Job(job_id, "r", [TransferOp(0, slot, blocks), TransferOp(1, slot, [state_block])],
               chunk=slot)


def test_a_save_and_a_load_round_trip_and_are_reported_once() -> None:
    kv = SmallKV(seed=2)
    worker = make_worker(kv)
    want = kv.attn_block(1) + kv.attn_block(2) + kv.state_block(3)
    res = step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)]))
    assert res.report.saves == {1: [1, 0]} and res.report.bytes_stored > 0
    saved = res.report.bytes_stored
    kv.wipe()
    res = step(worker, StepPlan(2, loads=[Job(2, "r", [TransferOp(0, 0, [7, 8]),
                                                        TransferOp(1, 0, [9])])]))
    assert res.report.loads == {2: [1, 0]} and res.finished_loads == {"r"}
    assert res.failed_loads == set() and res.report.bytes_loaded == saved
    assert same(kv.attn_block(7) + kv.attn_block(8) + kv.state_block(9), want)
    assert worker.collect().report.empty()  # nothing reported twice
    worker.close()


def test_duplicated_notices_are_reported_once() -> None:
    kv = SmallKV(seed=3)
    worker = make_worker(kv, lambda m: UnreliableNotices(m, duplicate=True))
    res = step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3), save_job(2, 1, [4, 5], 6)]))
    assert res.report.saves == {1: [1, 0], 2: [1, 0]}
    res = step(worker, StepPlan(2, loads=[Job(3, "r", [TransferOp(0, 0, [7, 8])])]))
    assert res.report.loads == {3: [1, 0]} and res.finished_loads == {"r"}
    assert worker.duplicate_completions == 3
    assert worker.collect().report.empty()
    worker.close()


def test_a_lost_notice_is_found_by_query_within_a_few_collects() -> None:
    kv = SmallKV(seed=4)
    worker = make_worker(kv, lambda m: UnreliableNotices(m, lose=True), verify=False)
    plan = StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)],
                    loads=[Job(2, "q", [TransferOp(0, 1, [7, 8])])])
    reports = [step(worker, plan)]
    reports += [worker.collect() for _ in range(REQUERY_STEPS + 2)]
    saves = [r.report.saves for r in reports if r.report.saves]
    loads = [r for r in reports if r.report.loads]
    assert saves == [{1: [1, 0]}]  # exactly once...
    assert [r.report.loads for r in loads] == [{2: [1, 0]}] and loads[0].finished_loads == {"q"}
    assert reports.index(loads[0]) <= REQUERY_STEPS  # ...and within a few steps
    assert worker.requeried == 2 and worker.pending() == 0
    worker.close()


def test_a_failed_load_names_its_request_and_blocks() -> None:
    kv = SmallKV(seed=5)
    worker = make_worker(kv, verify=False)
    bad = Job(1, "r", [TransferOp(0, 10**6, [4, 5]), TransferOp(1, 0, [6])])  # no such slot
    res = step(worker, StepPlan(1, loads=[bad, Job(2, "s", [TransferOp(0, 0, [9, 10])])]))
    assert res.report.loads == {1: [0, 1], 2: [1, 0]}
    assert res.finished_loads == {"r", "s"} and res.failed_loads == {"r"}
    assert res.failed_blocks == {4, 5, 6} and worker.failures == 1
    worker.close()


def test_a_rank_that_does_not_write_still_reports_its_saves() -> None:
    """Replicated layouts (MLA under TP): only the first rank stores the single copy."""
    kv = SmallKV(seed=6)
    worker = make_worker(kv, rank=1, world_size=2, replicated=True)
    assert not worker.writes
    res = step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)]))
    assert res.report.saves == {1: [1, 0]} and res.report.bytes_stored == 0
    assert worker.collect().report.empty()
    worker.close()


def test_reports_of_several_ranks_sum() -> None:
    kv = SmallKV(seed=7)
    ranks = [make_worker(kv, rank=r, world_size=2) for r in range(2)]
    plan = StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)])
    results = [step(w, plan) for w in ranks]
    total = results[0].merge(results[1]).report
    assert total.saves == {1: [2, 0]}
    assert total.bytes_stored == sum(r.report.bytes_stored for r in results) > 0
    for w in ranks:
        w.close()


def test_each_job_that_finished_ok_is_reported_with_its_bytes_and_seconds() -> None:
    """The histograms' observations (kvtier.vllm.counters.worker_observations): one entry per
    job, with the bytes and seconds of that job alone; a failed job adds none."""
    kv = SmallKV(seed=7)
    worker = make_worker(kv)
    res = step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3), save_job(2, 1, [4, 5], 6)]))
    saves = res.report.jobs
    assert [k for k, _, _ in saves] == ["save", "save"]
    assert sum(b for _, b, _ in saves) == res.report.bytes_stored and saves[0][1] == saves[1][1]
    assert all(s > 0 for _, _, s in saves)
    assert sum(s for _, _, s in saves) == res.report.store_seconds
    res = step(worker, StepPlan(2, loads=[Job(3, "r", [TransferOp(0, 0, [7, 8])]),
                                          Job(4, "q", [TransferOp(0, 9999, [9])])]))
    assert res.report.loads == {3: [1, 0], 4: [0, 1]}
    assert [(k, b) for k, b, _ in res.report.jobs] == [("load", res.report.bytes_loaded)]
    both = WorkerReport(jobs=[("save", 1, 0.5)]).add(res.report)
    assert [k for k, _, _ in both.jobs] == ["save", "load"]  # summed over ranks: all kept
    worker.close()


class _SlowLoadOps:
    """The worker's real mover, each load copy starting ``delay_s`` late (on the copy thread)."""

    def __init__(self, mover: ChunkMover, delay_s: float) -> None:
        self.mover, self.delay_s = mover, delay_s

    def __getattr__(self, name: str) -> object:
        return getattr(self.mover, name)

    def load_op(self, op: TransferOp) -> int:
        time.sleep(self.delay_s)
        return self.mover.load_op(op)


def test_an_idle_step_waits_for_its_load_and_a_busy_one_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that runs no forward (StepPlan.idle) blocks in collect for a load in flight and
    reports it; a step with a forward returns at once. Without the wait the in-process engine
    spins through empty steps and starves the copy thread of the GIL (10-30 ms a load)."""
    import kvtier.worker

    monkeypatch.setattr(kvtier.worker, "IDLE_WAIT_S", 10.0)  # returns at the completion
    kv = SmallKV(seed=9)
    worker = make_worker(kv, lambda m: ThreadedTransferEngine(_SlowLoadOps(m, 0.05)))  # type: ignore[arg-type]
    assert step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)])).report.saves == {1: [1, 0]}
    for job_id, idle in ((2, False), (3, True)):
        plan = StepPlan(job_id, loads=[Job(job_id, "r", [TransferOp(0, 0, [7, 8])])], idle=idle)
        worker.begin_step(plan)
        worker.end_step(plan)
        t0 = time.perf_counter()
        res = worker.collect()
        waited = time.perf_counter() - t0
        if idle:
            assert res.report.loads == {job_id: [1, 0]} and 0.01 < waited < 5.0
        else:
            assert not res.report.loads and waited < 0.04
            worker.drain()
            assert worker.collect().report.loads == {job_id: [1, 0]}
    worker.close()

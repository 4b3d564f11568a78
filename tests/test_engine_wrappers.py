"""Transfer engines stack: re-issued loads (kvtier.load_retry) around the test machinery's
faults and byte masks (kvtier.testing) around the real engine. A wrapper that forgets a call
breaks whatever sits below it: on the H200 the restore check's stack (masks inside faults
inside re-issues, vLLM 0.25.1 with several KV-cache groups) refused every verify job and the
probe could not find its fault switches. Every wrapper passes on what it does not change."""

from __future__ import annotations

import inspect

import pytest

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV
from kvtier.checksum import key_seed
from kvtier.load_retry import RetryingLoads, retrying_factory
from kvtier.protocol import SKIP, Job, StepPlan, TransferOp
from kvtier.testing.controls import MaskedLoads, masked_factory
from kvtier.testing.corruption import flip_stored_byte
from kvtier.testing.faults import FaultyEngine, faulty_factory
from kvtier.testing.null_copy import NullCopyEngine
from kvtier.transfer import EngineWrapper, TransferEngine, find_engine
from kvtier.worker import OffloadWorker

WRAPPERS = (RetryingLoads, FaultyEngine, MaskedLoads, NullCopyEngine)
CALLS = [name for name, fn in inspect.getmembers(TransferEngine, inspect.isfunction)
         if not name.startswith("_")]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_engine_call_reaches_the_inner_engine_or_is_overridden(wrapper: type) -> None:
    assert issubclass(wrapper, EngineWrapper)
    for name in CALLS:
        impl = getattr(wrapper, name)
        # never the base class's default (verify raises, query answers nothing)
        assert impl is not getattr(TransferEngine, name), (wrapper.__name__, name)


def _stacked_worker() -> tuple[SmallKV, OffloadWorker]:
    """The probe's stack on 0.25.1 with several groups: re-issues(faults(masks(CPU engine)))."""
    kv = SmallKV(seed=3)
    factory = retrying_factory(faulty_factory(masked_factory(None)))
    return kv, OffloadWorker(CONFIG, kv.layout, CHUNK_TOKENS, engine_factory=factory)


def _run(worker: OffloadWorker, plan: StepPlan) -> object:
    worker.fence(plan)
    worker.begin_step(plan)
    worker.end_step(plan)
    worker.drain()
    return worker.collect()


def test_a_verify_job_goes_through_the_whole_stack_and_finds_a_flip() -> None:
    _, worker = _stacked_worker()
    key = bytes(range(16))
    save = Job(1, "s", [TransferOp(0, 0, [1, 2], key_seed(key))])
    assert _run(worker, StepPlan(1, saves=[save])).report.saves == {1: [1, 0]}  # type: ignore[attr-defined]
    verify = Job(2, "v", [TransferOp(0, 0, [SKIP, SKIP], key_seed(key))])
    clean = _run(worker, StepPlan(2, verifies=[verify]))
    assert clean.report.verifies == {2: [1, 0]} and not clean.report.corrupt  # type: ignore[attr-defined]
    flip_stored_byte(worker, 0, 0, offset=0)
    verify3 = Job(3, "v", [TransferOp(0, 0, [SKIP, SKIP], key_seed(key))])
    bad = _run(worker, StepPlan(3, verifies=[verify3]))
    assert bad.report.corrupt == {3: [(0, 0)]}  # type: ignore[attr-defined]
    worker.close()


def test_find_engine_walks_the_stack_outermost_first() -> None:
    _, worker = _stacked_worker()
    engine = worker.engine
    assert isinstance(engine, RetryingLoads)
    assert find_engine(engine, RetryingLoads) is engine
    faults = find_engine(engine, FaultyEngine)
    masks = find_engine(engine, MaskedLoads)
    assert faults is engine.inner and masks is faults.inner  # type: ignore[union-attr]
    assert find_engine(masks, FaultyEngine) is None
    worker.close()

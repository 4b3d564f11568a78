"""The CPU transfer engine on a real KV cache: whole jobs move bytes between paged blocks and
slab slots bit for bit, SKIP positions are left alone, a copy that raises is a failed job
(never a lost one), and a fence waits for the saves it names."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV, same
from kvtier.protocol import SKIP, Job, TransferOp
from kvtier.transfer import Completion, ThreadedTransferEngine
from kvtier.worker import IDLE_WAIT_S, OffloadWorker


@pytest.fixture
def kv() -> SmallKV:
    return SmallKV(seed=1)


@pytest.fixture
def engine(kv: SmallKV) -> Iterator[ThreadedTransferEngine]:
    worker = OffloadWorker(CONFIG, kv.layout, CHUNK_TOKENS)
    eng = ThreadedTransferEngine(worker.mover)
    yield eng
    eng.close()
    worker.close()


def run(engine: ThreadedTransferEngine) -> dict[int, Completion]:
    engine.drain()
    got: dict[int, Completion] = {}
    for c in engine.poll():
        assert c.job_id not in got, "a completion reported twice"
        got[c.job_id] = c
    assert engine.pending() == 0 and engine.poll() == []
    return got


def test_save_then_load_into_other_blocks_is_bit_exact(kv: SmallKV,
                                                       engine: ThreadedTransferEngine) -> None:
    want_attn = kv.attn_block(3) + kv.attn_block(4) + kv.attn_block(9) + kv.attn_block(10)
    want_state = kv.state_block(5)
    engine.save(Job(1, "r", [TransferOp(0, 0, [3, 4]), TransferOp(1, 0, [5])], chunk=0))
    engine.save(Job(2, "r", [TransferOp(0, 1, [9, 10])], chunk=1))
    done = run(engine)
    assert all(c.ok and c.kind == "save" for c in done.values())
    kv.wipe()
    engine.load(Job(3, "r", [TransferOp(0, 0, [12, 13]), TransferOp(0, 1, [14, 15]),
                             TransferOp(1, 0, [16])]))
    (c,) = run(engine).values()
    assert c.ok and c.kind == "load" and c.nbytes == done[1].nbytes + done[2].nbytes
    got = kv.attn_block(12) + kv.attn_block(13) + kv.attn_block(14) + kv.attn_block(15)
    assert same(got, want_attn)
    assert same(kv.state_block(16), want_state)
    assert same(kv.attn_block(3), [t[3] for t in kv.attn.values()])  # untouched: zeros


def test_skip_positions_of_a_load_are_not_written(kv: SmallKV,
                                                  engine: ThreadedTransferEngine) -> None:
    pos0, pos1 = kv.attn_block(6), kv.attn_block(7)
    engine.save(Job(1, "r", [TransferOp(0, 2, [6, 7])], chunk=0))
    run(engine)
    kv.wipe(value=5.0)
    untouched = kv.attn_block(0)
    # position 0 of the chunk into block 20 only, position 1 into block 21 only
    engine.load(Job(2, "r", [TransferOp(0, 2, [20, SKIP]), TransferOp(0, 2, [SKIP, 21])]))
    (c,) = run(engine).values()
    assert c.ok and c.nbytes == 2 * kv.layout.groups[0].bytes_per_block
    assert same(kv.attn_block(20), pos0) and same(kv.attn_block(21), pos1)
    assert all(same(kv.attn_block(b), untouched) for b in range(20))  # nothing else written


def test_a_copy_that_raises_is_a_failed_job_and_the_others_still_run(
        kv: SmallKV, engine: ThreadedTransferEngine) -> None:
    engine.save(Job(1, "r", [TransferOp(0, 10**6, [1, 2])], chunk=0))  # no such slot
    engine.save(Job(2, "r", [TransferOp(0, 0, [1, 2])], chunk=0))
    engine.load(Job(3, "r", [TransferOp(0, -5, [1, 2])]))
    done = run(engine)
    assert not done[1].ok and "IndexError" in done[1].error
    assert done[2].ok and done[2].error == ""
    assert not done[3].ok and done[3].kind == "load"


def test_a_fence_waits_for_the_saves_it_names(kv: SmallKV,
                                              engine: ThreadedTransferEngine) -> None:
    jobs = [Job(i, "r", [TransferOp(0, i, [2 * i, 2 * i + 1])], chunk=i) for i in range(8)]
    for j in jobs:
        engine.save(j)
    engine.fence([j.job_id for j in jobs[:4]] + [99])  # unknown ids are fine
    # on CPU the next forward runs on this thread: the fenced saves have finished
    done = {c.job_id: c for c in engine.poll()}
    assert set(range(4)) <= set(done) and all(c.ok for c in done.values())
    done.update(run(engine))
    assert sorted(done) == list(range(8))


def test_the_cpu_engine_wait_gives_a_load_in_flight_the_gil_until_it_finishes(
        kv: SmallKV) -> None:
    """An engine whose request waits for a load spins through empty steps, each a collect:
    on the host those steps held the GIL the copying thread needed (a 3-chunk restore took
    270 ms of copying instead of 12, tools/ttft_load_wait_cpu.py). An idle step's collect
    now first waits (GIL released) up to ``idle_wait_s`` in :meth:`TransferEngine.wait`: the
    load's completion is there for the poll that follows. The copy here is slowed (its
    thread sleeps), so a poll without the wait finds it still running."""
    worker = OffloadWorker(CONFIG, kv.layout, CHUNK_TOKENS)
    engine = ThreadedTransferEngine(worker.mover)
    try:
        assert worker.idle_wait_s == IDLE_WAIT_S > 0  # an idle step's collect waits
        real_load = worker.mover.load_op

        def slow_load(op: TransferOp) -> int:
            time.sleep(0.05)
            return real_load(op)

        engine.save(Job(1, "r", [TransferOp(0, 0, [3, 4])], chunk=0))
        engine.drain()
        assert [c.ok for c in engine.poll()] == [True]
        worker.mover.load_op = slow_load  # type: ignore[method-assign]
        engine.load(Job(2, "r", [TransferOp(0, 0, [12, 13])]))
        assert engine.poll() == []  # without the wait: still copying
        t0 = time.perf_counter()
        engine.wait(1.0)
        (c,) = engine.poll()
        assert c.ok and c.job_id == 2 and time.perf_counter() - t0 < 0.9  # it, not the bound
        t0 = time.perf_counter()
        engine.wait(1.0)  # nothing in flight: returns at once
        assert time.perf_counter() - t0 < 0.05
    finally:
        engine.close()
        worker.close()

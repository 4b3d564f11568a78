"""The transfer times the engines report, and the link estimate the planner builds from them.

Contract (kvtier.transfer.Completion): a job's ``seconds`` is its wall time from its first
copy's start to its last copy's end on one rank, all its groups and batches included; its
``busy_seconds`` is its share of that rank's link busy time, so the bytes of any set of jobs
over their summed ``busy_seconds`` never exceed the rate the link achieved. The planner's
``link_gbps`` is built from those sums (OffloadWorker -> WorkerReport -> CostEstimates).

The GPU engine runs on :class:`kvtier.testing.link_runtime.LinkRuntime`: its events tell time
on a simulated clock and its copies take the time a link of ``GBPS`` would, so the engine's
own measurements can be compared with the link's true speed. The DMA path needs no kernels
(the kernel path is covered in tests/test_gpu_kernels.py, under the Triton interpreter).
"""

from __future__ import annotations

import time

import pytest

from _families import Family, blocks_per_chunk, drain, make_mover, materialize, stored_recipes
from kvtier import codec
from kvtier.config import KvtierConfig
from kvtier.gpu.engine import CudaTransferEngine
from kvtier.planner import CostEstimates
from kvtier.protocol import Job, StepPlan, TransferOp
from kvtier.testing.link_runtime import LinkRuntime
from kvtier.transfer import ChunkMover, ThreadedTransferEngine
from kvtier.worker import OffloadWorker

GBPS = 20.0
RECIPES = {r["name"]: r for r in stored_recipes()}
CFG = KvtierConfig(dram_size="64MiB", gpu_staging_size="8MiB")


def _family(name: str) -> Family:
    return materialize(RECIPES[name], "cpu")


def _chunk_bytes(fam: Family) -> list[int]:
    _, bpc = blocks_per_chunk(fam.layout)
    return [codec.chunk_bytes(g, b) for g, b in zip(fam.layout.groups, bpc)]


def _ops(fam: Family, slots: range) -> list[TransferOp]:
    """One op per group per slot, on distinct blocks of each group."""
    _, bpc = blocks_per_chunk(fam.layout)
    return [TransferOp(g, s, list(range(s * b, (s + 1) * b)))
            for s in slots for g, b in enumerate(bpc)]


def _engine(fam: Family, batch_chunks: int, n_slots: int = 12
            ) -> tuple[CudaTransferEngine, ChunkMover, LinkRuntime]:
    chunk, bpc = blocks_per_chunk(fam.layout)
    mover = make_mover(fam.layout, chunk, bpc, n_slots, pin=False)
    rt = LinkRuntime(GBPS)
    eng = CudaTransferEngine(mover, CFG, mode="dma", runtime=rt,
                             batch_bytes=batch_chunks * max(_chunk_bytes(fam)))
    return eng, mover, rt


def _link_seconds(nbytes: int) -> float:
    return nbytes / (GBPS * 1e9)


@pytest.mark.parametrize("name", ["v032_flash_LBHNC", "v032_mamba_hybrid",
                                  "v032_sliding_window"])
def test_a_load_over_many_batches_and_groups_reports_its_whole_time(name: str) -> None:
    """8 chunks of every group in batches of 2 chunks: the job's seconds span all of them
    (each batch alone took a quarter of a group's time or less)."""
    fam = _family(name)
    eng, mover, rt = _engine(fam, batch_chunks=2)
    eng.tick()
    eng.load(Job(1, "r", _ops(fam, range(8))))
    c = drain(eng, {1})[1]
    assert c.ok and c.nbytes == 8 * sum(_chunk_bytes(fam)) == rt.copied
    assert c.seconds == pytest.approx(_link_seconds(c.nbytes), rel=1e-9)
    assert c.busy_seconds == pytest.approx(_link_seconds(c.nbytes), rel=1e-9)
    eng.close()
    mover.slab.close()


def test_saves_sharing_a_batch_split_its_time() -> None:
    """Four one-chunk saves in one batch: each waited the whole batch (its wall time), and
    their link shares add up to the batch's time once."""
    fam = _family("v032_flash_LBHNC")
    eng, mover, rt = _engine(fam, batch_chunks=8)
    eng.tick()
    for s in range(4):
        eng.save(Job(10 + s, f"r{s}", _ops(fam, range(s, s + 1)), chunk=s))
    got = drain(eng, {10, 11, 12, 13})
    batch = _link_seconds(rt.copied)
    assert all(c.ok and c.seconds == pytest.approx(batch, rel=1e-9) for c in got.values())
    assert sum(c.busy_seconds for c in got.values()) == pytest.approx(batch, rel=1e-9)
    eng.close()
    mover.slab.close()


def _worker(fam: Family, batch_chunks: int) -> tuple[OffloadWorker, list[LinkRuntime]]:
    chunk, _ = blocks_per_chunk(fam.layout)
    runtimes: list[LinkRuntime] = []

    def make(mover: ChunkMover) -> CudaTransferEngine:
        runtimes.append(LinkRuntime(GBPS))
        return CudaTransferEngine(mover, CFG, mode="dma", runtime=runtimes[-1],
                                  batch_bytes=batch_chunks * max(_chunk_bytes(fam)))
    return OffloadWorker(CFG, fam.layout, chunk, engine_factory=make), runtimes


@pytest.mark.parametrize("name", ["v032_flash_LBHNC", "v032_mamba_hybrid"])
def test_the_planners_link_estimate_is_the_links_speed(name: str) -> None:
    """Saves of 12 chunks, then steps of three loads of 4 chunks each (batches of 1 chunk),
    through the worker's report into the planner's estimate: it settles on the link's speed,
    never above it; so does the save direction's rate."""
    fam = _family(name)
    worker, runtimes = _worker(fam, batch_chunks=1)
    worker.begin_step(StepPlan(1))
    worker.end_step(StepPlan(1, saves=[Job(100 + s, f"s{s}", _ops(fam, range(s, s + 1)), s)
                                       for s in range(12)]))
    worker.drain()
    saved = worker.collect().report
    assert saved.bytes_stored == 12 * sum(_chunk_bytes(fam))
    assert saved.bytes_stored / saved.store_seconds / 1e9 == pytest.approx(GBPS, rel=1e-9)
    est = CostEstimates(link_gbps=1.0, prefill_seconds_per_token=1e-4, step_seconds=0.01)
    for step in range(2, 40):
        loads = [Job(1000 * step + i, f"r{i}", _ops(fam, range(4 * i, 4 * i + 4)))
                 for i in range(3)]
        worker.begin_step(StepPlan(step, loads=loads))
        worker.drain()
        rep = worker.collect().report
        assert rep.bytes_loaded == 12 * sum(_chunk_bytes(fam)), rep
        assert rep.bytes_loaded / rep.load_seconds / 1e9 <= GBPS * (1 + 1e-9)
        est.observe_transfer(rep.bytes_loaded, rep.load_seconds)
        assert est.link_gbps <= GBPS * (1 + 1e-9)
    assert est.link_gbps == pytest.approx(GBPS, rel=1e-3)
    assert runtimes[0].busy == pytest.approx(_link_seconds(runtimes[0].copied), rel=1e-9)
    worker.close()


def test_cpu_engine_jobs_never_count_a_second_twice() -> None:
    """The CPU engine copies on one thread: its loads' busy seconds add up to no more than the
    wall time they took together, and each is its own wall time."""
    fam = _family("v032_mla_auto")
    chunk, bpc = blocks_per_chunk(fam.layout)
    mover = make_mover(fam.layout, chunk, bpc, 12, pin=False)
    eng = ThreadedTransferEngine(mover)
    t0 = time.perf_counter()
    for i in range(6):
        eng.load(Job(i, f"r{i}", _ops(fam, range(2 * i, 2 * i + 2))))
    got = drain(eng, set(range(6)))
    wall = time.perf_counter() - t0
    assert all(c.ok and c.nbytes == 2 * sum(_chunk_bytes(fam)) for c in got.values())
    assert all(c.busy_seconds == c.seconds > 0 for c in got.values())
    assert sum(c.busy_seconds for c in got.values()) <= wall
    eng.close()
    mover.slab.close()

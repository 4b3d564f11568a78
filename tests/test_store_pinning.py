"""A worker whose KV cache is on a GPU, attached to the node-wide store (issue 18): its pool
mapping is pinned as a private slab is, and a restarted store's pool is mapped and pinned
off the step path while the engine steps on, failing the jobs of plans whose pool the slab
does not map yet. On CPU: a real store process, :class:`~kvtier.testing.pinning.
RecordingPinner` for CUDA's registrations, and the GPU engine on
:class:`~kvtier.testing.host_runtime.HostRuntime` (its DMA path: memmove of the addresses
it computed from the slab)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from _store import StoreProcess, StoreTier, restart, restore_equal
from _tier import prompt
from kvtier.config import KvtierConfig
from kvtier.gpu.engine import CudaTransferEngine
from kvtier.protocol import WorkerReport
from kvtier.slab import HostSlab, pin_ranges
from kvtier.testing.host_runtime import HostRuntime
from kvtier.testing.pinning import RecordingPinner
from kvtier.transfer import ChunkMover
from kvtier.vllm.store_link import loads_wait_for_epoch, mapped_epoch

PIN_STEP = 64 * 1024
# the GPU engine's checksums run in Triton kernels (interpreted on CPU only in a process of
# their own, tests/test_gpu_interpreted.py): these engines move bytes unverified
SETTINGS: dict[str, Any] = {"pin_step_size": PIN_STEP, "verify_checksums": False}


class AddressRuntime(HostRuntime):
    """:class:`HostRuntime` that keeps every descriptor it copies: (dst, src, bytes). With
    ``slab`` set, a batch with a descriptor that has no end in the slab's memory fails
    before it copies (an address of a pool the slab left: a failed job, not a crash)."""

    def __init__(self) -> None:
        self.copied: list[tuple[int, int, int]] = []
        self.slab: HostSlab | None = None

    def copy(self, desc: Any, stream: Any) -> None:
        got = [(int(d), int(s), int(n)) for d, s, n in zip(*desc)]
        self.copied += got
        if self.slab is not None and not all(slab_end(self.slab, *c) for c in got):
            raise RuntimeError("a copy outside the slab's memory")
        super().copy(desc, stream)


def gpu_tier(url: str, pinner: RecordingPinner, runtime: AddressRuntime,
             seed: int = 1) -> StoreTier:
    def engine(mover: ChunkMover) -> CudaTransferEngine:
        return CudaTransferEngine(mover, KvtierConfig(dram_size="1MiB"), mode="dma",
                                  runtime=runtime)

    t = StoreTier(url, seed=seed, pinner=pinner, engine_factory=engine, config=SETTINGS,
                  retry_seconds=0.1, timeout=1.0)
    runtime.slab = t.worker.slab  # the same object wherever its memory lies
    return t


def pool_range(t: StoreTier) -> tuple[int, int]:
    """[start, end) of the store's pool as the worker maps it (its arena is the slab)."""
    att = t.index.attachment
    assert att is not None
    start = t.worker.slab.buffer.data_ptr() - att.arena_offset
    return start, start + att.pool_bytes


def expected_pins(slab: HostSlab) -> dict[int, int]:
    base = slab.buffer.data_ptr()
    return {base + off: n for off, n in pin_ranges(slab.layout, PIN_STEP)}


def assert_pinned_inside_pool(t: StoreTier, pinner: RecordingPinner) -> None:
    want = expected_pins(t.worker.slab)
    assert pinner.pinned == want and len(want) > 2
    lo, hi = pool_range(t)
    assert all(lo <= p and p + n <= hi for p, n in pinner.pinned.items())
    assert t.worker.slab.registered == sorted(want)


def steps_until_moved(t: StoreTier, epoch: int, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while t.mapping.epoch != epoch and time.monotonic() < deadline:
        t.step()
        time.sleep(0.01)
    assert t.mapping.epoch == epoch and t.worker.refusing is None, t.mapping.why


@pytest.fixture
def store(tmp_path):  # type: ignore[no-untyped-def]
    s = StoreProcess(tmp_path).start()
    yield s
    s.stop()


def test_a_pinned_worker_registers_its_slab_inside_the_pool_and_copies_there(
        store: StoreProcess) -> None:
    pinner, rt = RecordingPinner(), AddressRuntime()
    a = gpu_tier(store.url, pinner, rt)
    b = StoreTier(store.url, seed=9, config=SETTINGS)
    try:
        assert a.mapping.attached_at_start and a.mapping.timing.pin_seconds > 0
        assert_pinned_inside_pool(a, pinner)
        calls = pinner.calls
        a.prefill("p", prompt(1))  # the first plan names the pool mapped: no second pinning
        assert pinner.calls == calls and a.mapping.moves == 0 and a.mapping.epoch == 1
        assert_pinned_inside_pool(a, pinner)
        slab = a.worker.slab
        assert rt.copied and all(slab_end(slab, d, s, n) for d, s, n in rt.copied)
        restore_equal(b, a, "p", prompt(1))
    finally:
        a.close()
        b.close()
    assert pinner.pinned == {}  # unpinned at close


def slab_end(slab: HostSlab, dst: int, src: int, n: int) -> bool:
    """One end of the copy lies in the slab (the other is the KV cache): no staging copy."""
    base, size = slab.buffer.data_ptr(), slab.buffer.numel()
    return any(base <= p and p + n <= base + size for p in (dst, src))


def test_a_restarted_store_is_pinned_anew_and_the_engine_copies_to_the_new_pool(
        store: StoreProcess) -> None:
    pinner, rt = RecordingPinner(), AddressRuntime()
    a = gpu_tier(store.url, pinner, rt)
    b = None
    try:
        a.prefill("p", prompt(1))
        old = dict(pinner.pinned)
        calls = pinner.calls
        restart(store, a)
        with torch.inference_mode():  # as vLLM runs the worker's hooks
            steps_until_moved(a, a.index.epoch)
        assert a.mapping.moves == 1
        assert set(old) <= set(pinner.released)  # the old pool's pins were given back
        assert pinner.calls == calls + len(old)  # and the new pool pinned once, whole
        assert_pinned_inside_pool(a, pinner)
        lo, hi = pool_range(a)  # the new pool is mapped elsewhere: a stale address shows
        assert not any(lo <= p < hi for p in old)
        assert "kvtier-store-pin" in pinner.threads  # not pinned on the step path
        rt.copied.clear()
        a.prefill("t", prompt(4))
        assert a.sched.stats.saves_committed >= 3
        slab = a.worker.slab
        assert rt.copied and all(slab_end(slab, d, s, n) for d, s, n in rt.copied)
        b = StoreTier(store.url, seed=9, config=SETTINGS)
        restore_equal(b, a, "t", prompt(4))  # bit-exact from the new pool
        a.sched.check_drained()
    finally:
        a.close()
        if b is not None:
            b.close()


def test_plans_of_a_pool_not_yet_pinned_fail_their_jobs_and_never_touch_the_old_pool(
        store: StoreProcess) -> None:
    pinner, rt = RecordingPinner(), AddressRuntime()
    a = gpu_tier(store.url, pinner, rt)
    b = None
    try:
        a.prefill("p", prompt(1))
        restart(store, a)
        pinner.gate.clear()  # the new pool's pinning takes long (34.6 s for 64 GiB)
        b = StoreTier(store.url, seed=9, config=SETTINGS)  # fills the new pool
        b.prefill("t", prompt(4))
        assert b.sched.stats.saves_committed >= 3
        rt.copied.clear()
        t0 = time.monotonic()
        n, res = a.restore("q", prompt(4))  # a hit in the new pool, promised to a
        assert n == 96
        assert "q" in res.failed_loads  # recompute: the slab maps no pool of this epoch
        assert a.mapping.moving and a.worker.refusing is not None
        a.sched.request_finished("q")
        a.prefill("s", prompt(5))  # saves of the epoch fail (aborted), steps go on
        assert a.sched.stats.saves_committed == 3  # p's, before the restart
        assert time.monotonic() - t0 < 5.0  # no step waited for the pinning
        assert rt.copied == [] and a.worker.refused > 0  # nothing reached the engine
        pinner.gate.set()
        steps_until_moved(a, a.index.epoch)
        assert_pinned_inside_pool(a, pinner)
        a.sched.request_finished("s")
        restore_equal(a, b, "u", prompt(4))  # once pinned, the same hit restores
        a.sched.check_drained()
    finally:
        pinner.gate.set()
        a.close()
        if b is not None:
            b.close()


def test_where_loads_must_not_fail_no_hit_is_promised_until_every_worker_maps_the_epoch(
        store: StoreProcess) -> None:
    """vLLM 0.25.1 with several KV-cache groups stops the engine on a promised load that
    fails (kvtier.vllm.failed_loads): there the scheduler half promises no store hit in an
    epoch the workers have not reported mapping, so a restarted store's pinning window
    costs hits, never the engine. The report is the least epoch over ranks."""
    pinner, rt = RecordingPinner(), AddressRuntime()
    a = gpu_tier(store.url, pinner, rt)
    try:
        assert loads_wait_for_epoch(a.index, None)  # before the first worker report
        a.step()
        assert mapped_epoch(a.mapping, a.worker.refusing) == a.index.epoch == 1
        assert not loads_wait_for_epoch(a.index, 1)
        restart(store, a)
        pinner.gate.clear()  # the new pool's pinning takes long
        a.step()
        assert a.mapping.moving and a.worker.refusing is not None
        assert mapped_epoch(a.mapping, a.worker.refusing) == -1
        assert loads_wait_for_epoch(a.index, -1) and loads_wait_for_epoch(a.index, 1)
        pinner.gate.set()
        steps_until_moved(a, a.index.epoch)
        assert mapped_epoch(a.mapping, a.worker.refusing) == a.index.epoch == 2
        assert not loads_wait_for_epoch(a.index, 2)
        assert not loads_wait_for_epoch(object(), None)  # no store: never waits
        a.sched.check_drained()
    finally:
        a.close()
    # two ranks' reports: the least epoch; a rank that reports none changes nothing
    both = WorkerReport(store_epoch=2).add(WorkerReport(store_epoch=-1))
    assert both.store_epoch == -1
    assert WorkerReport().add(WorkerReport(store_epoch=2)).add(WorkerReport()).store_epoch == 2

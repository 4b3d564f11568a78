"""Verified restores in the GPU engine (docs/notes/checksums.md §4.2), on CPU tensors through
:class:`~kvtier.testing.host_runtime.HostRuntime` with the interpreted kernels: the device sums
stored at save are the reference checksums of the slots, a flipped byte fails the load on both
paths with the corrupt slot named, SKIP positions are not compared, and the DMA path's
checksum pass is one of the save's read events (what a fence waits for).

Runs in its own process with ``TRITON_INTERPRET=1`` (``tests/test_gpu_interpreted.py``)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from _families import (
    Family,
    blocks_per_chunk,
    check_engine,
    drain,
    make_mover,
    materialize,
    stored_recipes,
)
from _kvcheck import group_storages, poison
from kvtier import codec
from kvtier.config import KvtierConfig
from kvtier.gpu import kernels
from kvtier.gpu.engine import CudaTransferEngine
from kvtier.protocol import SKIP, Job, JobKind, TransferOp
from kvtier.testing.host_runtime import HostEvent, HostRuntime, HostStream
from kvtier.testing.stream_races import RaceCheckingRuntime, StreamRace, traced_kernels
from kvtier.transfer import ChunkMover

if not isinstance(kernels._move_kernel, InterpretedFunction):
    pytest.fail("kvtier.gpu.kernels was imported without TRITON_INTERPRET=1 in this process; "
                "run this file through tests/test_gpu_interpreted.py", pytrace=False)

RECIPES = {r["name"]: r for r in stored_recipes()}
NAMES = ["v032_flash_BHLNC", "v032_mamba_hybrid", "v032_sliding_window", "v032_mla_auto"]
CONFIG = KvtierConfig(dram_size="1GiB", gpu_staging_size="8MiB")


def _family(name: str) -> Family:
    return materialize(RECIPES[name], "cpu")


@pytest.mark.parametrize("mode", ["dma", "kernel"])
@pytest.mark.parametrize("name", NAMES)
def test_device_sums_are_the_reference_checksums_and_loads_verify(name: str, mode: str) -> None:
    fam = _family(name)

    def make(mover: ChunkMover) -> CudaTransferEngine:
        assert mover.verify
        return CudaTransferEngine(mover, CONFIG, mode=mode, max_programs=4,
                                  runtime=HostRuntime())
    moved = check_engine(fam, make, seed=5, n_chunks=3, verify=True)
    assert moved["saved"] > 0 and moved["loaded"] > 0


def _engine(mode: str, verify: bool = True, runtime: Any = None
            ) -> tuple[Family, ChunkMover, CudaTransferEngine, int]:
    fam = _family("v032_flash_BHLNC")
    chunk, bpc = blocks_per_chunk(fam.layout)
    mover = make_mover(fam.layout, chunk, bpc, 4, pin=False, verify=verify)
    eng = CudaTransferEngine(mover, CONFIG, mode=mode, max_programs=4,
                             runtime=runtime or HostRuntime())
    assert eng.paths()[0] == mode
    return fam, mover, eng, bpc[0]


def _position_offset(fam: Family, position: int) -> int:
    """Where block position ``position`` of a group-0 chunk starts in its slot."""
    return fam.layout.groups[0].segments[0].run * position


@pytest.mark.parametrize("mode", ["dma", "kernel"])
def test_a_flipped_byte_fails_the_load_and_names_the_slot(mode: str) -> None:
    fam, mover, eng, b = _engine(mode)
    src = list(range(b))
    eng.save(Job(1, "a", [TransferOp(0, 2, src, seed=77)]))
    assert drain(eng, {1})[1].ok
    cls = mover.slot_class[0]
    mover.slab.view(cls, 2)[_position_offset(fam, 1) + 3] ^= 0x10
    poison(group_storages(fam.layout.groups[0]), 2)
    eng.tick()
    dst = list(range(b, 2 * b))
    skip_flipped = [dst[0], SKIP, *dst[2:]]
    eng.load(Job(2, "r", [TransferOp(0, 2, dst, seed=77)]))
    eng.load(Job(3, "s", [TransferOp(0, 2, skip_flipped, seed=77)]))
    eng.load(Job(4, "t", [TransferOp(0, 2, dst, seed=78)]))  # another chunk's seed
    got = drain(eng, {2, 3, 4})
    assert not got[2].ok and "checksum mismatch" in got[2].error
    assert [(m.slot_class, m.slot, m.blocks) for m in got[2].corrupt] == [(cls, 2, (1,))]
    assert got[3].ok and not got[3].corrupt, "a flip in a skipped position failed the load"
    assert not got[4].ok and got[4].corrupt[0].blocks == tuple(range(b))
    eng.close()
    mover.slab.close()


@pytest.mark.parametrize("mode", ["dma", "kernel"])
def test_without_verification_the_same_flip_is_a_successful_load(mode: str) -> None:
    """The control: the engine reports the flip only because it verifies."""
    fam, mover, eng, b = _engine(mode, verify=False)
    eng.save(Job(1, "a", [TransferOp(0, 2, list(range(b)), seed=77)]))
    assert drain(eng, {1})[1].ok
    mover.slab.view(mover.slot_class[0], 2)[_position_offset(fam, 1) + 3] ^= 0x10
    eng.tick()
    eng.load(Job(2, "r", [TransferOp(0, 2, list(range(b, 2 * b)), seed=77)]))
    assert drain(eng, {2})[2].ok
    eng.close()
    mover.slab.close()


def test_a_verify_job_runs_on_the_host_and_writes_nothing() -> None:
    fam, mover, eng, b = _engine("dma")
    eng.save(Job(1, "a", [TransferOp(0, 0, list(range(b)), seed=5)]))
    eng.save(Job(2, "a", [TransferOp(0, 1, list(range(b, 2 * b)), seed=6)]))
    drain(eng, {1, 2})
    mover.slab.view(mover.slot_class[0], 1)[0] ^= 1
    before = [s.clone() for s in group_storages(fam.layout.groups[0])]
    eng.verify(Job(3, "v", [TransferOp(0, 0, [SKIP] * b, seed=5),
                            TransferOp(0, 1, [SKIP] * b, seed=6)]))
    got = drain(eng, {3})[3]
    assert got.kind == JobKind.VERIFY and not got.ok
    assert [(m.slot, m.blocks) for m in got.corrupt] == [(1, (0,))]
    assert all(torch.equal(a, c) for a, c in zip(group_storages(fam.layout.groups[0]), before))
    eng.close()
    mover.slab.close()


# -- the DMA fence ----------------------------------------------------------------------------
class _Stream(HostStream):
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class _Event(HostEvent):
    def __init__(self) -> None:
        self.on: Any = None

    def record(self, stream: Any = None) -> None:
        self.on = stream


class _TaggedRuntime(HostRuntime):
    """A HostRuntime whose events remember the stream they were recorded on, and whose
    compute stream remembers what it was made to wait for."""

    def __init__(self) -> None:
        self.compute = _Stream("compute")
        self._n = 0

    def stream(self, high_priority: bool = False) -> Any:
        self._n += 1
        return _Stream(f"side{self._n}")

    def event(self, timing: bool = False) -> Any:
        return _Event()

    def current(self) -> Any:
        return self.compute


@pytest.mark.parametrize("verify", [True, False])
def test_a_fence_on_a_dma_save_waits_for_its_checksum_pass(verify: bool) -> None:
    rt = _TaggedRuntime()
    _fam, mover, eng, b = _engine("dma", verify=verify, runtime=rt)
    eng.save(Job(1, "a", [TransferOp(0, 0, list(range(b)), seed=5)]))
    assert eng.fence([1]) == 0
    streams = {ev.on.name for ev in rt.compute.waited if isinstance(ev, _Event)
               and ev.on is not None}
    assert eng.save_copy.name in streams  # the DMA's reads
    # the checksum pass reads the blocks on the save-kernel stream: fenced too
    assert (eng.save_kernel.name in streams) is verify
    drain(eng, {1})
    assert codec.chunk_bytes(_fam.layout.groups[0], b) > 0
    eng.close()
    mover.slab.close()


# --- stream order (kvtier.testing.stream_races) ---------------------------------------------
# On an H200 the bench's kimi_linear loads failed verification at random slots on both paths
# while the bytes were right: the per-batch sums buffer was allocated and zero-filled on the
# caller's compute stream and written by the kernel on a side stream, with no event between
# the two, so the fill could land after some partials were written (zeroing them). HostRuntime
# runs everything at once and cannot show that; RaceCheckingRuntime does.


@pytest.mark.parametrize("mode", ["dma", "kernel"])
@pytest.mark.parametrize("name", ["v032_flash_BHLNC", "v032_mamba_hybrid"])
def test_verified_round_trips_are_ordered_on_the_device_streams(name: str, mode: str) -> None:
    fam = _family(name)
    rt = RaceCheckingRuntime()

    def make(mover: ChunkMover) -> CudaTransferEngine:
        eng = CudaTransferEngine(mover, CONFIG, mode=mode, max_programs=4, runtime=rt)
        rt.watch(eng)
        return eng
    with rt.tracing(), traced_kernels(rt):
        moved = check_engine(fam, make, seed=3, n_chunks=3, verify=True)
    assert moved["saved"] > 0 and moved["loaded"] > 0
    assert rt.races == []
    assert rt.accesses > 0


def test_the_race_checker_sees_a_copy_read_before_the_write_it_needs() -> None:
    rt = RaceCheckingRuntime()
    buf = torch.zeros(64, dtype=torch.uint8)
    a, b = rt.stream(), rt.stream()
    desc = (np.array([buf.data_ptr() + 32]), np.array([buf.data_ptr()]), np.array([16]))
    rt.copy(desc, a)  # writes [32, 48)
    wrote = rt.event()
    wrote.record(a)
    back = (np.array([buf.data_ptr()]), np.array([buf.data_ptr() + 40]), np.array([8]))
    with pytest.raises(StreamRace, match="dma on side2 reads"):
        rt.copy(back, b)  # reads [40, 48) with no event after the write
    b.wait_event(wrote)
    rt.copy(back, b)
    assert len(rt.races) == 1


@pytest.mark.parametrize("family", ["kimi_linear", "mha"])
def test_the_bench_warm_up_loads_only_what_was_saved(family: str) -> None:
    """The transfer bench's warm-up (kvtier.bench.transfer.timing.warm) loaded slots that the
    same step's saves were still writing."""
    from kvtier.bench.transfer.cases import KIB, MIB, build_cell, cache_case
    from kvtier.bench.transfer.timing import warm

    span = 2 * MIB
    geo = cache_case(family, 32 * KIB, span, smoke=True)
    host = torch.empty(2 * span + 128 * MIB, dtype=torch.uint8)
    cell = build_cell(geo, torch.device("cpu"), host, span, seed=0, verify=True)
    rt = RaceCheckingRuntime()
    eng = CudaTransferEngine(cell.mover, KvtierConfig(dram_size="1GiB",
                                                      gpu_staging_size="2MiB"),
                             mode="kernel", runtime=rt)
    rt.watch(eng, *cell.mover.slab._sums)
    with rt.tracing(), traced_kernels(rt):
        warm(eng, cell, None, lambda: None)
    assert rt.races == []
    eng.close()


# --- kernel-path batches on alternating streams (kvtier.gpu.engine.KERNEL_STREAMS) ----------


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("name", ["v032_flash_BHLNC", "v032_mla_auto"])
def test_kernel_batches_alternate_streams_bit_exact_and_race_free(name: str,
                                                                  verify: bool) -> None:
    """Batches of one chunk each (so one job spans several batches and the staging ring
    wraps): consecutive batches of a direction run their gather or scatter on two different
    kernel streams, the bytes are the reference codec's both ways, and no access on one
    stream is unordered against another (staging reuse, ids, sums)."""
    fam = _family(name)
    rt = RaceCheckingRuntime()
    launches: list[str] = []
    real_launch = kernels.TileTable.launch

    def spy(self: Any, *args: Any, **kw: Any) -> None:
        launches.append(rt.current().name)
        real_launch(self, *args, **kw)

    def make(mover: ChunkMover) -> CudaTransferEngine:
        cb = max(mover.geometry.chunk_bytes(g) for g in range(len(mover.layout.groups)))
        cfg = KvtierConfig(dram_size="1GiB", gpu_staging_size=f"{8 * cb}B")
        eng = CudaTransferEngine(mover, cfg, mode="kernel", batch_bytes=cb, max_programs=4,
                                 kernel_streams=2, runtime=rt)
        rt.watch(eng)
        return eng
    kernels.TileTable.launch = spy  # type: ignore[method-assign]
    try:
        with rt.tracing(), traced_kernels(rt):
            moved = check_engine(fam, make, seed=5, n_chunks=4, verify=verify)
    finally:
        kernels.TileTable.launch = real_launch  # type: ignore[method-assign]
    assert moved["saved"] > 0 and moved["loaded"] > 0
    assert rt.races == [] and rt.accesses > 0
    assert len(launches) >= 8  # 4 saves and 4 loads, a batch each
    # two streams per direction, taken in turn: no two consecutive launches share one
    assert len(set(launches)) == 4
    assert all(a != b for a, b in itertools.pairwise(launches))


def test_one_kernel_stream_is_the_previous_engine() -> None:
    fam = _family("v032_flash_BHLNC")
    rt = RaceCheckingRuntime()

    def make(mover: ChunkMover) -> CudaTransferEngine:
        cb = mover.geometry.chunk_bytes(0)
        cfg = KvtierConfig(dram_size="1GiB", gpu_staging_size=f"{8 * cb}B")
        eng = CudaTransferEngine(mover, cfg, mode="kernel", batch_bytes=cb, max_programs=4,
                                 kernel_streams=1, runtime=rt)
        assert eng._kernels["save"] == [eng.save_kernel]
        rt.watch(eng)
        return eng
    with rt.tracing(), traced_kernels(rt):
        moved = check_engine(fam, make, seed=5, n_chunks=4)
    assert moved["loaded"] > 0 and rt.races == []
    chunk, bpc = blocks_per_chunk(fam.layout)
    mover = make_mover(fam.layout, chunk, bpc, 2, pin=False)
    with pytest.raises(ValueError, match="kernel_streams must be at least 1"):
        CudaTransferEngine(mover, CONFIG, kernel_streams=0, runtime=HostRuntime())
    mover.slab.close()


@pytest.mark.parametrize("mode,verify,launches", [("kernel", True, 2), ("kernel", False, 2),
                                                  ("dma", True, 2), ("dma", False, 0)])
def test_warm_up_launches_each_variant_and_moves_nothing(mode: str, verify: bool,
                                                         launches: int) -> None:
    """The start-up warm-up: one launch per direction and kernel stream of exactly the
    variants the engine's batches launch (a DMA batch without checksums launches none);
    the cache, the staging buffer and the slab are byte for byte as before; a save and a
    load after it are exact; and it refuses to run once jobs exist."""
    fam, mover, eng, b = _engine(mode, verify=verify)
    storages = group_storages(fam.layout.groups[0])
    for i, t in enumerate(storages):
        t.view(torch.uint8).copy_(torch.randint(0, 256, (t.view(torch.uint8).numel(),),
                                                dtype=torch.uint8,
                                                generator=torch.Generator().manual_seed(i)))
    eng.stage.copy_(torch.randint(0, 256, (eng.stage.numel(),), dtype=torch.uint8))
    slab = mover.slab.buffer
    slab.copy_(torch.randint(0, 256, (slab.numel(),), dtype=torch.uint8))
    before = ([t.clone() for t in storages], eng.stage.clone(), slab.clone())
    kinds: list[bool] = []
    real_launch = kernels.TileTable.launch

    def launch(self: Any, *a: Any, **kw: Any) -> None:
        kinds.append(kw.get("sums") is not None)
        real_launch(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels.TileTable, "launch", launch)
        assert eng.warm_up() == launches
    assert len(kinds) == launches and all(k == verify for k in kinds)
    assert all(torch.equal(t, o) for t, o in zip(storages, before[0]))
    assert torch.equal(eng.stage, before[1]) and torch.equal(slab, before[2])
    src, dst = list(range(b)), list(range(b, 2 * b))
    eng.save(Job(1, "a", [TransferOp(0, 2, src, seed=9)]))
    assert drain(eng, {1})[1].ok
    with pytest.raises(RuntimeError, match="warm_up after jobs"):
        eng.save(Job(2, "b", [TransferOp(0, 1, src, seed=9)]))
        eng.warm_up()
    drain(eng, {2})
    eng.tick()
    eng.load(Job(3, "r", [TransferOp(0, 2, dst, seed=9)]))
    assert drain(eng, {3})[3].ok
    eng.save(Job(4, "c", [TransferOp(0, 3, dst, seed=9)]))  # the restored blocks, saved again
    assert drain(eng, {4})[4].ok
    cls = mover.slot_class[0]
    assert torch.equal(mover.slab.view(cls, 3), mover.slab.view(cls, 2))
    eng.close()
    mover.slab.close()

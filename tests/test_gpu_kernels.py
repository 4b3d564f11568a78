"""The GPU data path on CPU: Triton gather/scatter (``TRITON_INTERPRET=1``), the DMA
descriptors (run with memmove) and the whole :class:`CudaTransferEngine` on
:class:`HostRuntime`, bit-exact against the reference codec on every layout family of
docs/design.md §2.2 (``tests/_families.py``), with every byte outside the listed blocks poisoned
and checked.

Runs in its own process with ``TRITON_INTERPRET=1`` and no CUDA device visible
(``tests/test_gpu_interpreted.py`` starts it; tests/conftest.py leaves this file out of any
run without the variable): the variable decides, at import, whether Triton compiles or
interprets the kernel, so setting it here would hand the interpreted kernel to every CUDA test
of the same run.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python -m pytest tests/test_gpu_kernels.py
"""

from __future__ import annotations

import random
from collections.abc import Callable
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
from _kvcheck import (
    byte_view,
    check_group,
    expected_block,
    group_storages,
    poison,
    storage_bytes,
)
from kvtier import codec
from kvtier.config import KvtierConfig
from kvtier.gpu import kernels
from kvtier.gpu.dma import (
    SegmentTable,
    merge_adjacent,
    piece_descriptors,
    run_on_host,
)
from kvtier.gpu.engine import CudaTransferEngine
from kvtier.layout import GroupKind, GroupLayout
from kvtier.protocol import SKIP, Job, TransferOp
from kvtier.testing.host_runtime import FailingCopyRuntime, HostRuntime
from kvtier.testing.link_runtime import LinkRuntime
from kvtier.transfer import ChunkMover

if not isinstance(kernels._move_kernel, InterpretedFunction):
    pytest.fail("kvtier.gpu.kernels was imported without TRITON_INTERPRET=1 in this process; "
                "run this file through tests/test_gpu_interpreted.py", pytrace=False)

RECIPES = stored_recipes()
NAMES = [r["name"] for r in RECIPES]
BY_NAME = {r["name"]: r for r in RECIPES}


def _family(name: str) -> Family:
    return materialize(BY_NAME[name], "cpu")


def test_recipes_are_what_vllm_builds() -> None:
    pytest.importorskip("vllm")
    from _families import live_recipes

    live = live_recipes()
    assert [r["name"] for r in live] == NAMES
    for got, want in zip(live, RECIPES):
        assert got == want, f"{want['name']}: tests/data/kv_families.json is stale; " \
                            "regenerate it with `python tests/_families.py`"


@pytest.mark.parametrize("name", NAMES)
def test_recipe_moves_vllms_block_bytes(name: str) -> None:
    """The materialized family is what vLLM registered: the reference codec on it moves
    exactly vLLM's block bytes (the check the layout tests make)."""
    fam = _family(name)
    for g, group in enumerate(fam.layout.groups):
        check_group(group, fam.addressers[g], seed=g, count=6)


# --- one batch through the kernel or the descriptors, against the reference codec ----------

Mover = Callable[[GroupLayout, int, np.ndarray, torch.Tensor, int, bool], None]


def _kernel_mover(tile: int, programs: int) -> Mover:
    def move(group: GroupLayout, bpc: int, ids: np.ndarray, buf: torch.Tensor, off: int,
             to_buf: bool) -> None:
        t = kernels.TileTable.build(group, bpc, tile=tile)
        t.launch(buf, off, torch.as_tensor(ids.ravel()), to_buf, max_programs=programs)
    return move


def _dma_mover(group: GroupLayout, bpc: int, ids: np.ndarray, buf: torch.Tensor, off: int,
               to_buf: bool) -> None:
    table = SegmentTable.of(group, bpc)
    # Chunk c's "slot" is its place in the buffer; every other chunk is reversed so that
    # slots are not simply consecutive.
    slots = buf.data_ptr() + off + np.arange(len(ids), dtype=np.int64) * table.chunk_bytes
    run_on_host(merge_adjacent(piece_descriptors(table, ids, slots, to_buf)))


def _check_batch(group: GroupLayout, addressers: list[Any], move: Mover, bpc: int,
                 seed: int) -> None:
    rng = random.Random(seed)
    nb = group.num_blocks
    n = max(1, min(4, nb // bpc // 2))
    ids = np.array(rng.sample(range(nb), n * bpc), dtype=np.int64).reshape(n, bpc)
    storages = group_storages(group)
    poison(storages, seed)
    cb = codec.chunk_bytes(group, bpc)
    want = torch.empty(n * cb, dtype=torch.uint8)
    codec.gather(group, ids.ravel().tolist(), bpc, want)
    off = 256
    buf = torch.randint(0, 256, (off + n * cb + 300,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    outside = torch.cat([buf[:off], buf[off + n * cb:]]).clone()
    move(group, bpc, ids, buf, off, True)
    assert torch.equal(buf[off:off + n * cb], want), "gathered bytes differ from the codec's"
    assert torch.equal(torch.cat([buf[:off], buf[off + n * cb:]]), outside), \
        "the gather wrote outside its chunks"
    # Scatter into other blocks of a poisoned cache, one position of every chunk skipped.
    expected = {int(b): expected_block(addressers, int(b)) for b in ids.ravel()}
    dst = np.array(rng.sample(range(nb), n * bpc), dtype=np.int64).reshape(n, bpc)
    if bpc > 1:
        for c in range(n):
            dst[c, rng.randrange(bpc)] = SKIP
    before = poison(storages, seed + 1)
    masks = [torch.zeros_like(st) for st in storages]
    by_ptr = {st.data_ptr(): i for i, st in enumerate(storages)}
    move(group, bpc, dst, buf, off, False)
    for c in range(n):
        for j in range(bpc):
            b = int(dst[c, j])
            if b == SKIP:
                continue
            assert torch.equal(expected_block(addressers, b), expected[int(ids[c, j])]), \
                f"block {b} does not read back chunk {c} position {j}"
            for a in addressers:
                v = a(b)
                byte_view(v, masks[by_ptr[storage_bytes(v).data_ptr()]]).fill_(1)
    for st, p, m in zip(storages, before, masks):
        untouched = m == 0
        assert int((st[untouched] != p[untouched]).sum()) == 0, \
            "the scatter wrote outside the listed blocks"


MOVERS: dict[str, Mover] = {
    "kernel": _kernel_mover(16384, 64),
    "dma_descriptors": _dma_mover,
}
# Tiles smaller than a piece and fewer programs than work items: the persistent loop and
# tile offsets (slow in the interpreter, so on a few families with several piece sizes).
SMALL_TILES = ["v032_flash_BHLNC", "v032_fp8_scales_on_layer", "v032_mamba_hybrid",
               "v025_rocm_split_kv_fp8"]


@pytest.mark.parametrize("how", list(MOVERS))
@pytest.mark.parametrize("name", NAMES)
def test_batch_is_bit_exact(name: str, how: str) -> None:
    fam = _family(name)
    _, bpc = blocks_per_chunk(fam.layout)
    for g, group in enumerate(fam.layout.groups):
        _check_batch(group, fam.addressers[g], MOVERS[how], bpc[g], seed=7 * g + 1)


@pytest.mark.parametrize("name", SMALL_TILES)
def test_kernel_with_small_tiles_and_few_programs(name: str) -> None:
    fam = _family(name)
    _, bpc = blocks_per_chunk(fam.layout)
    for g, group in enumerate(fam.layout.groups):
        _check_batch(group, fam.addressers[g], _kernel_mover(1024, 3), bpc[g], seed=g)


def test_merge_adjacent_merges_only_continuing_runs() -> None:
    dst = np.array([100, 110, 120, 200, 205], dtype=np.int64)
    src = np.array([0, 10, 50, 60, 65], dtype=np.int64)
    size = np.array([10, 10, 10, 5, 5], dtype=np.int64)
    d, s, n = merge_adjacent((dst, src, size))
    assert d.tolist() == [100, 120, 200] and s.tolist() == [0, 50, 60]
    assert n.tolist() == [20, 10, 10]


def test_consecutive_blocks_of_a_block_outer_layout_become_one_descriptor() -> None:
    fam = _family("v032_flash_BLHNC")
    group = fam.layout.groups[0]
    assert len(group.segments) == 1
    table = SegmentTable.of(group, 4)
    ids = np.array([[8, 9, 10, 11]], dtype=np.int64)
    desc = merge_adjacent(piece_descriptors(table, ids, np.array([1 << 20]), True))
    assert len(desc[2]) == 1 and int(desc[2][0]) == table.chunk_bytes


# --- the engine on HostRuntime -------------------------------------------------------------

def _engine_factory(mode: str, fam: Family, **kw: Any) -> Callable[[ChunkMover], Any]:
    _, bpc = blocks_per_chunk(fam.layout)
    biggest = max(codec.chunk_bytes(g, b) for g, b in zip(fam.layout.groups, bpc))
    # Staging for about 3 batches per direction and batches of 2 chunks: ring wraps and
    # jobs that span batches happen.
    cfg = KvtierConfig(dram_size="1GiB", gpu_staging_size=f"{max(16 * biggest, 1 << 16)}B")

    def make(mover: ChunkMover) -> CudaTransferEngine:
        return CudaTransferEngine(mover, cfg, mode=mode, batch_bytes=2 * biggest,
                                  max_programs=4, runtime=HostRuntime(), **kw)
    return make


ENGINE_CASES = [(n, m) for n in NAMES for m in ("dma", "kernel")] + [
    (n, "auto") for n in ("v032_mamba_hybrid", "v032_fp8_scales_on_layer", "v032_mla_auto")]


@pytest.mark.parametrize(("name", "mode"), ENGINE_CASES)
def test_engine_round_trip(name: str, mode: str) -> None:
    fam = _family(name)
    seen: list[list[str]] = []

    def make(mover: ChunkMover) -> CudaTransferEngine:
        e = _engine_factory(mode, fam)(mover)
        seen.append(e.paths())
        return e
    moved = check_engine(fam, make, seed=3)
    assert moved["saved"] > 0 and moved["loaded"] > 0
    if mode != "auto":
        assert set(seen[0]) == {mode}


def _simple(n_chunks: int = 4) -> tuple[Family, ChunkMover, list[int]]:
    fam = _family("v032_mla_auto")
    chunk, bpc = blocks_per_chunk(fam.layout)
    return fam, make_mover(fam.layout, chunk, bpc, n_chunks, pin=False), bpc


@pytest.mark.parametrize("mode", ["dma", "kernel"])
def test_bad_jobs_fail_once_and_write_nothing(mode: str) -> None:
    fam, mover, bpc = _simple()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB", gpu_staging_size="8MiB"),
                             mode=mode, runtime=HostRuntime())
    nb = fam.layout.groups[0].num_blocks
    b = bpc[0]
    good = Job(1, "a", [TransferOp(0, 0, list(range(b)))])
    bad = [
        Job(2, "b", [TransferOp(0, 1, [nb, *list(range(1, b))])]),  # out of range
        Job(3, "c", [TransferOp(0, 1, [1] * b)]),  # duplicate ids
        Job(4, "d", [TransferOp(0, 1, [SKIP, *list(range(1, b))])]),  # SKIP in a save
        Job(5, "e", [TransferOp(0, 10**6, list(range(b)))]),  # slot out of range
        Job(6, "f", [TransferOp(0, 1, [1])]),  # too few ids
        Job(7, "g", [TransferOp(0, -1, list(range(b)))]),  # negative slot
        Job(8, "h", [TransferOp(3, 1, list(range(b)))]),  # no such group
        Job(9, "i", [TransferOp(0, 2, list(range(b))), TransferOp(0, 3, [-5] * b)]),
    ]
    slab_before = mover.slab.buffer.clone()
    for j in [good, *bad]:
        eng.save(j)
    got = drain(eng, {1, *(j.job_id for j in bad)})
    assert got[1].ok and got[1].nbytes == codec.chunk_bytes(fam.layout.groups[0], b)
    for j in bad:
        assert not got[j.job_id].ok and got[j.job_id].error, j
    cb = codec.chunk_bytes(fam.layout.groups[0], b)
    slot0 = mover.slab.view(mover.slot_class[0], 0)
    rest = mover.slab.buffer[slot0.data_ptr() - mover.slab.buffer.data_ptr() + cb:]
    assert torch.equal(rest, slab_before[slot0.data_ptr() - mover.slab.buffer.data_ptr() + cb:])
    # Loads: the same checks, SKIP allowed; nothing written for failed jobs.
    before = poison(group_storages(fam.layout.groups[0]), 1)
    eng.tick()
    eng.load(Job(20, "x", [TransferOp(0, 0, [nb + 1, *list(range(1, b))])]))
    eng.load(Job(21, "y", [TransferOp(0, 0, [SKIP] * b)]))
    eng.load(Job(22, "z", [TransferOp(0, 0, [2] * b)]))
    got = drain(eng, {20, 21, 22})
    assert not got[20].ok and got[21].ok and got[21].nbytes == 0 and not got[22].ok
    assert all(torch.equal(s, p) for s, p in zip(group_storages(fam.layout.groups[0]), before))
    eng.close()
    mover.slab.close()


def test_job_without_ops_and_reused_id() -> None:
    _, mover, bpc = _simple()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), runtime=HostRuntime())
    eng.save(Job(1, "a", []))
    eng.load(Job(2, "b", []))
    got = drain(eng, {1, 2})
    assert got[1].ok and got[2].ok
    eng.save(Job(3, "c", [TransferOp(0, 0, list(range(bpc[0])))]))
    eng.save(Job(3, "c", [TransferOp(0, 1, list(range(bpc[0])))]))  # same id while queued
    got = drain(eng, {3})  # the second submission of id 3 is dropped: one report
    assert got[3].ok
    eng.close()
    mover.slab.close()


def test_saves_wait_for_a_flush_point_and_fence_flushes() -> None:
    fam, mover, bpc = _simple()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), runtime=HostRuntime())
    group = fam.layout.groups[0]
    cb = codec.chunk_bytes(group, bpc[0])
    ids = list(range(5, 5 + bpc[0]))
    eng.save(Job(1, "a", [TransferOp(0, 0, ids)]))
    slot = mover.slab.view(mover.slot_class[0], 0)[:cb]
    slot.fill_(0)
    assert eng.pending() == 1
    assert eng.fence([1]) == 0  # enqueued now; on the host runtime it is complete at once
    want = torch.empty(cb, dtype=torch.uint8)
    codec.gather(group, ids, bpc[0], want)
    assert torch.equal(slot, want)
    assert [c.job_id for c in eng.poll()] == [1]
    assert eng.poll() == []
    eng.close()
    mover.slab.close()


@pytest.mark.parametrize("mode", ["dma", "kernel"])
def test_an_error_while_enqueuing_fails_that_batch_only(mode: str) -> None:
    fam, mover, bpc = _simple(6)
    group = fam.layout.groups[0]
    cb = codec.chunk_bytes(group, bpc[0])
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), mode=mode,
                             batch_bytes=cb, runtime=FailingCopyRuntime(1))
    for i in range(3):
        eng.save(Job(i, "r", [TransferOp(0, i, list(range(i * bpc[0], (i + 1) * bpc[0])))]))
    got = drain(eng, {0, 1, 2})
    assert [got[i].ok for i in range(3)] == [False, True, True]
    assert "injected" in got[0].error
    eng.close()
    mover.slab.close()


def test_state_group_and_paths() -> None:
    fam = _family("v032_mamba_hybrid")
    chunk, bpc = blocks_per_chunk(fam.layout)
    mover = make_mover(fam.layout, chunk, bpc, 2, pin=False)
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), dma_min_piece=1 << 30,
                             runtime=HostRuntime())
    kinds = [g.spec.kind for g in fam.layout.groups]
    assert GroupKind.STATE in kinds
    assert eng.paths() == ["kernel"] * len(kinds)  # every piece is below the threshold
    eng2 = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), dma_min_piece=1,
                              runtime=HostRuntime())
    assert eng2.paths() == ["dma"] * len(kinds)
    mover.slab.close()


# --- the times the engine reports (tests/test_link_estimate.py has the DMA path) ------------

def test_kernel_path_times_jobs_and_counts_link_time_once() -> None:
    """Staged batches of 2 chunks on a link of known speed (LinkRuntime): a save batch's
    gather may start while the batch before it still copies, so batch times overlap; every
    job's busy seconds together are the link's busy time, once, and a load of all the chunks
    reports the whole of its batches as its seconds."""
    fam = _family("v032_flash_LBHNC")
    chunk, bpc = blocks_per_chunk(fam.layout)
    mover = make_mover(fam.layout, chunk, bpc, 8, pin=False)
    cb = codec.chunk_bytes(fam.layout.groups[0], bpc[0])
    rt = LinkRuntime(10.0)
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB", gpu_staging_size="8MiB"),
                             mode="kernel", batch_bytes=2 * cb, max_programs=4, runtime=rt)
    assert eng.paths() == ["kernel"]
    ops = [TransferOp(0, s, list(range(s * bpc[0], (s + 1) * bpc[0]))) for s in range(6)]
    eng.tick()
    for s, op in enumerate(ops):
        eng.save(Job(s, f"r{s}", [op], chunk=s))
    saves = drain(eng, set(range(6)))
    link = 6 * cb / 10e9
    assert sum(c.busy_seconds for c in saves.values()) == pytest.approx(link, rel=1e-9)
    assert max(c.seconds for c in saves.values()) == pytest.approx(link, rel=1e-9)
    eng.tick()
    eng.load(Job(10, "x", ops))
    load = drain(eng, {10})[10]
    assert load.ok and load.nbytes == 6 * cb
    assert load.seconds == pytest.approx(link, rel=1e-9)
    assert load.busy_seconds == pytest.approx(link, rel=1e-9)
    eng.close()
    mover.slab.close()


# --- layer-by-layer loads (load_by_layer) -----------------------------------------------

SINGLE_GROUP = [n for n in NAMES if len(_family(n).layout.groups) == 1]


class _RecordingStream:
    """The compute stream as the forward sees it: records what it was made to wait for."""

    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)

    def wait_stream(self, stream: Any) -> None:
        pass


class _ComputeRecordingRuntime(HostRuntime):
    def __init__(self) -> None:
        super().__init__()
        self.compute = _RecordingStream()

    def current(self) -> Any:
        return self.compute


class _LoadsByLayer(CudaTransferEngine):
    """Every load through :meth:`load_by_layer`, each layer waited in the forward's order
    (so the round trip of tests/_families.py checks the bands' bytes)."""

    bands_seen: list[int]

    def load(self, job: Job) -> None:
        loads = self.load_by_layer([job])
        assert loads is not None
        for layer in sorted({s.layer_index for s in self.mover.layout.groups[0].segments}):
            loads.wait_layer(layer)
        assert loads.next == len(loads.first_layers)  # every band waited for
        self.bands_seen.append(len(loads.first_layers))


@pytest.mark.parametrize("mode", ["dma", "kernel"])
@pytest.mark.parametrize("band_bytes", [1, 1 << 30])
@pytest.mark.parametrize("name", SINGLE_GROUP)
def test_loads_by_layer_are_bit_exact(name: str, mode: str, band_bytes: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Band by band (one layer per band, or the whole chunk in one), the loaded blocks are
    the reference codec's, every other byte keeps its poison (tests/_families.py)."""
    from kvtier.gpu import engine as engine_module

    monkeypatch.setattr(engine_module, "BAND_MIN_BYTES", band_bytes)
    fam = _family(name)
    seen: list[int] = []
    base = _engine_factory(mode, fam)

    def make(mover: ChunkMover) -> CudaTransferEngine:
        e = base(mover)
        e.__class__ = _LoadsByLayer
        e.bands_seen = seen
        return e
    moved = check_engine(fam, make, seed=5)
    assert moved["loaded"] > 0 and seen
    layers = {s.layer_index for s in fam.layout.groups[0].segments}
    assert set(seen) == ({len(layers)} if band_bytes == 1 else {1})


def test_a_layer_waits_for_the_bands_up_to_it_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bands follow the layers in slot order; the forward's wait for layer L makes the
    compute stream wait for the events of the bands that start at or before L, each once;
    the jobs are reported once, after every band."""
    from kvtier.gpu import engine as engine_module

    monkeypatch.setattr(engine_module, "BAND_MIN_BYTES", 1)
    fam = _family("v032_flash_LBHNC")  # three layers, one segment each
    chunk, bpc = blocks_per_chunk(fam.layout)
    mover = make_mover(fam.layout, chunk, bpc, 4, pin=False)
    rt = _ComputeRecordingRuntime()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB", gpu_staging_size="8MiB"),
                             mode="kernel", runtime=rt)
    b = bpc[0]
    eng.save(Job(1, "s", [TransferOp(0, 0, list(range(b)))]))
    eng.save(Job(2, "s", [TransferOp(0, 1, list(range(b, 2 * b)))]))
    drain(eng, {1, 2})
    eng.tick()
    rt.compute.waited.clear()
    loads = eng.load_by_layer([Job(3, "a", [TransferOp(0, 0, list(range(2 * b, 3 * b)))]),
                               Job(4, "b", [TransferOp(0, 1, list(range(3 * b, 4 * b)))])])
    assert loads is not None and loads.first_layers == [0, 1, 2]
    assert all(len(evs) == 1 for evs in loads.events)  # both jobs in one batch per band
    loads.wait_layer(0)
    assert rt.compute.waited == loads.events[0]
    loads.wait_layer(0)  # a second wait for the same layer adds nothing
    assert rt.compute.waited == loads.events[0]
    loads.wait_layer(2)  # layer 1's hook skipped: its band is still waited for, in order
    assert rt.compute.waited == [*loads.events[0], *loads.events[1], *loads.events[2]]
    loads.synchronize()
    got = drain(eng, {3, 4})
    assert got[3].ok and got[4].ok
    assert got[3].nbytes == got[4].nbytes == codec.chunk_bytes(fam.layout.groups[0], b)
    eng.close()
    mover.slab.close()


def test_loads_by_layer_reject_bad_jobs_and_defer_to_whole_loads() -> None:
    """A bad job fails alone (reported by poll, nothing written); with checksums on, or
    several groups, the engine declines (None) and the caller loads whole."""
    fam, mover, bpc = _simple()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB", gpu_staging_size="8MiB"),
                             mode="kernel", runtime=HostRuntime())
    b = bpc[0]
    nb = fam.layout.groups[0].num_blocks
    before = poison(group_storages(fam.layout.groups[0]), 2)
    eng.tick()
    loads = eng.load_by_layer([Job(7, "bad", [TransferOp(0, 0, [nb, *range(1, b)])])])
    assert loads is not None
    loads.wait_layer(10**6)
    loads.synchronize()
    got = drain(eng, {7})
    assert not got[7].ok and got[7].error
    assert all(torch.equal(s, p) for s, p in zip(group_storages(fam.layout.groups[0]), before))
    eng.close()
    mover.slab.close()
    verified = make_mover(fam.layout, *blocks_per_chunk(fam.layout), 4, pin=False, verify=True)
    eng = CudaTransferEngine(verified, KvtierConfig(dram_size="1GiB"), runtime=HostRuntime())
    assert eng.load_by_layer([Job(8, "v", [TransferOp(0, 0, list(range(b)))])]) is None
    eng.close()
    verified.slab.close()
    hybrid = _family("v032_mamba_hybrid")
    chunk, hb = blocks_per_chunk(hybrid.layout)
    m = make_mover(hybrid.layout, chunk, hb, 4, pin=False)
    eng = CudaTransferEngine(m, KvtierConfig(dram_size="1GiB"), runtime=HostRuntime())
    assert eng.load_by_layer([]) is None
    eng.close()
    m.slab.close()

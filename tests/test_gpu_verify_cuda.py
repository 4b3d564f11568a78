"""The CUDA twins of ``tests/test_gpu_verify.py`` and ``tests/test_gpu_checksum_kernels.py``:
the compiled kernels' checksums equal :mod:`kvtier.checksum`'s, verified round trips on every
layout family and path, a flipped slot byte fails the load, and a fence on a save with
checksums keeps the next compute from overwriting blocks its checksum pass still reads.
Skipped without CUDA (run on the H200: ``pytest -m cuda tests/test_gpu_verify_cuda.py``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from _families import (  # noqa: E402
    blocks_per_chunk,
    check_engine,
    drain,
    make_mover,
    materialize,
    stored_recipes,
)
from kvtier import checksum, codec  # noqa: E402
from kvtier.config import KvtierConfig  # noqa: E402
from kvtier.gpu import kernels  # noqa: E402
from kvtier.gpu.engine import CudaTransferEngine  # noqa: E402
from kvtier.protocol import Job, TransferOp  # noqa: E402

RECIPES = stored_recipes()
NAMES = [r["name"] for r in RECIPES]
BY_NAME = {r["name"]: r for r in RECIPES}
SPIN = 50_000_000  # cycles of torch.cuda._sleep: some 25 ms


@pytest.fixture(autouse=True)
def _compiled_kernel() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    assert not isinstance(kernels._move_kernel, InterpretedFunction), \
        "TRITON_INTERPRET=1 leaked into this CUDA test process"


@pytest.mark.parametrize("name", NAMES)
def test_compiled_gather_sums_are_the_checksum(name: str) -> None:
    fam = materialize(BY_NAME[name], "cuda")
    _, bpc = blocks_per_chunk(fam.layout)
    for group, b in zip(fam.layout.groups, bpc):
        for st in fam.storages:
            st.random_(0, 256)
        t = kernels.TileTable.build(group, b)
        n = max(1, min(3, group.num_blocks // b // 2))
        ids = torch.randperm(group.num_blocks, device="cuda")[: n * b].to(torch.int64)
        cb = codec.chunk_bytes(group, b)
        stage = torch.zeros(256 + n * cb, dtype=torch.uint8, device="cuda")
        part = torch.zeros(t.work_items(ids.numel()), dtype=torch.int64, device="cuda")
        t.launch(stage, 256, ids, True, max_programs=64, sums=part)
        got = [int(x) & checksum.MASK64 for x in t.block_sums(part, ids.numel()).tolist()]
        runs = [s.run for s in group.segments]
        want = []
        for c in range(n):
            want += checksum.block_sums(stage[256 + c * cb:256 + (c + 1) * cb].cpu(), runs, b)
        assert got == want, f"{name}: group {group.group_id}"


@pytest.mark.parametrize("mode", ["dma", "kernel", "auto"])
@pytest.mark.parametrize("name", NAMES)
def test_verified_round_trip(name: str, mode: str) -> None:
    fam = materialize(BY_NAME[name], "cuda")
    cfg = KvtierConfig(dram_size="1GiB", gpu_staging_size="4MiB")
    _, bpc = blocks_per_chunk(fam.layout)
    biggest = max(codec.chunk_bytes(g, b) for g, b in zip(fam.layout.groups, bpc))

    def make(mover):  # type: ignore[no-untyped-def]
        return CudaTransferEngine(mover, cfg, mode=mode, batch_bytes=2 * biggest)
    moved = check_engine(fam, make, seed=1, pin=True, verify=True)
    assert moved["saved"] > 0 and moved["loaded"] > 0
    torch.cuda.synchronize()


def _setup(n: int = 4):  # type: ignore[no-untyped-def]
    fam = materialize(BY_NAME["v032_mla_auto"], "cuda")
    chunk, bpc = blocks_per_chunk(fam.layout)
    mover = make_mover(fam.layout, chunk, bpc, n, pin=True, verify=True)
    for st in fam.storages:
        st.random_(0, 256)
    return fam, mover, bpc[0]


@pytest.mark.parametrize("mode", ["dma", "kernel"])
def test_a_flipped_slot_byte_fails_the_load(mode: str) -> None:
    _fam, mover, bpc = _setup()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), mode=mode)
    eng.save(Job(1, "a", [TransferOp(0, 1, list(range(bpc)), seed=9)]))
    assert drain(eng, {1})[1].ok
    mover.slab.view(mover.slot_class[0], 1)[8] ^= 0x01
    eng.tick()
    eng.load(Job(2, "r", [TransferOp(0, 1, list(range(bpc, 2 * bpc)), seed=9)]))
    got = drain(eng, {2})[2]
    assert not got.ok and [(m.slot, m.blocks) for m in got.corrupt] == [(1, (0,))]
    eng.close()
    mover.slab.close()


@pytest.mark.parametrize("mode", ["dma", "kernel"])
def test_a_fence_covers_the_checksum_pass(mode: str) -> None:
    """The compute stream is busy when the save is submitted; after the fence the next step
    overwrites the blocks. The stored checksums must be those of the bytes saved: a fence that
    did not wait for the checksum pass would let it sum overwritten blocks."""
    fam, mover, bpc = _setup()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), mode=mode)
    ids = list(range(3, 3 + bpc))
    eng.save(Job(900, "w", [TransferOp(0, 3, list(range(20, 20 + bpc)), seed=1)]))
    drain(eng, {900})  # compiled and warm
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)  # the forward
    op = TransferOp(0, 0, ids, seed=4)
    eng.save(Job(1, "a", [op]))
    assert eng.fence([1]) == 1
    for st in fam.storages:  # the next step reuses the blocks
        st.fill_(0)
    assert drain(eng, {1})[1].ok
    assert mover.check([op], skip=False) == []
    eng.close()
    mover.slab.close()

"""The GPU data path on a CUDA device: round trips with poison for every layout family
(``tests/_families.py``, materialized on the GPU from the recipes vLLM builds), on each path
of :class:`CudaTransferEngine`, against the reference codec; and the stream ordering of saves,
fences and loads. Skipped without CUDA.
"""

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
from kvtier import codec  # noqa: E402
from kvtier.config import KvtierConfig  # noqa: E402
from kvtier.gpu.engine import CudaTransferEngine  # noqa: E402
from kvtier.protocol import Job, TransferOp  # noqa: E402

RECIPES = stored_recipes()
NAMES = [r["name"] for r in RECIPES]
BY_NAME = {r["name"]: r for r in RECIPES}
SPIN = 50_000_000  # cycles of torch.cuda._sleep: some 25 ms, far longer than the copies


def assert_compiled_kernel() -> None:
    """The kernel path of these tests is Triton's compiled kernel: with TRITON_INTERPRET=1
    anywhere in this process before kvtier.gpu.kernels was imported, Triton's interpreter
    would run it instead, and these tests would check that on the GPU without saying so."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from kvtier.gpu import kernels

    assert not isinstance(kernels._move_kernel, InterpretedFunction), (
        "kvtier.gpu.kernels is interpreted in this CUDA test process (TRITON_INTERPRET=1 "
        "leaked into it); interpreted-kernel tests belong in tests/test_gpu_interpreted.py")
    assert isinstance(kernels._move_kernel, triton.runtime.jit.JITFunction)


@pytest.fixture(autouse=True)
def _compiled_kernel() -> None:
    assert_compiled_kernel()


def test_the_triton_kernel_is_compiled_not_interpreted() -> None:
    assert_compiled_kernel()


def test_batched_dma_is_available() -> None:
    from kvtier.gpu.dma import Driver

    assert Driver().mode == "batch", "cuMemcpyBatchAsync did not resolve; DMA loops instead"


@pytest.mark.parametrize("mode", ["dma", "kernel", "auto"])
@pytest.mark.parametrize("name", NAMES)
def test_round_trip(name: str, mode: str) -> None:
    fam = materialize(BY_NAME[name], "cuda")
    cfg = KvtierConfig(dram_size="1GiB", gpu_staging_size="4MiB")  # small: the ring wraps
    _, bpc = blocks_per_chunk(fam.layout)
    biggest = max(codec.chunk_bytes(g, b) for g, b in zip(fam.layout.groups, bpc))

    def make(mover):  # type: ignore[no-untyped-def]
        return CudaTransferEngine(mover, cfg, mode=mode, batch_bytes=2 * biggest)
    for seed in range(1):
        moved = check_engine(fam, make, seed=seed, pin=True)
        assert moved["saved"] > 0 and moved["loaded"] > 0
    torch.cuda.synchronize()


def _warm(eng: CudaTransferEngine, bpc: int) -> None:
    """Compile the kernels and touch both directions before anything is timed or raced."""
    eng.save(Job(900, "w", [TransferOp(0, 3, list(range(20, 20 + bpc)))]))
    eng.tick()
    eng.load(Job(901, "w", [TransferOp(0, 3, list(range(24, 24 + bpc)))]))
    drain(eng, {900, 901})
    torch.cuda.synchronize()


def _setup(n: int = 4):  # type: ignore[no-untyped-def]
    fam = materialize(BY_NAME["v032_mla_auto"], "cuda")
    chunk, bpc = blocks_per_chunk(fam.layout)
    mover = make_mover(fam.layout, chunk, bpc, n, pin=True)
    for st in fam.storages:
        st.random_(0, 256)
    return fam, mover, bpc[0]


@pytest.mark.parametrize("mode", ["dma", "kernel"])
def test_fence_orders_compute_after_the_save_reads(mode: str) -> None:
    """The compute stream is busy when the save is submitted; the save reads after it; a
    fence must keep the compute that follows from overwriting the blocks first."""
    fam, mover, bpc = _setup()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), mode=mode)
    _warm(eng, bpc)
    group = fam.layout.groups[0]
    ids = list(range(3, 3 + bpc))
    want = torch.empty(codec.chunk_bytes(group, bpc), dtype=torch.uint8, device="cuda")
    codec.gather(group, ids, bpc, want)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)  # the forward
    eng.save(Job(1, "a", [TransferOp(0, 0, ids)]))
    assert eng.fence([1]) == 1
    for st in fam.storages:  # the next step reuses the blocks
        st.fill_(0)
    got = drain(eng, {1})
    assert got[1].ok
    assert torch.equal(mover.slab.view(0, 0)[: want.numel()], want.cpu())
    eng.close()
    mover.slab.close()


@pytest.mark.parametrize("mode", ["dma", "kernel"])
def test_loads_land_after_the_step_began(mode: str) -> None:
    """Work the step queued on the blocks before ``tick`` (vLLM 0.25.1 zeroes new blocks)
    runs before the load writes them."""
    fam, mover, bpc = _setup()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), mode=mode)
    _warm(eng, bpc)
    group = fam.layout.groups[0]
    src = list(range(bpc))
    eng.save(Job(1, "a", [TransferOp(0, 0, src)]))
    drain(eng, {1})
    want = torch.empty(codec.chunk_bytes(group, bpc), dtype=torch.uint8, device="cuda")
    codec.gather(group, src, bpc, want)
    dst = list(range(10, 10 + bpc))
    torch.cuda._sleep(SPIN)
    for st in fam.storages:
        st.fill_(0xFF)  # queued on the compute stream before the step began
    eng.tick()
    eng.load(Job(2, "b", [TransferOp(0, 0, dst)]))
    got = drain(eng, {2})
    assert got[2].ok
    torch.cuda.synchronize()
    out = torch.empty_like(want)
    codec.gather(group, dst, bpc, out)
    assert torch.equal(out, want)
    eng.close()
    mover.slab.close()


def test_saves_do_not_block_the_host() -> None:
    """Submitting saves and polling while the compute stream is busy returns at once."""
    import time

    _fam, mover, bpc = _setup(8)
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), mode="kernel")
    _warm(eng, bpc)
    torch.cuda._sleep(4 * SPIN)
    t0 = time.perf_counter()
    for i in range(8):
        eng.save(Job(i, "a", [TransferOp(0, i, list(range(i * bpc, (i + 1) * bpc)))]))
    eng.tick()
    eng.poll()
    assert eng.fence([0, 1]) == 2
    assert time.perf_counter() - t0 < 0.05
    drain(eng, set(range(8)))
    eng.close()
    mover.slab.close()

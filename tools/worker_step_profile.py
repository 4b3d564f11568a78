"""The worker half's host time per engine step, at the H200 reference run's geometry, on CPU.

    python tools/worker_step_profile.py --engine cuda-host --rounds 5 [--profile]

Builds the Llama-3.1-8B KV cache of the reference run (32 layers, vLLM 0.25.1's
``(2, num_blocks, 16, 8, 128)`` bf16 tensor per layer: 64 segments of 32 KiB per block,
16-block chunks of 32 MiB) on CPU tensors that are never written (untouched pages cost no
memory), and drives :class:`kvtier.worker.OffloadWorker` through the steps of one restore
cycle of the reference run, as the connector's worker side does (``WorkerSide``'s hooks):

- ``prefill``: a step that saves 32 chunks (an 8,192-token prefill step: 1 GiB);
- ``load``: the step a 16,384-token prefix (64 chunks, 1,024 blocks: 2 GiB) starts loading;
- ``parked``: the steps after it, until the load is reported (here: the next one);
- ``decode``: a step with nothing to move.

``--engine``: ``cuda-host``: the GPU engine (:class:`kvtier.gpu.engine.CudaTransferEngine`,
every path) on a runtime whose copies and kernel launches do nothing, so what is timed is the
engine's host Python; ``null-copy``: :class:`kvtier.testing.null_copy.NullCopyEngine` around
it (the bench's floor: every job reported, nothing submitted); ``cpu``: the CPU engine with
real copies (the layers cut to ``--cpu-layers`` so a round takes seconds). Prints per step
kind the median µs of each hook over the rounds (``fence`` + ``begin_step`` = bind,
``end_step`` = wait_for_save, ``collect`` = get_finished), and with ``--profile`` the
functions that took the most time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from kvtier.config import KvtierConfig
from kvtier.layout import GroupKind, GroupSpec, Layout, build_layout
from kvtier.protocol import Job, StepPlan, TransferOp
from kvtier.testing.host_runtime import HostRuntime
from kvtier.testing.null_copy import NullCopyEngine
from kvtier.transfer import ChunkMover, TransferEngine
from kvtier.worker import OffloadWorker

BLOCK = 16
CHUNK = 256
BPC = CHUNK // BLOCK
LOAD_CHUNKS = 64  # a 16,384-token prefix
SAVE_CHUNKS = 32  # an 8,192-token prefill step


class NoCopyRuntime(HostRuntime):
    """Every copy is counted, none is made (the engine's host work is what is timed)."""

    def __init__(self) -> None:
        self.copies = 0

    def copy(self, desc: Any, stream: Any) -> None:
        self.copies += len(desc[2])


class NoLaunch:
    """A kernel table whose launches do nothing (stands in for the Triton gather)."""

    def __init__(self, tiles: Any) -> None:
        self.inner = tiles
        self.vec = tiles.vec
        self.launches = 0

    def launch(self, *args: Any, **kwargs: Any) -> None:
        self.launches += 1


def llama_layout(num_blocks: int, layers: int) -> tuple[Layout, dict[str, torch.Tensor]]:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    caches = {n: torch.empty(2, num_blocks, BLOCK, 8, 128, dtype=torch.bfloat16) for n in names}
    layout = build_layout(caches, [GroupSpec(GroupKind.FULL, BLOCK, tuple(names))], num_blocks,
                          block_axes=dict.fromkeys(names, 1))
    return layout, caches


def cuda_host(mover: ChunkMover, config: KvtierConfig) -> TransferEngine:
    from kvtier.gpu.engine import CudaTransferEngine

    eng = CudaTransferEngine(mover, config, runtime=NoCopyRuntime())
    for g in eng._groups:
        if g.tiles is not None:
            g.tiles = NoLaunch(g.tiles)
    return eng


def factory(kind: str, config: KvtierConfig) -> Callable[[ChunkMover], TransferEngine] | None:
    if kind == "cpu":
        return None
    if kind == "cuda-host":
        return lambda m: cuda_host(m, config)
    return lambda m: NullCopyEngine(cuda_host(m, config), m, 50.0)


class Driver:
    """Plans of the reference cycle, with fresh job ids and blocks of a 2,600-block cache."""

    def __init__(self, worker: OffloadWorker, num_blocks: int) -> None:
        self.worker = worker
        self.num_blocks = num_blocks
        self.step = 0
        self.job_id = 0
        self.slot = 0
        self.times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def _ops(self, n: int, first_block: int) -> list[TransferOp]:
        ops = []
        for c in range(n):
            b0 = (first_block + c * BPC) % (self.num_blocks - BPC)
            ops.append(TransferOp(0, self.slot % 96, list(range(b0, b0 + BPC)), 12345 + c))
            self.slot += 1
        return ops

    def _next_id(self) -> int:
        self.job_id += 1
        return self.job_id

    def plan(self, kind: str) -> StepPlan:
        self.step += 1
        plan = StepPlan(step=self.step)
        if kind == "prefill":
            plan.saves = [Job(self._next_id(), "r", [op], chunk=i)
                          for i, op in enumerate(self._ops(SAVE_CHUNKS, 37 * self.step))]
        elif kind == "load":
            plan.loads = [Job(self._next_id(), "r", self._ops(LOAD_CHUNKS, 11 * self.step))]
        return plan

    def run_step(self, kind: str) -> int:
        """One engine step as the worker side runs it; the jobs finished in it."""
        w, rec = self.worker, self.times[kind]
        plan = self.plan(kind)
        t0 = time.perf_counter()
        w.fence(plan)
        w.begin_step(plan)
        t1 = time.perf_counter()
        if plan.saves:
            w.end_step(plan)
        t2 = time.perf_counter()
        res = w.collect()
        t3 = time.perf_counter()
        rec["bind"].append(t1 - t0)
        rec["wait_for_save"].append(t2 - t1)
        rec["get_finished"].append(t3 - t2)
        rec["total"].append(t3 - t0)
        return len(res.report.loads) + len(res.report.saves)

    def cycle(self) -> None:
        for _ in range(2):
            self.run_step("prefill")
        self.run_step("load")
        self.run_step("parked")
        for _ in range(3):
            self.run_step("decode")
        self.worker.drain()
        self.worker.collect()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=("cuda-host", "null-copy", "cpu"), default="cuda-host")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-blocks", type=int, default=2600)
    p.add_argument("--cpu-layers", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    layers = args.cpu_layers if args.engine == "cpu" else 32
    layout, _caches = llama_layout(args.num_blocks, layers)
    chunk_bytes = layout.groups[0].bytes_per_block * BPC
    config = KvtierConfig(dram_size=f"{100 * chunk_bytes}B", link_gbps=50.0)
    worker = OffloadWorker(config, layout, CHUNK, engine_factory=factory(args.engine, config))
    drv = Driver(worker, args.num_blocks)
    drv.cycle()  # warm-up
    drv.times.clear()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    for _ in range(args.rounds):
        drv.cycle()
    if prof:
        prof.disable()
    print(f"engine {args.engine}: {layers} layers, chunk {chunk_bytes >> 20} MiB, "
          f"load {LOAD_CHUNKS} chunks, save step {SAVE_CHUNKS} chunks, {args.rounds} rounds")
    print(f"{'step':8} {'bind':>9} {'wait_for_save':>14} {'get_finished':>13} {'total':>9}  µs")
    for kind, rec in drv.times.items():
        cells = [f"{statistics.median(rec[h]) * 1e6:9.0f}"
                 for h in ("bind", "wait_for_save", "get_finished", "total")]
        print(f"{kind:8} {cells[0]} {cells[1]:>14} {cells[2]:>13} {cells[3]}")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Null-copy: kvtier with every transfer reported done and no byte moved, the floor an offload
tier is measured against. Never used in production: nothing a user configures reaches this
module; the offline bench installs it (``kvtier bench offline``, configuration
``kvtier-null-copy``) through :class:`NullCopyConnector`.

Contract:
- :class:`NullCopyEngine` wraps the real transfer engine and never hands it a save, a load or
  a verify: every job it is given is reported successful by the next :meth:`poll` (the same
  step's collect, so a request parked for a load is released to vLLM in that step's output
  and runs in the next one). Restored blocks hold whatever HBM held: the tokens of a
  null-copy run are not the model's (it "restores garbage"), its timing is the floor.
- Everything above the engine is kvtier's own code (scheduler, planner, worker, index,
  eviction), so every decision and every park is the one kvtier makes. A completion reports
  the bytes the copy would have moved, over the seconds they take at the configured
  ``link_gbps``, so the planner's link estimate stays at the configured rate and its
  load-or-recompute decisions are those of a link of that speed. Saves commit in the step
  they start, as fast as a copy could: a later lookup can find a chunk a step or more before
  a run with real copies would (a floor, not a replay).
- :attr:`NullCopyEngine.report_steps` counts, per job, the engine steps between submission
  and report (0: reported in the step it started).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvtier import codec
from kvtier.protocol import SKIP, Job, JobKind, TransferOp
from kvtier.transfer import (
    ChunkMover,
    Completion,
    EngineWrapper,
    ThreadedTransferEngine,
    TransferEngine,
)
from kvtier.vllm.connector import KvtierConnector
from kvtier.vllm.worker_side import EngineFactory


class NullCopyEngine(EngineWrapper):
    """Reports every job done at the next poll without running it (see the module note)."""

    def __init__(self, inner: TransferEngine, mover: ChunkMover, link_gbps: float) -> None:
        super().__init__(inner)
        self.mover = mover
        self.link_gbps = float(link_gbps)
        self.steps = 0
        self.report_steps: Counter[int] = Counter()  # engine steps from submission to report
        self.jobs_reported = 0
        self._done: list[tuple[int, Completion]] = []

    def _op_bytes(self, op: TransferOp) -> int:
        group = self.mover.layout.groups[op.group]
        bpc = self.mover.blocks_per_chunk[op.group]
        if SKIP not in op.block_ids:
            return codec.chunk_bytes(group, bpc)
        return group.bytes_per_block * sum(1 for b in op.block_ids if b != SKIP)

    def _finish(self, kind: JobKind, job: Job) -> None:
        nbytes = 0 if kind is JobKind.VERIFY else sum(self._op_bytes(op) for op in job.ops)
        seconds = nbytes / (self.link_gbps * 1e9)
        self._done.append((self.steps, Completion(job.job_id, kind, True, nbytes, seconds)))

    def save(self, job: Job) -> None:
        self._finish(JobKind.SAVE, job)

    def load(self, job: Job) -> None:
        self._finish(JobKind.LOAD, job)

    def verify(self, job: Job) -> None:
        self._finish(JobKind.VERIFY, job)

    def fence(self, job_ids: Sequence[int]) -> int:
        return 0  # no save reads HBM after its step

    def tick(self) -> None:
        self.steps += 1
        self.inner.tick()

    def poll(self) -> list[Completion]:
        done, self._done = self._done, []
        for at, _ in done:
            self.report_steps[self.steps - at] += 1
        self.jobs_reported += len(done)
        return [c for _, c in done] + self.inner.poll()

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        return self.inner.query(job_ids)  # nothing of ours is ever lost: poll reports all

    def pending(self) -> int:
        return len(self._done) + self.inner.pending()

    def drain(self) -> None:
        self.inner.drain()


def null_copy_factory(inner: EngineFactory | None, link_gbps: float
                      ) -> Callable[[ChunkMover], NullCopyEngine]:
    """An engine factory that wraps what ``inner`` makes (default: the CPU engine)."""

    def make(mover: ChunkMover) -> NullCopyEngine:
        engine = inner(mover) if inner is not None else ThreadedTransferEngine(mover)
        return NullCopyEngine(engine, mover, link_gbps)

    return make


class NullCopyConnector(KvtierConnector):
    """kvtier's connector with its transfer engine wrapped in :class:`NullCopyEngine`. Load it
    with ``"kv_connector": "NullCopyConnector", "kv_connector_module_path":
    "kvtier.testing.null_copy"``."""

    def _engine_factory(self, device_is_cuda: bool) -> EngineFactory | None:
        return null_copy_factory(super()._engine_factory(device_is_cuda),
                                 float(self.setup.config.link_gbps))


def rpc_null_copy_steps(worker: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc``: this rank's null-copy jobs, by engine steps from
    submission to report (``{"0": n, ...}``), or ``{}`` where no NullCopyEngine runs."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvtier.transfer import find_engine

    side = get_kv_transfer_group().worker_side
    engine = find_engine(side.worker.engine if side.worker else None, NullCopyEngine)
    if engine is None:
        return {}
    return {"jobs": engine.jobs_reported,
            "report_steps": {str(k): v for k, v in sorted(engine.report_steps.items())}}

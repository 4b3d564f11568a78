"""Moving bytes between the paged KV cache and slab slots, off the forward's critical path.

A :class:`TransferEngine` takes whole jobs (a chunk to save, a request to load) and reports
each through :meth:`poll`, success or failure: an exception inside a copy is a failed job,
never a lost one. Reports may come late, out of order or more than once; an engine whose
notices can get lost must answer :meth:`~TransferEngine.query` from ground truth (what
``event.query()`` is to CUDA). The worker turns that into exactly one report per job and rank. ``fence`` makes sure no compute that follows can overwrite the
blocks a save still reads.

:class:`ThreadedTransferEngine` runs the reference codec on a worker thread: torch's copies
release the GIL, so it overlaps the forward on CPU and serves as the correctness baseline
everywhere. The GPU engine (streams, events, batched DMA) lives in ``kvtier.gpu``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvtier import codec
from kvtier.geometry import Geometry
from kvtier.layout import Layout
from kvtier.protocol import SKIP, Job, JobKind, TransferOp
from kvtier.slab import HostSlab


@dataclass
class Completion:
    job_id: int
    kind: JobKind
    ok: bool
    nbytes: int
    seconds: float
    error: str = ""


class TransferEngine(ABC):
    @abstractmethod
    def save(self, job: Job) -> None:
        """Start copying the job's blocks into its slots (after this step's forward)."""

    @abstractmethod
    def load(self, job: Job) -> None:
        """Start copying the job's slots into its blocks."""

    @abstractmethod
    def fence(self, job_ids: Sequence[int]) -> int:
        """Order the next compute after the listed saves' reads. Returns how many were
        still pending (unknown or finished ids are fine)."""

    @abstractmethod
    def poll(self) -> list[Completion]:
        """Jobs finished since the last poll (a job may be reported again; never before it
        finished)."""

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        """Completions of the listed jobs that have finished, from ground truth. Engines
        whose :meth:`poll` never loses a report may keep this default."""
        return []

    @abstractmethod
    def pending(self) -> int: ...

    def tick(self) -> None:  # noqa: B027 - optional hook
        """One engine step began."""

    @abstractmethod
    def drain(self) -> None:
        """Block until every submitted copy finished (shutdown, tests); completions are
        still reported by the next :meth:`poll`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class ChunkMover:
    """The codec applied to one job's ops against one slab shard: chunk ``j`` of group ``g``
    is ``geometry.blocks_per_chunk(g)`` blocks of ``layout``'s group ``g``, in a slot of
    class ``geometry.slot_classes[g]``."""

    def __init__(self, layout: Layout, geometry: Geometry, slab: HostSlab, shard: int) -> None:
        self.layout = layout
        self.geometry = geometry
        self.slab = slab
        self.shard = shard
        self.slot_class = geometry.slot_classes
        self.blocks_per_chunk = tuple(geometry.blocks_per_chunk(g)
                                      for g in range(len(geometry.groups)))

    def save_op(self, op: TransferOp) -> int:
        group = self.layout.groups[op.group]
        dst = self.slab.view(self.slot_class[op.group], op.slot, self.shard)
        bpc = self.blocks_per_chunk[op.group]
        codec.gather(group, op.block_ids, bpc, dst)
        return codec.chunk_bytes(group, bpc)

    def load_op(self, op: TransferOp) -> int:
        group = self.layout.groups[op.group]
        src = self.slab.view(self.slot_class[op.group], op.slot, self.shard)
        bpc = self.blocks_per_chunk[op.group]
        if SKIP not in op.block_ids:
            codec.scatter(group, op.block_ids, bpc, src)
            return codec.chunk_bytes(group, bpc)
        codec.scatter_positions(group, op.block_ids, bpc, src)
        return group.bytes_per_block * sum(1 for b in op.block_ids if b != SKIP)


class ThreadedTransferEngine(TransferEngine):
    """Copies on one background thread, in submission order."""

    def __init__(self, mover: ChunkMover) -> None:
        self.mover = mover
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-transfer")
        self._running: dict[int, tuple[JobKind, Future]] = {}

    def save(self, job: Job) -> None:
        self._start(JobKind.SAVE, job)

    def load(self, job: Job) -> None:
        self._start(JobKind.LOAD, job)

    def _start(self, kind: JobKind, job: Job) -> None:
        self._running[job.job_id] = (kind, self._pool.submit(self._run, kind, job))

    def _run(self, kind: JobKind, job: Job) -> Completion:
        t0 = time.perf_counter()
        nbytes = 0
        try:
            move = self.mover.save_op if kind is JobKind.SAVE else self.mover.load_op
            for op in job.ops:
                nbytes += move(op)
        except Exception as e:  # a failed copy is a failed job, reported like any other
            return Completion(job.job_id, kind, False, nbytes, time.perf_counter() - t0,
                              f"{type(e).__name__}: {e}")
        return Completion(job.job_id, kind, True, nbytes, time.perf_counter() - t0)

    def fence(self, job_ids: Sequence[int]) -> int:
        waited = 0
        for job_id in job_ids:
            entry = self._running.get(job_id)
            if entry is not None and entry[0] is JobKind.SAVE:
                if not entry[1].done():
                    waited += 1
                entry[1].result()  # CPU: the next forward runs on this host thread
        return waited

    def poll(self) -> list[Completion]:
        out = []
        for job_id, (_kind, fut) in list(self._running.items()):
            if fut.done():
                del self._running[job_id]
                out.append(fut.result())
        return out

    def pending(self) -> int:
        return len(self._running)

    def drain(self) -> None:
        """Wait for everything submitted (shutdown and tests)."""
        for _, fut in list(self._running.values()):
            fut.result()

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)


"""Transfers on CUDA side streams, ordered by events; the forward never waits on the host.

- A save records an event on the compute stream at the end of the step (after the forward)
  and runs its gather and device->host copies on the save stream after that event.
- A load records an event on the compute stream when the step begins (so it lands after
  anything the step already queued on those blocks, such as vLLM 0.25.1 zeroing new mamba
  blocks) and runs on the load stream; it is reported only once its done-event completed, and
  vLLM reads the blocks only after that report.
- A fence makes the compute stream wait for a save's done-event: no host synchronisation.
- Device staging is bounded by ``gpu_staging_size``: a job's segments are copied in pieces
  that fit, so a large chunk never allocates more than that at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.codec import chunk_bytes, segment_offsets
from kvtier.config import KvtierConfig
from kvtier.ops import SKIP, Job, TransferOp
from kvtier.transfer import ChunkMover, Completion, TransferEngine


@dataclass
class _InFlight:
    kind: str
    done: torch.cuda.Event
    start: torch.cuda.Event
    nbytes: int
    keep: list[torch.Tensor]
    error: str = ""
    t0: float = 0.0


class CudaTransferEngine(TransferEngine):
    def __init__(self, mover: ChunkMover, config: KvtierConfig,
                 fault: Callable[[str, Job, TransferOp], None] | None = None) -> None:
        self.mover = mover
        self.config = config
        self.fault = fault
        self.save_stream = torch.cuda.Stream()
        self.load_stream = torch.cuda.Stream()
        self._inflight: dict[int, _InFlight] = {}
        self._failed_now: list[Completion] = []
        self._step_event: torch.cuda.Event | None = None

    def tick(self) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        self._step_event = ev

    # -- the copies -------------------------------------------------------------------------
    def _bpc(self, op: TransferOp) -> int:
        return self.mover._bpc(op)

    def _save_op(self, op: TransferOp, keep: list[torch.Tensor]) -> int:
        group = self.mover.layout.groups[op.group]
        bpc = self._bpc(op)
        dst = self.mover.slab.view(self.mover.slot_class[op.group], op.slot, self.mover.shard)
        dev = group.segments[0].storage.device
        idx = torch.tensor(op.block_ids, dtype=torch.long).to(dev, non_blocking=True)
        keep.append(idx)
        for seg, off in zip(group.segments, segment_offsets(group, bpc)):
            rows = seg.blocks().index_select(0, idx)
            keep.append(rows)
            dst[off: off + seg.run * bpc].view(bpc, seg.run).copy_(rows, non_blocking=True)
        return chunk_bytes(group, bpc)

    def _load_op(self, op: TransferOp, keep: list[torch.Tensor]) -> int:
        group = self.mover.layout.groups[op.group]
        bpc = self._bpc(op)
        src = self.mover.slab.view(self.mover.slot_class[op.group], op.slot, self.mover.shard)
        positions = [i for i, b in enumerate(op.block_ids) if b != SKIP]
        if not positions:
            return 0
        dev = group.segments[0].storage.device
        ids = torch.tensor([op.block_ids[i] for i in positions], dtype=torch.long)
        idx = ids.to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long)
        keep += [idx]
        for seg, off in zip(group.segments, segment_offsets(group, bpc)):
            host = src[off: off + seg.run * bpc].view(bpc, seg.run)
            staged = torch.empty((bpc, seg.run), dtype=torch.uint8, device=dev)
            staged.copy_(host, non_blocking=True)
            keep.append(staged)
            if len(positions) < bpc:
                staged = staged.index_select(0, pos.to(dev, non_blocking=True))
                keep.append(staged)
            seg.blocks().index_copy_(0, idx, staged)
        return group.bytes_per_block * len(positions)

    def _submit(self, kind: str, job: Job) -> None:
        stream = self.save_stream if kind == "save" else self.load_stream
        after = torch.cuda.Event()
        if kind == "save":
            after.record(torch.cuda.current_stream())  # after this step's forward
        else:
            after = self._step_event or after
            if self._step_event is None:
                after.record(torch.cuda.current_stream())
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        keep: list[torch.Tensor] = []
        nbytes, error = 0, ""
        with torch.cuda.stream(stream):
            stream.wait_event(after)
            start.record(stream)
            try:
                for op in job.ops:
                    if self.fault is not None:
                        self.fault(kind, job, op)
                    nbytes += self._save_op(op, keep) if kind == "save" else self._load_op(
                        op, keep)
            except Exception as e:  # reported as a failed job once the stream is past it
                error = f"{type(e).__name__}: {e}"
            done.record(stream)
        self._inflight[job.job_id] = _InFlight(kind, done, start, nbytes, keep, error,
                                               time.perf_counter())

    def save(self, job: Job) -> None:
        self._submit("save", job)

    def load(self, job: Job) -> None:
        self._submit("load", job)

    def fence(self, job_ids: Sequence[int]) -> int:
        waited = 0
        compute = torch.cuda.current_stream()
        for job_id in job_ids:
            f = self._inflight.get(job_id)
            if f is not None and f.kind == "save":
                if not f.done.query():
                    waited += 1
                compute.wait_event(f.done)
        return waited

    def poll(self) -> list[Completion]:
        out = []
        for job_id, f in list(self._inflight.items()):
            if f.done.query():
                del self._inflight[job_id]
                secs = f.start.elapsed_time(f.done) / 1e3
                out.append(Completion(job_id, f.kind, not f.error, f.nbytes, secs, f.error))
        return out

    def pending(self) -> int:
        return len(self._inflight)

    def close(self) -> None:
        for f in self._inflight.values():
            f.done.synchronize()
        self._inflight.clear()

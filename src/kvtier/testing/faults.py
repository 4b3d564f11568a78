"""Test-only faults around any transfer engine, so that tests can prove their checks can
fail and that kvtier survives failing transfers. Never used in production: nothing a user
configures reaches this module.

:class:`FaultyEngine` wraps a :class:`~kvtier.transfer.TransferEngine` and uses nothing but
that interface, so it works around the CPU engine and the GPU engine alike. Every switch is
a plain attribute, off by default, that a test may change between steps:

- ``raise_in_jobs``: the next that many jobs submitted (saves, loads, verifies) fail as an exception inside a copy
  would: not run, reported as failed completions with the exception's text.
- ``skip_load_chunk``: in every load, the op of this KV chunk (index among the job's non-state
  ops) is not copied while the job is reported successful: a silently partial restore.
- ``skip_state_loads``: every load copies none of its recurrent-state ops (the state objects)
  while the job is reported successful: the negative control of the restore check for hybrid
  models (the KV comes back, the state holds whatever was there).
- ``fail_loads``: the next that many loads run but are reported failed.
- ``hold_steps``: every job waits that many engine steps (``tick``) before it is handed to
  the wrapped engine; a fence on a held save hands it over at once, so tests can prove that
  fences run.

Install it with :func:`faulty_factory` where an ``engine_factory`` is taken
(:class:`~kvtier.worker.OffloadWorker`, ``KvtierConnector._engine_factory``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.layout import GroupKind, Layout
from kvtier.protocol import Job, JobKind
from kvtier.transfer import (
    ChunkMover,
    Completion,
    EngineWrapper,
    ThreadedTransferEngine,
    TransferEngine,
)

EngineFactory = Callable[[ChunkMover], TransferEngine]

RAISED = "RuntimeError: kvtier test fault: exception inside a transfer"


@dataclass
class _Held:
    release_tick: int
    kind: JobKind
    job: Job


class FaultyEngine(EngineWrapper):
    def __init__(self, inner: TransferEngine, layout: Layout) -> None:
        super().__init__(inner)
        self.layout = layout
        self.raise_in_jobs = 0
        self.skip_load_chunk = -1
        self.skip_state_loads = False
        self.fail_loads = 0
        self.hold_steps = 0
        self.injected = 0  # faults that fired, ever
        self._tick = 0
        self._held: list[_Held] = []
        self._raised: list[Completion] = []  # not yet polled
        self._raised_ids: dict[int, Completion] = {}  # for query, ever
        self._failed_loads: set[int] = set()  # loads reported failed though they ran

    # -- submission ----------------------------------------------------------------------
    def save(self, job: Job) -> None:
        self._submit(JobKind.SAVE, job)

    def load(self, job: Job) -> None:
        self._submit(JobKind.LOAD, job)

    def verify(self, job: Job) -> None:
        self._submit(JobKind.VERIFY, job)

    def _submit(self, kind: JobKind, job: Job) -> None:
        if self.raise_in_jobs > 0:
            self.raise_in_jobs -= 1
            self.injected += 1
            c = Completion(job.job_id, kind, False, 0, 0.0, RAISED)
            self._raised.append(c)
            self._raised_ids[job.job_id] = c
            return
        if kind is JobKind.LOAD:
            job = self._skip_state(self._skip_chunk(job))
        if self.hold_steps > 0:
            self._held.append(_Held(self._tick + self.hold_steps, kind, job))
        else:
            self._start(kind, job)

    def _skip_chunk(self, job: Job) -> Job:
        kv_ops = [op for op in job.ops
                  if self.layout.groups[op.group].spec.kind is not GroupKind.STATE]
        if not 0 <= self.skip_load_chunk < len(kv_ops):
            return job
        dropped = kv_ops[self.skip_load_chunk]
        self.injected += 1
        return Job(job.job_id, job.req_id, [op for op in job.ops if op is not dropped], job.chunk,
                   job.by_layer)

    def _skip_state(self, job: Job) -> Job:
        if not self.skip_state_loads:
            return job
        kept = [op for op in job.ops
                if self.layout.groups[op.group].spec.kind is not GroupKind.STATE]
        if len(kept) < len(job.ops):
            self.injected += 1
        return Job(job.job_id, job.req_id, kept, job.chunk, job.by_layer)

    def _start(self, kind: JobKind, job: Job) -> None:
        if kind is JobKind.SAVE:
            self.inner.save(job)
        elif kind is JobKind.VERIFY:
            self.inner.verify(job)
        else:
            self.inner.load(job)

    def _release(self, held: list[_Held]) -> None:
        for h in held:
            self._held.remove(h)
            self._start(h.kind, h.job)

    # -- the engine's steps ---------------------------------------------------------------
    def tick(self) -> None:
        self._tick += 1
        self._release([h for h in self._held if h.release_tick <= self._tick])
        self.inner.tick()

    def fence(self, job_ids: Sequence[int]) -> int:
        wanted = set(job_ids)
        self._release([h for h in self._held if h.job.job_id in wanted])
        return self.inner.fence(job_ids)

    def poll(self) -> list[Completion]:
        out, self._raised = self._raised, []
        return out + [self._outcome(c) for c in self.inner.poll()]

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        raised = [self._raised_ids[j] for j in job_ids if j in self._raised_ids]
        return raised + [self._outcome(c) for c in self.inner.query(job_ids)]

    def _outcome(self, c: Completion) -> Completion:
        """A load that ran, reported failed while ``fail_loads`` lasts (every notice of it)."""
        if c.kind == JobKind.LOAD and c.ok:
            if c.job_id not in self._failed_loads and self.fail_loads > 0:
                self.fail_loads -= 1
                self.injected += 1
                self._failed_loads.add(c.job_id)
            if c.job_id in self._failed_loads:
                return Completion(c.job_id, c.kind, False, c.nbytes, c.seconds,
                                  "kvtier test fault: load reported failed")
        return c

    def pending(self) -> int:
        return self.inner.pending() + len(self._held) + len(self._raised)

    def drain(self) -> None:
        self._release(list(self._held))
        self.inner.drain()

    def close(self) -> None:
        self.drain()
        self.inner.close()


def faulty_factory(inner: EngineFactory | None = None) -> Callable[[ChunkMover], FaultyEngine]:
    """An engine factory that wraps what ``inner`` makes (default: the CPU engine)."""

    def make(mover: ChunkMover) -> FaultyEngine:
        engine = inner(mover) if inner is not None else ThreadedTransferEngine(mover)
        return FaultyEngine(engine, mover.layout)

    return make

"""A fake transport that really copies bytes, late, and a TransferEngine per rank on top of it.

The transport is shared by every rank of a scenario (it is the harness's model of DMA engines
and completion queues). A submitted copy is *pending*: it reads its source only when the
transport runs it, at a step and phase (before the forward: ``tick``; after it: ``poll``) drawn
at submission, so a block reused before a late save runs is really read in its new state. When
a copy runs it produces a completion: the ground truth, answered by :meth:`Transport.query`
(what ``event.query()`` is to a CUDA engine). Its *notice* reaches the rank's engine through
:meth:`Transport.take_notices`, possibly late, out of order, twice, or never.

:class:`HarnessEngine` is a kvtier :class:`~kvtier.transfer.TransferEngine` that hands jobs
to the transport and passes notices through unfiltered: deduplication and recovery of dropped
notices are kvtier's job (its worker), which is what the harness tests.

Every run of a copy is reported to the oracle (source blocks unchanged since submission for
saves; bytes written for loads) and the transport keeps the slot-level facts the oracle checks
(no load of a slot that a save on any rank still writes; no save into a slot a load still
reads).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.protocol import SKIP, Job, JobKind, TransferOp
from kvtier.transfer import ChunkMover, Completion, TransferEngine

from .workload import FaultPlan

if TYPE_CHECKING:
    from .oracle import Oracle


@dataclass
class Transfer:
    tid: int
    rank: int
    kind: str  # "save" | "load" | "verify" (a check of stored slots before a promise)
    job: Job
    mover: ChunkMover
    ready: tuple[int, int]  # (step, phase): runs at the first hook at or after it
    submitted: int = 0  # the step it was submitted in
    outcome: str = "ok"  # "ok" | "fail" | "partial"
    salt: object = None  # saves: the cache_salt of the request it saves for
    snapshot: dict[int, int] = field(default_factory=dict)  # saves: block -> write tag
    done: bool = False
    completion: Completion | None = None
    ops_done: list[TransferOp] = field(default_factory=list)


class Transport:
    def __init__(self, world_size: int, faults: FaultPlan, seed: int,
                 oracle: Oracle | None = None,
                 trace: Callable[[str], None] | None = None) -> None:
        self.world_size = world_size
        self.trace = trace
        self.faults = faults
        self.seed = seed
        self.rng = random.Random(seed ^ 0x7A11)
        self.oracle = oracle
        self.now = 0
        self.injected: Counter[str] = Counter()
        # kvtier stops the engine on a failed load by layer here (OffloadWorker.
        # layer_failures_fatal: the asynchronous scheduler), so none is injected; only a
        # CUDA error could fail one (tests/test_layerwise_loads.py checks the stop)
        self.by_layer_loads_never_fail = False
        self._tid = 0
        self._pending: list[list[Transfer]] = [[] for _ in range(world_size)]
        self._by_job: list[dict[int, Transfer]] = [{} for _ in range(world_size)]
        self._notices: list[list[tuple[int, int, Completion]]] = [[] for _ in range(world_size)]
        # slot-level facts: (slot class, slot) -> {transfer id: job id} of copies not yet run
        self.saves_in_flight: dict[tuple[int, int], dict[int, int]] = {}
        self.loads_in_flight: dict[tuple[int, int], dict[int, int]] = {}
        self.caches: list[object] = [None] * world_size  # FakeCache per rank (set by runner)
        self.load_outcomes: list[dict[str, list[Transfer]]] = [{} for _ in range(world_size)]
        # (rank, slot class, slot) -> cache_salt of the request whose save last wrote it
        self.slot_salt: dict[tuple[int, int, int], object] = {}
        # how many attempts of one load job may fail (None: any). With kvtier's RetryingLoads
        # (vLLM 0.25.1 with several groups, where a promised load has no report path) load
        # faults are transient: only the first attempt fails. Its re-issues are counted per
        # job, not per attempt, so a duplicated notice of a failed attempt spends one of them
        # (load_retry's contract); a fault that outlasts them stops the engine by design
        # (tests/test_vllm025_multigroup_loads.py)
        self.failable_load_attempts: int | None = None
        self._attempts: dict[tuple[int, int], int] = {}

    # -- time --------------------------------------------------------------------------------
    def advance(self) -> None:
        """A new engine step begins."""
        self.now += 1

    def _late(self, rank: int) -> int:
        f = self.faults
        if f.late_rank == rank and f.late_steps:
            self.injected["late_rank"] += 1
            return f.late_steps
        return 0

    # -- submission --------------------------------------------------------------------------
    def submit(self, rank: int, kind: str, job: Job, mover: ChunkMover) -> None:
        f, rng = self.faults, self.rng
        delay = 0
        if f.exec_delay_p and rng.random() < f.exec_delay_p:
            delay = rng.randint(1, f.exec_delay_max)
            self.injected["exec_delay"] += 1
        delay += self._late(rank)
        phase = rng.randrange(2)
        self._tid += 1
        t = Transfer(self._tid, rank, kind, job, mover, (self.now + delay, phase),
                     submitted=self.now)
        if kind == "load":
            n = self._attempts[(rank, job.job_id)] = self._attempts.get((rank, job.job_id), 0) + 1
            cap = self.failable_load_attempts
            fails_here = ((f.lone_fail_rank is None or f.lone_fail_rank == rank)
                          and (cap is None or n <= cap)
                          and not (job.by_layer and self.by_layer_loads_never_fail))
            if fails_here and f.load_fail_p and rng.random() < f.load_fail_p:
                t.outcome = "fail"
                self.injected["lone_fail_rank" if f.lone_fail_rank is not None
                              else "load_fail"] += 1
            elif fails_here and f.load_partial_p and rng.random() < f.load_partial_p:
                t.outcome = "partial"
                self.injected["load_partial"] += 1
        elif kind == "save" and f.save_fail_p and rng.random() < f.save_fail_p:
            t.outcome = "partial"
            self.injected["save_fail"] += 1
        slots = self._slots(t)
        if self.oracle is not None:
            self.oracle.on_submit(t, slots)
        table = self.saves_in_flight if kind == "save" else self.loads_in_flight  # verify: reads
        for s in slots:
            table.setdefault(s, {})[t.tid] = job.job_id
        if kind == "save":
            if self.oracle is not None:
                self.oracle.on_save_submitted(t)
            cache = self.caches[rank]
            t.snapshot = {b: cache.tag(b) for op in job.ops for b in op.block_ids  # type: ignore[attr-defined]
                          if b != SKIP}
        self._pending[rank].append(t)
        self._by_job[rank][job.job_id] = t
        if self.trace is not None:
            self.trace(f"    rank {rank} submits {kind} job {job.job_id} ({job.req_id}) slots/blocks "
                       f"{[(op.slot, op.block_ids) for op in job.ops]} runs at {t.ready} "
                       f"{t.outcome}")

    @staticmethod
    def _slots(t: Transfer) -> list[tuple[int, int]]:
        return [(t.mover.slot_class[op.group], op.slot) for op in t.job.ops]

    # -- running copies ----------------------------------------------------------------------
    def run(self, rank: int, phase: int) -> int:
        """Run this rank's copies that are due at (now, phase). Returns how many ran."""
        pos = (self.now, phase)
        due = [t for t in self._pending[rank] if t.ready <= pos]
        if len(due) > 1 and self.faults.reorder:
            self.rng.shuffle(due)
            self.injected["reorder"] += 1
        for t in due:
            self._execute(t)
        return len(due)

    def run_jobs(self, rank: int, job_ids: Sequence[int]) -> int:
        """Run the listed pending copies now (a fence). Returns how many were pending."""
        n = 0
        for j in job_ids:
            t = self._by_job[rank].get(j)
            if t is not None and not t.done:
                self._execute(t)
                n += 1
        return n

    def drain(self, rank: int) -> None:
        for t in list(self._pending[rank]):
            self._execute(t)

    def _execute(self, t: Transfer) -> None:
        self._pending[t.rank].remove(t)
        if self.trace is not None:
            self.trace(f"    rank {t.rank} runs {t.kind} job {t.job.job_id} ({t.outcome})")
        t0 = time.perf_counter()
        ops = list(t.job.ops)
        if t.outcome == "fail":
            ops = []
        elif t.outcome == "partial":
            ops = ops[: self.rng.randrange(len(ops))] if len(ops) > 1 else []
        nbytes = 0
        error = ""
        if t.kind == "save" and self.oracle is not None:
            self.oracle.on_save_run(t)
        corrupt: list = []
        try:
            if t.kind == "verify":
                ops = []
                corrupt = t.mover.check(t.job.ops, skip=False)
                if corrupt:
                    error = "checksum mismatch"
            for op in ops:
                if t.kind == "save":
                    nbytes += t.mover.save_op(op)
                else:
                    nbytes += t.mover.load_op(op)
                    self.caches[t.rank].touch(  # type: ignore[attr-defined]
                        [b for b in op.block_ids if b != SKIP])
                t.ops_done.append(op)
                if t.kind == "save":
                    self.slot_salt[(t.rank, t.mover.slot_class[op.group], op.slot)] = t.salt
        except Exception as e:  # a copy that raises is a failed transfer, and an oracle finding
            error = f"{type(e).__name__}: {e}"
            if self.oracle is not None:
                self.oracle.violation("transfer_raised",
                                      f"rank {t.rank} {t.kind} job {t.job.job_id}: {error}")
        ok = t.outcome == "ok" and not error
        if t.outcome != "ok":
            error = error or f"injected {t.outcome}"
        t.done = True
        t.completion = Completion(t.job.job_id, JobKind(t.kind), ok, nbytes,
                                  time.perf_counter() - t0, error, corrupt)
        table = self.saves_in_flight if t.kind == "save" else self.loads_in_flight
        for s in self._slots(t):
            live = table.get(s)
            if live is not None:
                live.pop(t.tid, None)
                if not live:
                    del table[s]
        if t.kind == "load":
            self.load_outcomes[t.rank].setdefault(t.job.req_id, []).append(t)
            if self.oracle is not None:
                self.oracle.on_load_run(t)
        self._notify(t)

    def _notify(self, t: Transfer) -> None:
        f, rng = self.faults, self.rng
        assert t.completion is not None
        if f.drop_p and rng.random() < f.drop_p:
            self.injected["drop"] += 1
            return
        delay = 0
        if f.notify_delay_p and rng.random() < f.notify_delay_p:
            delay = rng.randint(1, f.notify_delay_max)
            self.injected["notify_delay"] += 1
        delay += self._late(t.rank)
        self._notices[t.rank].append((self.now + delay, t.tid, t.completion))
        if f.duplicate_p and rng.random() < f.duplicate_p:
            self.injected["duplicate"] += 1
            self._notices[t.rank].append((self.now + delay + rng.randint(0, 3), t.tid,
                                          t.completion))

    # -- what engines see --------------------------------------------------------------------
    def take_notices(self, rank: int) -> list[Completion]:
        ready = [n for n in self._notices[rank] if n[0] <= self.now]
        if not ready:
            return []
        self._notices[rank] = [n for n in self._notices[rank] if n[0] > self.now]
        if len(ready) > 1 and self.faults.reorder:
            self.rng.shuffle(ready)
        return [n[2] for n in ready]

    def query(self, rank: int, job_ids: Sequence[int]) -> list[Completion]:
        out = []
        for j in job_ids:
            t = self._by_job[rank].get(j)
            if t is not None and t.done and t.completion is not None:
                out.append(t.completion)
        return out

    def pending(self, rank: int) -> int:
        return len(self._pending[rank])

    def idle(self) -> bool:
        return not any(self._pending) and not any(self._notices)

    def forget_job(self, rank: int, job_id: int) -> None:
        self._by_job[rank].pop(job_id, None)


class HarnessLayerLoads:
    """A step's layer-by-layer loads: a layer's wait runs their copies (as a device stream's
    wait lets the forward read only after them); their notices still come as the fault plan
    says (late, twice, never)."""

    def __init__(self, transport: Transport, rank: int, job_ids: list[int]) -> None:
        self.transport = transport
        self.rank = rank
        self.job_ids = job_ids

    def wait_layer(self, layer_index: int) -> None:
        self.transport.run_jobs(self.rank, self.job_ids)

    def synchronize(self) -> None:
        self.transport.run_jobs(self.rank, self.job_ids)


class HarnessEngine(TransferEngine):
    """kvtier's view of the transport for one rank. Passes notices through as they come."""

    def __init__(self, transport: Transport, rank: int, mover: ChunkMover) -> None:
        self.transport = transport
        self.rank = rank
        self.mover = mover
        # the blocks this step's layer-by-layer loads write (the forward may read them
        # before a failed one is reported: tolerated only where it is, in that step)
        self.by_layer_blocks: set[int] = set()

    def load_by_layer(self, jobs: Sequence[Job]) -> HarnessLayerLoads:
        for job in jobs:
            self.transport.submit(self.rank, "load", job, self.mover)
            self.by_layer_blocks.update(b for op in job.ops for b in op.block_ids if b != SKIP)
        return HarnessLayerLoads(self.transport, self.rank, [j.job_id for j in jobs])

    def save(self, job: Job) -> None:
        self.transport.submit(self.rank, "save", job, self.mover)

    def load(self, job: Job) -> None:
        self.transport.submit(self.rank, "load", job, self.mover)

    def verify(self, job: Job) -> None:
        self.transport.submit(self.rank, "verify", job, self.mover)

    def fence(self, job_ids: Sequence[int]) -> int:
        return self.transport.run_jobs(self.rank, job_ids)

    def tick(self) -> None:
        self.by_layer_blocks = set()
        self.transport.run(self.rank, 0)

    def poll(self) -> list[Completion]:
        self.transport.run(self.rank, 1)
        return self.transport.take_notices(self.rank)

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        return self.transport.query(self.rank, job_ids)

    def pending(self) -> int:
        return self.transport.pending(self.rank)

    def drain(self) -> None:
        self.transport.drain(self.rank)

    def close(self) -> None:
        pass

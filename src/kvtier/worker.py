"""The worker half, engine-agnostic: owns the slab memory and a transfer engine, applies each
step's plan and reports every job exactly once.

Per step the adapter calls ``begin_step`` (fences first, then loads: before the forward),
``end_step`` (saves: after the forward), then ``collect``. Every load job yields one terminal
report per rank (loaded or failed), including after errors; a worker that does not write
(replicated layouts: only the first rank stores the single copy) still reports its saves.

Exactly once per rank, whatever the engine's notices do: the worker keeps the jobs it
submitted in flight until their first completion, drops any later (duplicate) completion of a
job, and asks :meth:`~kvtier.transfer.TransferEngine.query` for jobs in flight for
:data:`REQUERY_STEPS` collects or more, so a lost notice costs a few steps, never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.checksum import key_seed
from kvtier.config import KvtierConfig
from kvtier.geometry import Geometry
from kvtier.layout import Layout
from kvtier.log import get_logger
from kvtier.protocol import Job, JobKind, StepPlan, TransferOp, WorkerReport
from kvtier.shm import SharedSlab
from kvtier.slab import HostSlab, Pinner, SlabLayout
from kvtier.tiers.disk import DiskChunkStore
from kvtier.tiers.seam import (
    ChunkCorrupt,
    ChunkStore,
    TierOp,
    TierPlan,
    TierReport,
    TierRunner,
)
from kvtier.transfer import (
    ChecksumMismatch,
    ChunkMover,
    Completion,
    LayerLoads,
    ThreadedTransferEngine,
    TransferEngine,
)

PROMOTION_WAIT_S = 0.002
"""Longest a collect waits for a disk promotion in flight (:meth:`TierRunner.wait_promotions`):
only while one is, i.e. while a lookup defers for it (:data:`IDLE_WAIT_S` in an idle step)."""

IDLE_WAIT_S = 0.01
"""Longest a collect waits for a job in flight in a step where nothing computes
(:attr:`~kvtier.protocol.StepPlan.idle`: every running request is parked for a load). The
engine loop would otherwise spin through empty steps, and on the CPU engine each spin takes
the GIL from the copy thread: a parked 2,048-token restore took ~300 ms instead of ~20. A
request arriving meanwhile waits at most this long to be scheduled."""

REQUERY_STEPS = 2
"""Collects after which a job still in flight is looked up with ``engine.query``."""

LAYER_WAIT_LIMIT_S = 60.0
"""Longest the host waits for a layer-by-layer load whose engine cannot order the forward
after each layer (:meth:`~kvtier.transfer.TransferEngine.load_by_layer` returned None).
Past it the load's blocks are reported failed (vLLM recomputes them) and the wait ends:
the step never hangs on a copy that does not finish."""

logger = get_logger("worker")

TierStoreFactory = Callable[[TierPlan, int], ChunkStore]
"""(the plan's tier, this rank's shard) -> the store a lower tier's jobs run against."""


def disk_store(plan: TierPlan, shard: int) -> ChunkStore:
    """The disk tier's store of one shard."""
    from pathlib import Path

    return DiskChunkStore(Path(plan.root), shard, plan.namespace)


def default_tier_store(config: KvtierConfig) -> TierStoreFactory:
    """Each plan's store by the plan's tier name: the remote tier's (``remote_url``) for
    ``remote``, the disk's otherwise."""
    if config.remote_url is None:
        return disk_store
    from kvtier.tiers.remote_setup import worker_store_factory  # imports redis

    remote = worker_store_factory(config)

    def store(plan: TierPlan, shard: int) -> ChunkStore:
        return remote(plan, shard) if plan.name == "remote" else disk_store(plan, shard)

    return store


@dataclass
class StepResult:
    finished_loads: set[str] = field(default_factory=set)  # request ids, success or failure
    failed_loads: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)  # block ids of failed loads
    report: WorkerReport = field(default_factory=WorkerReport)
    # blocks of this step's layer-by-layer loads that vLLM must recompute (failed, or read
    # before they landed): reported by block id in this step on every vLLM version
    recompute_blocks: set[int] = field(default_factory=set)

    def merge(self, other: StepResult) -> StepResult:
        return StepResult(self.finished_loads | other.finished_loads,
                          self.failed_loads | other.failed_loads,
                          self.failed_blocks | other.failed_blocks,
                          WorkerReport().add(self.report).add(other.report),
                          self.recompute_blocks | other.recompute_blocks)

    def is_empty(self) -> bool:
        """Nothing finished and nothing reported (most decode steps)."""
        return self == _NOTHING


_NOTHING = StepResult()  # compared against, never changed


UNWAITED_STEPS_OFF = 3
"""Layer-by-layer steps in a row whose forward called vLLM's layer hook for no layer at all
after which the model is taken to skip the hook everywhere (:class:`LayerHookCheck`)."""


class LayerLoadFailed(RuntimeError):
    """A load by layer failed after its promise where that must stop the engine
    (:attr:`OffloadWorker.layer_failures_fatal`)."""


class LayerHookCheck:
    """Finds whether the model's attention calls vLLM's layer hook (``wait_for_layer_load``)
    on every layer: a load by layer is only safe where it does, and a model whose attention
    skips it on some layers would have every such load recomputed.

    Before any load by layer is promised, a probe (:meth:`start_probe`, where the setting can
    act) listens to the hooks of each forward until one tells (:meth:`probe_told`): one that
    called the hook for every layer verifies the model (the scheduler half promises loads by
    layer only from then on); one that called it for some layers only finds it missing on
    the others. A forward that called it for none (a replayed CUDA graph, a step without
    attention) tells nothing.

    After a promise, only where the engine orders the forward per layer (:meth:`found_in`): a
    forward that waited for some layers and not for others skips the hook on those (one step
    tells); one that waited for none, :data:`UNWAITED_STEPS_OFF` steps in a row, everywhere
    (one such step can be a replayed CUDA graph)."""

    def __init__(self) -> None:
        self.missing: list[int] | None = None  # the layers, once found
        self.verified = False  # a forward called the hook for every layer
        self.probing = False
        self._heard: set[int] = set()  # this forward's hooks, while probing
        self._unwaited_steps = 0  # layer-by-layer steps in a row that waited for no layer

    def start_probe(self) -> None:
        self.probing = self.missing is None and not self.verified

    def heard(self, layer_index: int) -> None:
        if self.probing:
            self._heard.add(layer_index)

    def probe_told(self, layers: frozenset[int]) -> bool:
        """At the end of a forward while probing: whether its hooks told (``verified`` or
        ``missing`` set, the probe over); ``layers``: every layer the loads write."""
        heard, self._heard = self._heard, set()
        if not self.probing or not heard:
            return False
        self.probing = False
        if layers <= heard:
            self.verified = True
        else:
            self.missing = sorted(layers - heard)
        return True

    def found_in(self, step: LayeredStep, missed: list[int]) -> bool:
        """Whether ``step`` (whose forward read ``missed`` unwaited) shows it, the first
        time."""
        if self.missing is not None:
            return False
        self._unwaited_steps = self._unwaited_steps + 1 if not step.waited else 0
        if not missed or (not step.waited and self._unwaited_steps < UNWAITED_STEPS_OFF):
            return False
        self.missing = missed
        return True


class LayeredStep:
    """The layer-by-layer loads of one step (:attr:`~kvtier.protocol.Job.by_layer`): the
    forward of that step reads their blocks, so vLLM learns of a failure in that step, by
    block id, and never sees them as finished loads.

    ``loads``: the engine's handle (None: the engine cannot order the forward per layer;
    the first layer's wait blocks the host until every job is reported). ``layers``: the
    layer indexes whose bytes the jobs write; each must see its own wait before the forward
    reads it, else (a CUDA graph replayed the whole forward, say) the blocks are reported
    failed although the copies succeeded."""

    def __init__(self, jobs: list[Job], loads: LayerLoads | None, layers: frozenset[int]
                 ) -> None:
        self.jobs = jobs
        self.loads = loads
        self.layers = layers
        self.waited: set[int] = set()
        self.host_waited_at: int | None = None  # loads None: the layer whose wait blocked

    def missed(self) -> list[int]:
        """Layers whose bytes the forward may have read before they landed (in layer
        order, the forward's)."""
        if self.loads is None and self.host_waited_at is not None:
            return sorted(layer for layer in self.layers if layer < self.host_waited_at)
        return sorted(self.layers - self.waited)


class OffloadWorker:
    """One rank's worker half.

    It builds the :class:`~kvtier.geometry.Geometry` of ``layout`` at ``chunk_tokens`` once
    (``self.geometry``: what the scheduler half is told in the start-up handshake) and
    derives its slab layout and mover from it. ``pinner`` pins the slab for a device's DMA
    (None: not pinned); ``engine_factory`` makes the transfer engine that moves the bytes
    from this worker's :class:`~kvtier.transfer.ChunkMover` (default: the CPU engine).
    ``self.engine`` is that transfer engine (kvtier's, never vLLM's; docs/design.md §1 Words).
    """

    def __init__(
        self,
        config: KvtierConfig,
        layout: Layout,
        chunk_tokens: int,
        rank: int = 0,
        world_size: int = 1,
        replicated: bool = False,
        shared: SharedSlab | None = None,
        pinner: Pinner | None = None,
        engine_factory: Callable[[ChunkMover], TransferEngine] | None = None,
        tier_store: TierStoreFactory | None = None,
        slab_factory: Callable[[SlabLayout], HostSlab] | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.replicated = replicated
        self.geometry = Geometry.of_layout(layout, chunk_tokens)
        num_shards = 1 if replicated else world_size
        self.slab_layout = self.geometry.slab_layout(config, num_shards)
        # slab_factory: the slab lies elsewhere (the node-wide store's pool, kvtier.store)
        self.slab = slab_factory(self.slab_layout) if slab_factory is not None else HostSlab(
            self.slab_layout, shared=shared if world_size > 1 else None,
            pinner=pinner, pin_step=config.pin_step_size)
        shard = 0 if replicated else rank
        self.writes = not replicated or rank == 0
        self.mover = ChunkMover(layout, self.geometry, self.slab, shard,
                                verify=config.verify_checksums)
        self.engine: TransferEngine = (
            engine_factory(self.mover) if engine_factory is not None
            else ThreadedTransferEngine(self.mover))
        # load and verify jobs in flight, by id: a failed load's blocks are read from its ops
        # only when it fails (a restore's thousand block ids are not walked per load)
        self._load_reqs: dict[int, Job] = {}
        self._reported_nowrite: list[Job] = []
        self._fences_waited = 0
        self._inflight: dict[int, int] = {}  # job id -> collect count when it was submitted
        self._collects = 0
        self.idle_wait_s = IDLE_WAIT_S  # 0: an idle step's collect never waits (measurements)
        self.duplicate_completions = 0  # completions of jobs already reported (dropped)
        self.requeried = 0  # completions found by query() after their notice went missing
        self.total_fences_waited = 0  # fences that found their save still pending, ever
        self.failures = 0  # failed transfer jobs, ever
        self.checksum_failures = 0  # loads and verifies whose slots did not verify, ever
        self.total_bytes_stored = 0
        self.total_bytes_loaded = 0
        self.step = 0  # of the last plan begun
        self._idle = False  # the step begun last computes nothing (StepPlan.idle)
        # Why this step's plan must not touch the slab (None: it may): set by the adapter
        # before fence/begin_step and kept through end_step of that plan. The node-wide
        # store's worker sets it while its slab maps no pool of the plan's epoch (a new pool
        # still being mapped and pinned, kvtier.store.attach.StoreMapping.follow): then every
        # load, verify and save of the plan fails at once without reaching the engine (a
        # load's request recomputes, a save is aborted as any failed save is) and nothing is
        # re-issued (RetryingLoads never sees them). Tier plans are not refused: with a store
        # the worker gets none (the store's tiers are the store's own).
        self.refusing: str | None = None
        self.refused = 0  # jobs failed so, ever
        self._refused: list[Completion] = []
        # this step's layer-by-layer loads (None: none), and completions collected early
        # while the forward waited for them on the host
        self._layered: LayeredStep | None = None
        self._early = StepResult()
        # by-layer jobs whose blocks vLLM was told about already (failed or not awaited):
        # their completion, whenever it comes, only goes to the scheduler half
        self._settled: set[int] = set()
        self._tainted_until = -1  # the last step whose saves fail (see end_step)
        self.loads_by_layer = 0  # jobs loaded for their step's forward, layer by layer, ever
        self.layers_missed = 0  # steps whose forward read such a load's layer unwaited, ever
        self._layer_indexes = frozenset(s.layer_index for g in layout.groups
                                        for s in g.segments if s.layer_index >= 0)
        self.layer_hooks = LayerHookCheck()
        self.layer_failures_fatal = False  # raise LayerLoadFailed, never recompute (async)
        self._tier_store = tier_store or default_tier_store(config)
        # per lower tier's name, each on its own I/O thread: made by the first plan with jobs
        # of that tier (a slow or dead tier never delays another's jobs)
        self.tiers: dict[str, TierRunner] = {}
        self._shard = shard

    # -- the step ---------------------------------------------------------------------------
    def fence(self, plan: StepPlan) -> None:
        """Before anything of this step writes KV: order it after the listed saves' reads."""
        if plan.fence:
            waited = self.engine.fence(plan.fence)
            self._fences_waited += waited
            self.total_fences_waited += waited

    def begin_step(self, plan: StepPlan) -> None:
        """Before the forward (after :meth:`fence`): start this step's loads."""
        self.step = plan.step
        self._idle = plan.idle
        self.engine.tick()
        by_layer: list[Job] = []
        for job in plan.loads:
            self._load_reqs[job.job_id] = job
            if job.by_layer:
                by_layer.append(job)
            if self.refusing is not None:
                self._refuse(JobKind.LOAD, job)
                continue
            self._inflight[job.job_id] = self._collects
            if not job.by_layer:
                self.engine.load(job)
        if by_layer:
            layered = self._begin_layered(by_layer)
            if plan.loads_before_forward:
                # the forward may replay a FULL CUDA graph, which never calls the layer
                # hook: order it after every band now (on the device where the engine can)
                self._wait_every_layer(layered)
        for job in plan.verifies:
            self._load_reqs[job.job_id] = job
            if self.refusing is not None:
                self._refuse(JobKind.VERIFY, job)
                continue
            self._inflight[job.job_id] = self._collects
            self.engine.verify(job)
        for tier_plan in plan.tiers:
            self._submit_tier(tier_plan)

    def _begin_layered(self, jobs: list[Job]) -> LayeredStep:
        """Start this step's layer-by-layer loads (refused ones already failed)."""
        running = [j for j in jobs if j.job_id in self._inflight]
        self.loads_by_layer += len(jobs)
        self._early.report.loads_by_layer += len(jobs)
        loads = self.engine.load_by_layer(running) if running else None
        if loads is None:
            for job in running:
                self.engine.load(job)
        self._layered = LayeredStep(jobs, loads, self._layer_indexes)
        return self._layered

    @property
    def loading_by_layer(self) -> bool:
        """Whether this step's forward must wait for layer-by-layer loads."""
        return self._layered is not None

    def wait_layer(self, layer_index: int) -> None:
        """The forward is about to read layer ``layer_index``: order it after that layer's
        bytes (on the device where the engine can; else the host waits for every load of
        the step, once). While the layer-hook probe listens, it hears the call too."""
        self.layer_hooks.heard(layer_index)
        if self._layered is not None:
            self._wait_at(self._layered, layer_index)

    def _wait_at(self, step: LayeredStep, layer_index: int) -> None:
        step.waited.add(layer_index)
        if step.loads is not None:
            step.loads.wait_layer(layer_index)
        elif step.host_waited_at is None:
            step.host_waited_at = layer_index
            self._wait_on_host([j.job_id for j in step.jobs], self._early)

    def _wait_every_layer(self, step: LayeredStep) -> None:
        """The forward reads every layer of ``step``'s loads after them, as if it had waited
        at each layer's hook (the probe hears none of it)."""
        for layer in sorted(step.layers):
            self._wait_at(step, layer)

    def _wait_on_host(self, job_ids: list[int], out: StepResult) -> None:
        """Block until the jobs are reported (their completions accounted into ``out``), at
        most :data:`LAYER_WAIT_LIMIT_S`."""
        t0 = time.monotonic()
        pending = [j for j in job_ids if j in self._inflight]
        while pending:
            self.engine.wait(0.005)
            waited = time.monotonic() - t0
            # past 50 ms ask the engine too: a notice may be lost (the engine contract)
            pending = self._reap(out, pending, query=waited > 0.05)
            if pending:
                if waited > LAYER_WAIT_LIMIT_S:
                    logger.error("kvtier rank %d: layer-by-layer loads %s not done after "
                                 "%.0f s; their blocks are reported failed", self.rank,
                                 pending, waited)
                    return
                time.sleep(0.0002)

    def _reap(self, out: StepResult, job_ids: list[int], query: bool) -> list[int]:
        """Account every completion the engine noticed into ``out``; with ``query``, ask it
        about those of ``job_ids`` still in flight as well (done, their notices late or
        lost: the engine's ground truth). The jobs of ``job_ids`` still in flight."""
        for c in self.engine.poll():
            self._take(c, out)
        pending = [j for j in job_ids if j in self._inflight]
        if query and pending:
            for c in self.engine.query(pending):
                self._take(c, out)
            pending = [j for j in pending if j in self._inflight]
        return pending

    def _settle_layered(self, step: LayeredStep, out: StepResult) -> None:
        """Tell vLLM, in this step, which by-layer blocks it must recompute
        (:attr:`StepResult.recompute_blocks`): those of failed jobs (:meth:`_account`), of
        jobs still not done (an engine error, a lost notice: the forward read them anyway),
        and of every job when a layer was read without its wait.

        Where failures are fatal (:attr:`layer_failures_fatal`) and the device orders the
        forward after the bands, the host does not wait for them here: the forward waited on
        the device already, a copy the engine took can then fail only by a CUDA error (which
        fails the step's own outputs too), and a failed report that comes in a later step
        still stops the engine (:meth:`collect`). The jobs still in flight are reported to
        the scheduler half when they finish, as parked loads are."""
        trust_device = step.loads is not None and self.layer_failures_fatal
        if step.loads is not None:
            if not trust_device:
                step.loads.synchronize()
        else:  # the host waited at the first layer; if no layer waited (a FULL graph): now
            self._wait_on_host([j.job_id for j in step.jobs], out)
        self._reap(out, [j.job_id for j in step.jobs], query=not trust_device)
        missed = step.missed()
        self._check_layer_hooks(step, missed, out)
        if missed:
            self.layers_missed += 1
            out.report.layer_waits_missed += 1
            if self.layers_missed <= 20 or self.layers_missed % 100 == 0:
                logger.warning("kvtier rank %d: the forward read layers %s without waiting "
                               "for their layer-by-layer load (%d so far); vLLM recomputes "
                               "those blocks", self.rank, missed[:8], self.layers_missed)
        for job in step.jobs:
            if missed or (job.job_id in self._inflight and not trust_device):
                self._settled.add(job.job_id)
                out.recompute_blocks.update(b for op in job.ops for b in op.block_ids if b >= 0)
        # _settled keeps only jobs whose completion is still to come
        self._settled.intersection_update(self._inflight)
        if out.recompute_blocks:
            # this step's forward read wrong bytes there, and so does the next one's where a
            # scheduler planned it before vLLM learned of them: neither step's saves run
            self._tainted_until = self.step + 1

    def _stop(self, step: LayeredStep | None, out: StepResult) -> None:
        """A load by layer failed after its promise where that must stop the engine (in its
        step, or ``step`` None: reported in a later one)."""
        missed = step.missed() if step is not None else []
        raise LayerLoadFailed(
            f"kvtier rank {self.rank}: a load by layer failed after its promise "
            f"({len(out.recompute_blocks)} blocks"
            + (f"; the forward read layers {missed[:8]} without waiting" if missed else "")
            + "), under vLLM's asynchronous scheduler, whose recompute of it can keep KV of "
            "tokens it replaced: the engine stops rather than serve that (the log above "
            "says why it failed; with --no-async-scheduling such a failure is recomputed, "
            "with layerwise_loads=false restores park)")

    def _check_layer_hooks(self, step: LayeredStep, missed: list[int], out: StepResult
                           ) -> None:
        """Report, once, a model whose attention skips vLLM's layer hook (the scheduler half
        then loads every hit parked)."""
        if step.loads is None or not self.layer_hooks.found_in(step, missed):
            return
        self._report_hooks_missing(missed, out)

    def _report_hooks_missing(self, missing: list[int], out: StepResult) -> None:
        """Tell the scheduler half, once, that ``missing`` layers skip the hook."""
        out.report.layer_hooks_missing += 1
        logger.warning("kvtier rank %d: the model's attention runs without vLLM's "
                       "wait_for_layer_load on layers %s%s (its own attention op skips the "
                       "hook): layerwise_loads cannot act in this engine; hits load parked",
                       self.rank, missing[:8], " ..." if len(missing) > 8 else "")

    def _end_probe_step(self, out: StepResult) -> None:
        """The forward is over: report what its hooks told the probe, if anything."""
        hooks = self.layer_hooks
        if not hooks.probe_told(self._layer_indexes):
            return
        if hooks.verified:
            out.report.layer_hooks_verified += 1
            logger.info("kvtier rank %d: the model's attention calls vLLM's "
                        "wait_for_layer_load on each of its %d layers: hits may load layer "
                        "by layer", self.rank, len(self._layer_indexes))
            return
        self._report_hooks_missing(hooks.missing or [], out)

    @property
    def layer_hooks_missing(self) -> list[int] | None:
        """Layers the forward runs without vLLM's layer hook, once found (else None)."""
        return self.layer_hooks.missing

    def _submit_tier(self, plan: TierPlan) -> None:
        """Queue a lower tier's jobs on its own I/O thread (never waited for here)."""
        runner = self.tiers.get(plan.name)
        if runner is None:
            slot_class = self.geometry.slot_classes
            runner = self.tiers[plan.name] = TierRunner(
                self._tier_store(plan, self._shard),
                lambda g, slot: self.slab.view(slot_class[g], slot, self._shard),
                moves=self.writes, max_jobs=self.config.disk_max_pending_chunks + 64,
                name=plan.name,
                on_promoted=self._promoted if self.mover.verify else None,
                check_demoted=self._check_demoted if self.mover.verify else None)
        for job in plan.jobs:
            runner.submit(job)

    def _promoted(self, op: TierOp) -> None:
        """A slot filled from the tier (its bytes verified there) gets its slab checksums,
        as a save's slot does, so the load that follows verifies it like any other."""
        self.mover.store_sums(TransferOp(op.group, op.slot, [], key_seed(op.key)))

    def _check_demoted(self, op: TierOp) -> None:
        """Before a slot is demoted: its bytes must match the checksums its save stored, so
        a chunk corrupted in DRAM is never written to the tier as good."""
        bad = self.mover.check([TransferOp(op.group, op.slot, [], key_seed(op.key))],
                               skip=False)
        if bad:
            raise ChunkCorrupt(f"DRAM {ChecksumMismatch(bad)}")

    def end_step(self, plan: StepPlan) -> None:
        """After the forward: start this step's saves (never waited for here). With
        layer-by-layer loads in the step, they are settled first: if vLLM must recompute
        any of their blocks, this step's forward read wrong bytes there, and whatever it
        computed from them (any request of the batch may share those blocks) is not saved:
        every save of the step, and of the next (already scheduled by an asynchronous
        scheduler), fails."""
        layered, self._layered = self._layered, None
        if layered is not None:
            self._settle_layered(layered, self._early)
        tainted = ("computed in or right after a step whose layer-by-layer load is recomputed"
                   if plan.step <= self._tainted_until else None)
        for job in plan.saves:
            if tainted is not None:
                self._fail_save(job, tainted)
            elif self.refusing is not None:  # every rank: no rank's shard was written
                self._refuse(JobKind.SAVE, job)
            elif self.writes:
                self._inflight[job.job_id] = self._collects
                self.engine.save(job)
            else:
                self._reported_nowrite.append(job)

    def _fail_save(self, job: Job, why: str) -> None:
        """Fail a save without running it, for ``why``; reported by the next collect."""
        self._refused.append(Completion(job.job_id, JobKind.SAVE, False, 0, 0.0, why))

    def _refuse(self, kind: JobKind, job: Job) -> None:
        """Fail ``job`` without running it (:attr:`refusing` says why); reported by the next
        :meth:`collect` like a job the engine failed."""
        self.refused += 1
        self._refused.append(Completion(job.job_id, kind, False, 0, 0.0,
                                        f"not run: {self.refusing}"))

    def collect(self) -> StepResult:
        out, self._early = self._early, StepResult()
        rep = out.report
        refused, self._refused = self._refused, []
        for c in refused:
            self._account(c, out)
        for job in self._reported_nowrite:
            rep.saves[job.job_id] = [1, 0]
        self._reported_nowrite = []
        self._collects += 1
        idle, self._idle = self._idle, False  # once per step: a second collect returns at once
        if idle and self._inflight and self.idle_wait_s > 0:
            self.engine.wait(self.idle_wait_s)
        step, self._layered = self._layered, None
        if step is not None:
            self._settle_layered(step, out)
        if self.layer_hooks.probing:
            self._end_probe_step(out)
        for c in self.engine.poll():
            self._take(c, out)
        stale = [j for j, at in self._inflight.items() if self._collects - at >= REQUERY_STEPS]
        if stale:
            for c in self.engine.query(stale):
                if c.job_id in self._inflight:
                    self.requeried += 1
                self._take(c, out)
        rep.fences_waited, self._fences_waited = self._fences_waited, 0
        for name, runner in self.tiers.items():
            runner.wait_promotions(self.idle_wait_s if idle else PROMOTION_WAIT_S)
            done = runner.poll()
            if done:
                tier_report = rep.tiers.setdefault(name, TierReport())
                for tc in done:
                    tier_report.take(tc)
        if self.layer_failures_fatal and out.recompute_blocks:
            self._stop(step, out)
        return out

    def _take(self, c: Completion, out: StepResult) -> None:
        """Account a completion once: later ones for the same job are duplicates."""
        if self._inflight.pop(c.job_id, None) is None:
            self.duplicate_completions += 1
            return
        self._account(c, out)

    def _account(self, c: Completion, out: StepResult) -> None:
        rep = out.report
        if c.corrupt:
            self._count_corrupt(c, rep)
        elif not c.ok:
            self.failures += 1
            if self.failures <= 20 or self.failures % 100 == 0:  # loud, but bounded
                logger.warning("kvtier rank %d: %s job %d failed (%d so far): %s", self.rank,
                               c.kind, c.job_id, self.failures, c.error or "no reason given")
        if c.ok:
            rep.jobs.append((str(c.kind), c.nbytes, c.seconds))
        if c.kind == JobKind.SAVE:
            rep.saves[c.job_id] = [1, 0] if c.ok else [0, 1]
            rep.bytes_stored += c.nbytes
            rep.store_seconds += c.busy_seconds
            self.total_bytes_stored += c.nbytes
            return
        job = self._load_reqs.pop(c.job_id)
        req_id, ok = job.req_id, c.ok
        if c.kind == JobKind.VERIFY:
            rep.verifies[c.job_id] = [1, 0] if ok else [0, 1]
            return
        rep.loads[c.job_id] = [1, 0] if ok else [0, 1]
        rep.bytes_loaded += c.nbytes
        rep.load_seconds += c.busy_seconds
        self.total_bytes_loaded += c.nbytes
        if job.by_layer:  # never parked: vLLM hears only of its failed blocks, once
            if not ok and job.job_id not in self._settled:
                out.recompute_blocks.update(b for op in job.ops for b in op.block_ids if b >= 0)
            self._settled.discard(job.job_id)
            return
        out.finished_loads.add(req_id)
        if not ok:
            out.failed_loads.add(req_id)
            out.failed_blocks.update(b for op in job.ops for b in op.block_ids if b >= 0)

    def _count_corrupt(self, c: Completion, rep: WorkerReport) -> None:
        """A job whose slots did not verify: counted, reported (the scheduler drops those
        chunks) and logged in one line, the first 20 and then every 100th."""
        self.checksum_failures += 1
        rep.checksum_failures += 1
        rep.corrupt[c.job_id] = [(m.slot_class, m.slot) for m in c.corrupt]
        n = self.checksum_failures
        if n <= 20 or n % 100 == 0:
            job = self._load_reqs.get(c.job_id)
            req_id = job.req_id if job is not None else "?"
            what = "restoring" if c.kind == JobKind.LOAD else "verifying a hit of"
            then = ("the load fails and vLLM recomputes" if c.kind == JobKind.LOAD
                    else "the hit is not promised")
            shown = "; ".join(str(m) for m in c.corrupt[:4])
            more = f" and {len(c.corrupt) - 4} more" if len(c.corrupt) > 4 else ""
            logger.warning("kvtier rank %d: checksum mismatch %s request %s: %s%s (%d so far); "
                           "%s", self.rank, what, req_id, shown, more, n, then)

    def pending(self) -> int:
        tier = sum(r.pending() for r in self.tiers.values())
        return (self.engine.pending() + len(self._reported_nowrite) + len(self._refused)
                + tier)

    def drain(self) -> None:
        """Wait until every submitted transfer finished (reported at the next collect)."""
        self.engine.drain()
        for runner in self.tiers.values():
            runner.drain()

    def close(self) -> None:
        self.engine.close()
        for runner in self.tiers.values():
            runner.close()
        self.slab.close()


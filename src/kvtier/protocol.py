"""The protocol between the halves: what the scheduler half tells the workers each step (a
:class:`StepPlan`), what they report back (a :class:`WorkerReport`), and the names both
sides count by (:class:`JobKind`, :class:`SaveDrop`).

Plain dataclasses of ints and strings: they travel pickled inside vLLM's connector metadata
(scheduler -> workers) and worker metadata (workers -> scheduler), so they stay small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvtier.tiers.seam import TierPlan, TierReport


class _Named(str, Enum):
    """An enum whose members are their value wherever they are printed or compared."""

    def __str__(self) -> str:
        return str(self.value)


class JobKind(_Named):
    """What a job does: move a chunk into the slab (save), move a request's chunks out
    (load), or check a request's stored chunks in place before a hit is promised (verify:
    nothing is written, see :attr:`StepPlan.verifies`)."""

    SAVE = "save"
    LOAD = "load"
    VERIFY = "verify"


class SaveDrop(_Named):
    """Why a chunk's save was dropped before it started. The values name the stats keys
    (``saves_dropped_<value>``) and the Prometheus ``reason`` label, so they never change.

    The index declines the first three (``reserve``); the scheduler the others.
    """

    STORED = "already_stored"
    NO_PARENT = "parent_not_stored"
    FULL = "no_evictable_slot"
    QUEUE_FULL = "save_queue_full"
    ADMISSION = "admission"
    BLOCKS_MISSING = "blocks_missing"

    @property
    def drops_later_chunks(self) -> bool:
        """Whether the chunks after this one are dropped too (they would be orphans)."""
        return self in (SaveDrop.FULL, SaveDrop.QUEUE_FULL, SaveDrop.BLOCKS_MISSING)

SKIP = -1
"""A block id in a load that must not be written (already in HBM, or outside a window)."""


@dataclass
class TransferOp:
    """Move one chunk of one group between GPU blocks and one slab slot.

    ``block_ids`` has one entry per block of the chunk (one for a recurrent-state object);
    in loads an entry may be :data:`SKIP` (and that block position is not verified).

    ``seed``: the 64-bit digest of the chunk's key (:func:`kvtier.checksum.key_seed`; for a
    recurrent-state object the key of the chunk that ends at its boundary). The worker mixes
    in ``group`` and its shard (:func:`kvtier.checksum.shard_seed`), so the op stays the same
    for every rank while a slot holding another chunk, another group or another rank's shard
    fails verification.
    """

    group: int
    slot: int
    block_ids: list[int]
    seed: int = 0


@dataclass
class Job:
    """One unit the scheduler counts completions of: a chunk to save, or a request to load."""

    job_id: int
    req_id: str
    ops: list[TransferOp]
    chunk: int = -1  # saves: the chunk index (tests and logs)
    # loads: for the forward of the step that plans it, layer by layer (``layerwise_loads``):
    # the request is not parked, the forward waits for each layer's bytes, and a failure is
    # reported in that same step by its blocks, never as a finished load
    by_layer: bool = False


@dataclass
class StepPlan:
    """The plan of one engine step: what every worker loads, fences and saves."""

    step: int = 0
    loads: list[Job] = field(default_factory=list)
    saves: list[Job] = field(default_factory=list)
    fence: list[int] = field(default_factory=list)  # save jobs the next compute must wait for
    reset: bool = False
    # checks of stored chunks before a hit is promised (JobKind.VERIFY; block ids unused)
    verifies: list[Job] = field(default_factory=list)
    # demotions, promotions and deletes of the lower tiers, one plan per tier with jobs
    tiers: list[TierPlan] = field(default_factory=list)
    # the node-wide store's attach epoch its slots refer to (kvtier.store; 0: no store)
    store_epoch: int = 0
    # and the identity of that epoch's pool (kvtier.store.pool.pool_identity; None: not
    # known): a worker whose store restarted again meanwhile was handed another pool
    store_pool: tuple[int, int] | None = None
    # nothing computes in this step: the workers' collect may wait a little for their jobs
    # and promotions in flight instead of returning at once (kvtier.worker.IDLE_WAIT_S) to an
    # engine loop that spins through empty steps, holding the GIL the copy threads need
    idle: bool = False
    # this step's forward may replay a FULL CUDA graph (every request computes at most a
    # uniform decode's query), which skips vLLM's layer hook: its loads by layer are waited
    # for before the forward, on the device, instead of layer by layer
    loads_before_forward: bool = False


@dataclass
class WorkerReport:
    """Completions of one step, summed over workers. Values: [ok, failed] per job.

    ``corrupt``: per load or verify job, the (slot class, slot) pairs whose bytes did not
    match their checksum on some rank; ``checksum_failures``: jobs that failed so, per rank.

    ``bytes_stored``/``bytes_loaded`` and ``store_seconds``/``load_seconds``: per direction, the
    bytes of the finished jobs and their :attr:`~kvtier.transfer.Completion.busy_seconds`
    (each job's share of its rank's link busy time), summed over jobs and ranks. Bytes over
    seconds is then at most the rate one rank's link achieved (every rank moves its own bytes
    over its own link at the same time, so both sums grow by the number of ranks).
    """

    saves: dict[int, list[int]] = field(default_factory=dict)
    loads: dict[int, list[int]] = field(default_factory=dict)
    verifies: dict[int, list[int]] = field(default_factory=dict)
    corrupt: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    checksum_failures: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    fences_waited: int = 0
    # layer-by-layer loads begun, and steps whose forward read such a load's layer without
    # its wait (its blocks were then recomputed), summed over ranks
    loads_by_layer: int = 0
    layer_waits_missed: int = 0
    # ranks that found the model's attention skipping vLLM's layer hook
    # (OffloadWorker.layer_hooks_missing): the scheduler half then loads every hit parked
    layer_hooks_missing: int = 0
    # ranks whose probe heard the hook on every layer before any load by layer was promised
    # (LayerHookCheck): the scheduler half promises such loads once every rank has
    layer_hooks_verified: int = 0
    # blocks of this step's layer-by-layer loads that vLLM recomputes (StepResult.
    # recompute_blocks, every rank's): the scheduler half drops them, and the blocks after them
    # in the tables that hold them, from vLLM's prefix cache (kvtier.vllm.failed_loads.
    # forget_recomputed_blocks)
    recomputed_blocks: set[int] = field(default_factory=set)
    # (kind, bytes, seconds) of every job that finished ok: the metrics' histograms
    jobs: list[tuple[str, int, float]] = field(default_factory=list)
    tiers: dict[str, TierReport] = field(default_factory=dict)  # per lower tier's name
    # With a node-wide store: the store epoch whose pool every reporting rank's slab maps
    # (the least over ranks and merged steps; -1: some rank maps none of the plan's pools
    # yet); None: no store, or not reported.
    store_epoch: int | None = None

    def add(self, other: WorkerReport) -> WorkerReport:
        for mine, theirs in ((self.saves, other.saves), (self.loads, other.loads),
                             (self.verifies, other.verifies)):
            for job, (ok, failed) in theirs.items():
                cur = mine.setdefault(job, [0, 0])
                cur[0] += ok
                cur[1] += failed
        for job, pairs in other.corrupt.items():
            known = self.corrupt.setdefault(job, [])
            known.extend(p for p in pairs if p not in known)
        self.checksum_failures += other.checksum_failures
        self.bytes_stored += other.bytes_stored
        self.bytes_loaded += other.bytes_loaded
        self.store_seconds += other.store_seconds
        self.load_seconds += other.load_seconds
        self.fences_waited += other.fences_waited
        self.loads_by_layer += other.loads_by_layer
        self.layer_waits_missed += other.layer_waits_missed
        self.layer_hooks_missing += other.layer_hooks_missing
        self.layer_hooks_verified += other.layer_hooks_verified
        self.recomputed_blocks |= other.recomputed_blocks
        self.jobs.extend(other.jobs)
        for name, rep in other.tiers.items():
            self.tiers.setdefault(name, TierReport()).add(rep)
        if other.store_epoch is not None:
            self.store_epoch = (other.store_epoch if self.store_epoch is None
                                else min(self.store_epoch, other.store_epoch))
        return self

    def empty(self) -> bool:
        return not (self.saves or self.loads or self.verifies
                    or any(t.jobs for t in self.tiers.values()))

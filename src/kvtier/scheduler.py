"""The scheduler half, engine-agnostic: requests, decisions, jobs and their completions.

It owns all metadata (index, policy, slot numbering, jobs); workers only move bytes. The
engine adapter calls:

1. ``lookup`` for waiting requests (side-effect free apart from key hashing; may be repeated),
   then ``start_load`` once the engine allocated blocks for a promised hit; with
   ``prepare_hits``, a lookup may first defer (``None``) while the workers prepare the hit
   (:mod:`kvtier.prepare`: lookup -> prepare -> complete);
2. once per step, ``schedule_step`` with everything the engine scheduled (one
   :class:`StepInput`) -> the step's :class:`StepPlan`; the scheduler applies it in its own
   order: preemptions, then block tables (which also collects the step's allocations, fenced
   against in-flight saves), then saves, then the plan;
3. ``on_report`` with the workers' summed :class:`WorkerReport` of each finished step.

Contracts (docs/design.md §2):
- A load is decided in ``lookup`` and pinned in ``start_load``; the pins end only when every
  worker reported the load job, success or failure. A failed load marks the request so the
  same hit is never offered again.
- A chunk becomes visible (``commit``) only when every rank reported its bytes written; a
  failure on any rank aborts it.
- Every save job is registered by its source blocks until it completes; a step that allocates
  one of those blocks, or preempts its request, fences the job.
- A request preempted since the last step may be resumed in the same step: its preemption is
  applied before its resumed block table, never after.
- Bounds: pending save chunks, pending load chunks and pins; beyond them a save is dropped and
  a hit declined, with a reason, never a wait.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.checksum import key_seed
from kvtier.config import KvtierConfig
from kvtier.geometry import NULL_BLOCK, Geometry
from kvtier.index.base import ChunkReserve, Entry, Index
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.keys import ExtraKeysFn, RequestKeys
from kvtier.planner import (
    CostEstimates,
    Decline,
    Hit,
    chunks_to_save,
    decide_load,
    find_hit,
)
from kvtier.policy import make_admission, make_policy
from kvtier.prepare import ChunkRef, Preparation
from kvtier.production import ChunkProducers
from kvtier.protocol import SKIP, Job, JobKind, SaveDrop, StepPlan, TransferOp, WorkerReport
from kvtier.slab import SlabLayout, SlotAllocator
from kvtier.tiers import DRAM
from kvtier.tiers.schedule import LowerTier, TierScheduler
from kvtier.tiers.stack import TierStack


@dataclass
class NewRequest:
    """A request scheduled with its whole block table (first time, or resumed with a new one)."""

    req_id: str
    block_ids: Sequence[Sequence[int]]  # per kvtier group


@dataclass
class CachedRequest:
    """A request scheduled again; ``resumed``: back from preemption, ``new_block_ids`` is then
    its whole table, otherwise blocks appended to it (None: no new blocks)."""

    req_id: str
    new_block_ids: Sequence[Sequence[int]] | None
    resumed: bool = False


@dataclass
class ScheduledTokens:
    """A request computing tokens this step: what its saves are planned from."""

    req_id: str
    tokens: Sequence[int]  # every token known so far
    computed_after: int  # tokens whose KV is in the cache once this step ran
    num_prompt: int
    computed_before: int | None = None  # tokens computed before this step (None: unknown)


@dataclass
class StepInput:
    """Everything the engine scheduled in one step, in no particular order."""

    preempted: Sequence[str] = ()
    new: Sequence[NewRequest] = ()
    cached: Sequence[CachedRequest] = ()
    copy_targets: Sequence[Sequence[int]] = ()  # per group: blocks no table shows
    scheduled: Sequence[ScheduledTokens] = ()


@dataclass
class RequestState:
    req_id: str
    keys: RequestKeys
    block_ids: list[list[int]]
    saved_chunks: int = 0  # chunks [0, saved_chunks) were considered for saving
    load_failed: bool = False
    pending_hit: tuple[Hit, int] | None = None  # decided in lookup: (hit, hbm_tokens)
    load_job: int | None = None
    save_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    last_decline: Decline | None = None
    preparation: Preparation | None = None  # prepare before promise (kvtier.prepare)
    prepare_declined: Decline | None = None  # set: no more preparations, no hit
    hit_sources: dict[str, int] = field(default_factory=dict)  # the promised hit, per tier


@dataclass
class _JobState:
    job: Job
    kind: JobKind
    entries: list[Entry]
    blocks: list[tuple[int, int]]  # (group, block id) read by a save
    chunks: int
    tokens: int = 0  # loads: tokens restored when it succeeds
    ok: int = 0
    failed: int = 0
    state: RequestState | None = None  # the lifecycle it belongs to (ids can be reused)
    step: int = 0  # the step whose plan carried it
    corrupt: set[tuple[int, int]] = field(default_factory=set)  # (class, slot) that failed


@dataclass
class _SaveChoice:
    """A chunk chosen for saving before its reserve: its groups' blocks, in group order."""

    key: bytes
    parent: bytes | None
    wanted: list[tuple[int, list[int]]]  # (group, block ids)
    chunk: int


@dataclass
class SchedulerStats:
    """Counters since start (the connector turns deltas into vLLM stats)."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    declined: Counter = field(default_factory=Counter)
    loads_started: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    loaded_tokens: int = 0
    saves_planned: int = 0
    saves_committed: int = 0
    saves_failed: int = 0
    saves_dropped: Counter = field(default_factory=Counter)
    fences: int = 0
    fences_after_finish: int = 0  # fenced saves whose request had already finished
    preempted_with_saves: int = 0  # preemptions while the request had saves in flight
    max_job_steps: int = 0  # longest a job stayed in flight, in engine steps
    unsaveable_requests: int = 0
    resets: int = 0
    checksum_failures: int = 0  # jobs whose slots did not verify, summed over ranks
    prepares: int = 0  # preparation jobs planned (kvtier.prepare)
    prepare_deferrals: int = 0  # lookups answered "ask again" while a hit was prepared
    prepare_timeouts: int = 0  # requests whose preparation passed the bound
    corrupt_chunks: int = 0  # stored chunks dropped because their bytes did not verify
    # per tier name (kvtier.tiers.TIER_NAMES), per final lookup answer: it promised tokens the
    # tier held (hit), or the tier was asked and provided none (miss); the tokens it provided
    tier_hits: Counter = field(default_factory=Counter)
    tier_misses: Counter = field(default_factory=Counter)
    tier_hit_tokens: Counter = field(default_factory=Counter)


class OffloadScheduler:
    def __init__(
        self,
        config: KvtierConfig,
        geometry: Geometry,
        namespace: bytes,
        slab_layout: SlabLayout,
        world_size: int = 1,
        loads_enabled: bool = True,
        prepare_hits: bool = False,
        clock: Callable[[], float] = time.monotonic,
        draft_lookahead: int = 0,
        lower: LowerTier | Sequence[LowerTier] | None = None,
        index_factory: Callable[[list[GroupIndexSpec], SlabLayout], Index] | None = None,
    ) -> None:
        """``index_factory``: the index lives elsewhere (the node-wide store,
        :class:`kvtier.store.index.StoreIndex`) instead of a :class:`MemoryIndex` over this
        scheduler's own slots. ``prepare_hits``: verify a hit's chunks on the workers before promising it
        (:mod:`kvtier.prepare`; where a load cannot fail once promised). ``clock``: seconds,
        for the preparation's timeout."""
        self.config = config
        self.prepare_hits = prepare_hits
        self._clock = clock
        # tokens after a chunk its bytes depend on: 1 with EAGLE/MTP drafts (kvtier.keys)
        self.draft_lookahead = draft_lookahead
        self.geometry = geometry
        self.namespace = namespace
        self.world_size = world_size
        self.loads_enabled = loads_enabled
        self.slot_class = list(geometry.slot_classes)
        full = set(geometry.full_groups)
        state = set(geometry.state_groups)
        specs = []
        for g in range(len(geometry.groups)):
            cls = self.slot_class[g]
            specs.append(GroupIndexSpec(
                slot_class=cls,
                policy=make_policy(config.policy, slab_layout.classes[cls].num_slots, config),
                chained=g in full,
                boundary_state=g in state,
            ))
        self.allocator = SlotAllocator.for_layout(slab_layout)
        self.index: Index = (MemoryIndex(specs, self.allocator) if index_factory is None
                             else index_factory(specs, slab_layout))
        self.admission = make_admission(config)
        self.estimates = CostEstimates(
            link_gbps=config.link_gbps,
            prefill_seconds_per_token=config.prefill_seconds_per_token,
            step_seconds=config.step_seconds,
        )
        self.requests: dict[str, RequestState] = {}
        # cache-aware admission: the chunks running requests are computing or loading into
        # HBM (kvtier.production); None when admission is off
        self.producers: ChunkProducers | None = (
            ChunkProducers() if config.cache_aware_admission else None)
        self.jobs: dict[int, _JobState] = {}
        self._job_ids = itertools.count(1)
        # per group: block id -> save jobs still reading it (fencing)
        self._block_jobs: list[dict[int, set[int]]] = [{} for _ in geometry.groups]
        self._step = 0
        self._step_loads: list[Job] = []
        self._step_saves: list[Job] = []
        self._step_verifies: list[Job] = []
        self._step_allocated: list[set[int]] = [set() for _ in geometry.groups]
        self._step_preempted: set[str] = set()
        self._reset_pending = False
        self._pending_save_chunks = 0
        self._pending_load_chunks = 0
        self._pinned_chunks = 0
        self.stats = SchedulerStats()
        # the lower tiers below the slab, top first (the disk, the remote store): demotions,
        # write-through, promotions (kvtier.tiers.stack)
        lowers = [] if lower is None else [lower] if isinstance(lower, LowerTier) else lower
        self.stack: TierStack | None = None if not lowers else (
            lowers[0].make_stack or TierStack)(
            lowers, self.index, self.allocator, self.slot_class, geometry, config,
            self.estimates, world_size, self._job_ids, self._on_promoted)

    @property
    def tier(self) -> TierScheduler | None:
        """The lower tier right below DRAM (the top of the stack), if any."""
        return self.stack.tiers[0] if self.stack is not None else None

    def lower_tier(self, name: str) -> TierScheduler | None:
        """The lower tier of that name (``disk``, ``remote``), if configured."""
        return self.stack.named(name) if self.stack is not None else None

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self, req_id: str, cache_salt: str | None = None, extra_keys: ExtraKeysFn | None = None
    ) -> RequestState:
        old = self.requests.get(req_id)
        if old is not None:  # the id is reused: the old lifecycle ends, its jobs finish on it
            old.finished = True
            old.pending_hit = None
            self._release_preparation(old)
            if self.producers is not None:
                self.producers.stop(req_id)
        keys = RequestKeys(self.namespace, self.geometry.chunk_tokens, cache_salt, extra_keys,
                           lookahead=self.draft_lookahead)
        st = RequestState(req_id, keys, [[] for _ in self.geometry.groups])
        self.requests[req_id] = st
        return st

    def lookup(self, req_id: str, tokens: Sequence[int], hbm_tokens: int) -> int | None:
        """Tokens kvtier will load beyond ``hbm_tokens`` for a request whose known tokens
        are ``tokens`` (0: compute them; None: ask again next step, the hit is being
        prepared, or promoted from a lower tier into DRAM: a hit is promised only for bytes
        already in DRAM). The decision is final once the engine allocates."""
        st = self.requests[req_id]
        hit = self._decide(st, tokens, hbm_tokens)
        if self.stack is not None or self.prepare_hits:
            prepared = self._prepare(st, len(tokens), hit, hbm_tokens)
            if prepared is None:
                self.stats.prepare_deferrals += 1
                st.pending_hit = None
                return None
            hit = prepared
        self.stats.lookups += 1
        st.hit_sources = self._count_tiers(st, hit)
        if hit.ok:
            st.pending_hit = (hit, hbm_tokens)
            return hit.tokens
        st.pending_hit = None
        if hit.reason is not None and hit.reason is not st.last_decline:
            st.last_decline = hit.reason
            self.stats.declined[hit.reason.value] += 1
        return 0

    def hit_sources(self, req_id: str) -> dict[str, int]:
        """The request's promised hit per tier name (``kvtier.tiers.TIER_NAMES``): tokens a
        lower tier promoted into DRAM for it, and the rest DRAM's; only tiers above 0, summing
        to the tokens promised ({} without a promise)."""
        st = self.requests.get(req_id)
        return dict(st.hit_sources) if st is not None else {}

    def _count_tiers(self, st: RequestState, hit: Hit) -> dict[str, int]:
        """Each tier's part in one final lookup answer, counted and returned (tiers above 0):
        DRAM is asked by every lookup; a lower tier when a promotion could improve on DRAM's
        answer. Tokens a lower tier promoted for this request are its hit, the rest DRAM's."""
        parts = self.stack.answered(st.preparation, hit) if self.stack is not None else {}
        for name, n in parts.items():
            self._count_tier(name, n)
        parts[DRAM] = hit.tokens - sum(parts.values()) if hit.ok else 0
        self._count_tier(DRAM, parts[DRAM])
        return {name: n for name, n in parts.items() if n > 0}

    def _count_tier(self, name: str, tokens: int) -> None:
        if tokens > 0:
            self.stats.tier_hits[name] += 1
            self.stats.tier_hit_tokens[name] += tokens
        else:
            self.stats.tier_misses[name] += 1

    def _decide(self, st: RequestState, tokens: Sequence[int], hbm_tokens: int) -> Hit:
        if not self.loads_enabled:
            return Hit.declined(Decline.LOADS_DISABLED)
        if st.load_failed:
            return Hit.declined(Decline.FAILED_BEFORE)
        if st.prepare_declined is not None:
            return Hit.declined(st.prepare_declined)
        st.keys.update(tokens)
        if st.keys.unsaveable:
            return Hit.declined(Decline.UNSAVEABLE)
        hit = find_hit(self.index, self.geometry, st.keys.keys, len(tokens), hbm_tokens)
        hit = decide_load(self.geometry, hit, hbm_tokens, self.estimates, self.config.cost_model)
        if not hit.ok:
            return hit
        chunks = hit.boundary - hbm_tokens // self.geometry.chunk_tokens
        if (self._pending_load_chunks + chunks > self.config.max_pending_loads
                or self._pinned_chunks + chunks > self.config.max_pins):
            return Hit.declined(Decline.LOAD_BOUND)
        return hit

    def start_load(
        self, req_id: str, num_external_tokens: int, block_ids: Sequence[Sequence[int]],
        by_layer: bool = False,
    ) -> Job:
        """The engine allocated ``block_ids`` (all of the request's blocks, per group) for a
        promised hit: pin its chunks and queue the load for this step's plan. ``by_layer``:
        the engine computes the request in this same step and its forward reads the blocks
        layer by layer (:attr:`~kvtier.protocol.Job.by_layer`); its report is a load's."""
        st = self.requests[req_id]
        if st.pending_hit is None or st.pending_hit[0].tokens != num_external_tokens:
            raise RuntimeError(
                f"request {req_id}: the engine allocated {num_external_tokens} external tokens "
                f"that kvtier did not promise ({st.pending_hit})"
            )
        hit, hbm = st.pending_hit
        st.pending_hit = None
        self._set_blocks(st, block_ids)
        if st.saved_chunks >= 0:
            # the loaded chunks are stored, and so are their ancestors (a chunk is stored only
            # under its parent, eviction takes leaves first): none needs a save check, which
            # through the node-wide store is a round trip for the whole range
            st.saved_chunks = max(st.saved_chunks, hit.boundary)
        geo = self.geometry
        entries: list[Entry] = []
        ops: list[TransferOp] = []
        first_chunk = hbm // geo.chunk_tokens
        for g, chunks in self._hit_chunks(hit, hbm):
            keys = [st.keys.keys[j] for j in chunks]
            pinned = self.index.pin(g, keys)
            self.index.touch(g, keys)
            entries += pinned
            for j, e in zip(chunks, pinned):
                ops.append(TransferOp(g, e.slot, geo.blocks_to_load(g, st.block_ids[g], j, hbm),
                                      key_seed(e.key)))
        job = Job(next(self._job_ids), req_id, ops, by_layer=by_layer)
        n_chunks = hit.boundary - first_chunk
        self.jobs[job.job_id] = _JobState(job, JobKind.LOAD, entries, [], n_chunks, hit.tokens)
        self._pending_load_chunks += n_chunks
        self._pinned_chunks += len(entries)
        st.load_job = job.job_id
        self.jobs[job.job_id].state = st
        self._step_loads.append(job)
        if self.producers is not None:  # the loaded chunks, then the rest of the prompt
            self.producers.produce(req_id, st.keys.keys[first_chunk:])
        if self.stack is not None and st.preparation is not None:
            self.stack.note_load(st.preparation, hit.tokens)
        self._release_preparation(st)  # the load holds its own pins now
        self.stats.loads_started += 1
        self.stats.hits += 1
        self.stats.hit_tokens += hit.tokens
        return job

    def _hit_chunks(self, hit: Hit, hbm_tokens: int) -> list[tuple[int, range]]:
        """Per group, the chunk indices a load of ``hit`` reads."""
        geo = self.geometry
        first = hbm_tokens // geo.chunk_tokens
        return [(g, geo.chunks_to_load(g, first, hit.boundary)) for g in range(len(geo.groups))]

    # -- prepare before promise (kvtier.prepare) --------------------------------------------
    def _prepare(self, st: RequestState, num_tokens: int, hit: Hit,
                 hbm_tokens: int) -> Hit | None:
        """The hit to promise once its bytes are ready in DRAM (promoted from a lower tier,
        verified); None while a preparation job runs or was just planned (the lookup
        defers). Past the bound: what is already prepared (kvtier.prepare, item 3)."""
        now = self._clock()
        prep = st.preparation
        if prep is None:
            if st.prepare_declined is not None:
                return hit  # given up: _decide declined it
            prep = st.preparation = Preparation(started=now, step=self._step)
        if not prep.timed_out and prep.past_bound(now, self._step, self.config.prepare_timeout_ms,
                                                  self.config.prepare_max_steps):
            prep.timed_out = True
            self.stats.prepare_timeouts += 1
        if prep.timed_out:
            return self._prepared_after_timeout(st, prep, hit, hbm_tokens)
        if prep.busy:
            return None
        if self.stack is not None and not prep.promotion_tried:
            if self.stack.discovering(st.req_id, st.keys.keys, num_tokens):
                return None  # a tier is finding out what it holds (within the bound)
            prep.promotion_tried = True
            started = self.stack.promote(st.req_id, st.keys.keys, num_tokens, hbm_tokens, hit)
            if started is not None:
                prep.promotion, prep.promoted_tokens, prep.promoted_by = started
                return None
        if not hit.ok or not self.prepare_hits:
            return hit
        live = self._live_chunks(st, hit, hbm_tokens)
        if prep.covers(live):
            return hit
        self._plan_preparation(st, prep, prep.missing(live))
        return None

    def _prepared_after_timeout(self, st: RequestState, prep: Preparation, hit: Hit,
                                hbm_tokens: int) -> Hit:
        """Past the bound: the DRAM hit if nothing needs verifying or all of it is prepared,
        else no hit (and no more preparation for this lifecycle)."""
        if not hit.ok or not self.prepare_hits:
            return hit
        if not prep.busy and prep.covers(self._live_chunks(st, hit, hbm_tokens)):
            return hit
        self._release_preparation(st)
        st.prepare_declined = Decline.PREPARE_TIMEOUT
        return Hit.declined(Decline.PREPARE_TIMEOUT)

    def _live_chunks(self, st: RequestState, hit: Hit,
                     hbm_tokens: int) -> dict[ChunkRef, Entry | None]:
        """The index's entry now for every chunk a load of ``hit`` reads."""
        live: dict[ChunkRef, Entry | None] = {}
        for g, chunks in self._hit_chunks(hit, hbm_tokens):
            for j in chunks:
                key = st.keys.keys[j]
                live[(g, key)] = self.index.get(g, key)
        return live

    def _on_promoted(self, req_id: str, job_id: int, landed: list[Entry],
                     failed: Sequence[str]) -> None:
        """A promotion finished (``landed``: the DRAM entries it committed; ``failed``: the
        tiers whose part did not all land): they become prepared chunks of the request that
        asked for it, if it still waits for this promotion."""
        st = self.requests.get(req_id)
        prep = st.preparation if st is not None else None
        if st is None or prep is None or prep.promotion != job_id:
            return  # the request finished, its id was reused or it gave up
        prep.promotion = None
        if failed:  # a failed tier provided nothing; what another tier brought still counts
            for name in failed:
                prep.promoted_by.pop(name, None)
            prep.promoted_tokens = sum(prep.promoted_by.values())
        if st.finished or prep.timed_out:
            return
        for e in landed:
            ref = (e.group, e.key)
            if ref not in prep.prepared and self.index.get(e.group, e.key) is e:
                prep.prepared[ref] = self.index.pin(e.group, [e.key])[0]
                self._pinned_chunks += 1

    def _plan_preparation(self, st: RequestState, prep: Preparation,
                          refs: list[ChunkRef]) -> None:
        """A verify job over ``refs`` (ready chunks: the hit was just found), pinning them."""
        entries, ops = [], []
        self._unpin([e for ref in refs if (e := prep.prepared.pop(ref, None)) is not None])
        for g, key in refs:
            (e,) = self.index.pin(g, [key])
            entries.append(e)
            bpc = self.geometry.blocks_per_chunk(g)
            ops.append(TransferOp(g, e.slot, [SKIP] * bpc, key_seed(key)))
        job = Job(next(self._job_ids), st.req_id, ops)
        self.jobs[job.job_id] = _JobState(job, JobKind.VERIFY, entries, [], 0, state=st)
        self._pinned_chunks += len(entries)
        prep.job = job.job_id
        self._step_verifies.append(job)
        self.stats.prepares += 1

    def _finish_preparation(self, js: _JobState) -> None:
        """Keep the chunks that verified pinned for the promise; drop those that did not."""
        st = js.state
        prep = st.preparation if st is not None else None
        current = (prep is not None and prep.job == js.job.job_id and not st.finished
                   and st.prepare_declined is None
                   and not prep.timed_out)  # else: given up, keep nothing
        if prep is not None and prep.job == js.job.job_id:
            prep.job = None
        keep = []
        # a failed job proves nothing about its other chunks (a rank may have failed for
        # another reason): they are verified again by the next job
        for e in js.entries:
            if current and not js.failed and not e.doomed:
                prep.prepared[(e.group, e.key)] = e  # type: ignore[union-attr]
                keep.append(e)
        self._unpin([e for e in js.entries if e not in keep])
        self._drop_corrupt(js)
        if current and js.failed and not js.corrupt:
            self._release_preparation(st)  # type: ignore[arg-type]
            st.prepare_declined = Decline.PREPARE_FAILED  # type: ignore[union-attr]

    def _release_preparation(self, st: RequestState) -> None:
        """End a request's preparation: its prepared chunks are unpinned (a job in flight
        unpins its own when it finishes)."""
        prep = st.preparation
        if prep is None:
            return
        self._unpin(list(prep.prepared.values()))
        prep.prepared.clear()
        if not prep.busy:
            st.preparation = None

    def _unpin(self, entries: list[Entry]) -> None:
        if entries:
            self.index.unpin(entries)
            self._pinned_chunks -= len(entries)

    def on_blocks(self, req_id: str, new_block_ids: Sequence[Sequence[int]] | None,
                  replace: bool = False) -> None:
        """Track a request's block table; ``replace`` for requests resumed from preemption."""
        st = self.requests.get(req_id)
        if st is None or new_block_ids is None:
            return
        if replace:
            st.block_ids = [[] for _ in self.geometry.groups]
        for g, ids in enumerate(new_block_ids):
            if g < len(st.block_ids):
                st.block_ids[g].extend(ids)
                self._step_allocated[g].update(ids)

    def _set_blocks(self, st: RequestState, block_ids: Sequence[Sequence[int]]) -> None:
        st.block_ids = [list(ids) for ids in block_ids]
        self.note_allocated(block_ids)

    def note_allocated(self, block_ids: Sequence[Sequence[int]]) -> None:
        """Blocks handed out this step that no request table shows (e.g. copy targets)."""
        for g, ids in enumerate(block_ids):
            if g < len(self._step_allocated):
                self._step_allocated[g].update(ids)

    def on_preempted(self, req_id: str) -> None:
        st = self.requests.get(req_id)
        if st is None:
            return
        self._step_preempted.add(req_id)
        if self.producers is not None:
            self.producers.stop(req_id)
        if st.save_jobs:
            self.stats.preempted_with_saves += 1
        st.block_ids = [[] for _ in self.geometry.groups]
        # a preempted request recomputes from a new lookup; chunks it already saved stay
        st.pending_hit = None

    # -- saves ------------------------------------------------------------------------------
    def plan_saves(
        self, req_id: str, tokens: Sequence[int], computed_after_step: int, num_prompt: int,
        computed_before: int | None = None,
    ) -> list[Job]:
        """Queue saves of the chunks that are full and computed after this step
        (``computed_before``: tokens computed before it, where known; see
        :meth:`~kvtier.geometry.Geometry.blocks_to_save`)."""
        st = self.requests.get(req_id)
        if st is None or st.finished:
            return []
        if not st.keys.unsaveable:
            st.keys.update(tokens)
        if st.keys.unsaveable:
            if st.saved_chunks != -1:
                self.stats.unsaveable_requests += 1
                st.saved_chunks = -1
            return []
        todo = chunks_to_save(
            self.geometry.chunk_tokens, st.keys.num_chunks, st.saved_chunks,
            computed_after_step, num_prompt, self.config.save_generated_tokens,
            volatile_tail=self.draft_lookahead > 0,
        )
        jobs: list[Job] = []
        if not todo:
            return jobs
        # stored or being written, per group, asked once for the whole range (one round trip
        # through the store): a chunk is never written twice (another engine's write that
        # starts meanwhile makes the reserve answer STORED)
        live = self.index.stored_or_writing(len(self.geometry.groups),
                                            [st.keys.keys[j] for j in todo])
        start: int | None = todo.start
        while start is not None:
            start = self._save_round(st, range(start, todo.stop), live, todo.start,
                                     computed_after_step, computed_before, jobs)
        st.saved_chunks = max(st.saved_chunks, todo.stop)
        return jobs

    # A step's saves of one request, as one chunk-by-chunk loop would make them: per chunk in
    # order, which groups to write (none where stored or being written), the pending bound,
    # admission, then the index's reserve of each group (a refused group aborts its chunk's
    # others); a drop of the later chunks (SaveDrop.drops_later_chunks) ends the loop. The
    # index is asked once: every chunk is decided first, assuming the chunks before it are
    # reserved, then reserved at once (Index.reserve_chunks, which stops after a FULL), then
    # the answers are walked in chunk order, counting drops and building jobs as the loop
    # would. Where an answer proves a decision wrong (a refused reserve left room under the
    # pending bound, or admission says no after all: SecondSight forgot the key while earlier
    # chunks were admitted), the walk stops there and a new round decides the rest.
    def _save_round(
        self, st: RequestState, chunks: range, live: list[list[bool]], first: int,
        computed_after_step: int, computed_before: int | None, jobs: list[Job],
    ) -> int | None:
        """Decide ``chunks``, reserve them, build their jobs (``live``: per group, per chunk
        from ``first``). The chunk a new round starts from, or None: done."""
        decided: list[tuple[int, _SaveChoice | SaveDrop | None]] = []
        pending = self._pending_save_chunks
        for j in chunks:
            d = self._decide_save(st, j, computed_after_step, computed_before,
                                  [per[j - first] for per in live], pending)
            decided.append((j, d))
            if isinstance(d, _SaveChoice):
                pending += 1
            elif d is not None and d.drops_later_chunks:
                break
        choices = [d for _, d in decided if isinstance(d, _SaveChoice)]
        answers = self.index.reserve_chunks(
            [ChunkReserve(c.key, c.parent, [g for g, _ in c.wanted]) for c in choices]
        ) if choices else []
        return self._walk_round(st, decided, iter(answers), jobs)

    def _decide_save(
        self, st: RequestState, j: int, computed_after_step: int, computed_before: int | None,
        live: list[bool], pending: int,
    ) -> _SaveChoice | SaveDrop | None:
        """Chunk ``j``'s decision before its reserve, changing nothing (admission is only
        asked what it would say); ``live``: per group, whether it is stored or being
        written already; ``pending``: save chunks pending once the earlier ones are."""
        key = st.keys.keys[j]
        wanted: list[tuple[int, list[int]]] = []
        for g in range(len(self.geometry.groups)):
            if live[g]:
                continue  # stored or being written: never twice
            ids = self.geometry.blocks_to_save(g, st.block_ids[g], j, computed_after_step,
                                               computed_before)
            if isinstance(ids, SaveDrop):
                return ids
            if ids is not None:
                wanted.append((g, ids))
        if not wanted:
            return None
        if pending + 1 > self.config.max_pending_saves:
            return SaveDrop.QUEUE_FULL
        if not self.admission.would_admit(key):
            return SaveDrop.ADMISSION
        return _SaveChoice(key, st.keys.keys[j - 1] if j > 0 else None, wanted, j)

    def _walk_round(
        self, st: RequestState, decided: list[tuple[int, _SaveChoice | SaveDrop | None]],
        answers: Iterator[list[Entry] | SaveDrop], jobs: list[Job],
    ) -> int | None:
        """The decisions with the index's answers, in chunk order (see above)."""
        for j, d in decided:
            if isinstance(d, _SaveChoice):
                if not self.admission.admit(d.key):
                    self._abort_answers(itertools.chain([next(answers)], answers))
                    self.stats.saves_dropped[SaveDrop.ADMISSION.value] += 1
                    return j + 1
                d = self._save_job(st, d, next(answers), jobs)
            elif (d is SaveDrop.QUEUE_FULL
                  and self._pending_save_chunks + 1 <= self.config.max_pending_saves):
                return j  # an earlier chunk was refused: room after all (nothing reserved past)
            elif d is SaveDrop.ADMISSION:
                self.admission.admit(st.keys.keys[j])  # no again (keys differ): its memory
            if d is None:
                continue
            self.stats.saves_dropped[d.value] += 1
            if d.drops_later_chunks:
                return None  # later chunks would be orphans (the index reserved none)
        return None

    def _abort_answers(self, answers: Iterator[list[Entry] | SaveDrop]) -> None:
        """Abort what was reserved past a decision that proved wrong, children first."""
        for got in reversed(list(answers)):
            if not isinstance(got, SaveDrop):
                for e in got:
                    self.index.abort(e)

    def _save_job(self, st: RequestState, c: _SaveChoice, got: list[Entry] | SaveDrop,
                  jobs: list[Job]) -> SaveDrop | None:
        """The save job of a chunk the index reserved (``got``: its entries), or the drop."""
        if isinstance(got, SaveDrop):
            return got
        seed = key_seed(c.key)
        ops = [TransferOp(g, e.slot, ids, seed) for (g, ids), e in zip(c.wanted, got)]
        job = Job(next(self._job_ids), st.req_id, ops, chunk=c.chunk)
        blocks = [(op.group, b) for op in ops for b in op.block_ids]
        self.jobs[job.job_id] = _JobState(job, JobKind.SAVE, got, blocks, 1)
        for g, b in blocks:
            self._block_jobs[g].setdefault(b, set()).add(job.job_id)
        st.save_jobs.add(job.job_id)
        self.jobs[job.job_id].state = st
        self._pending_save_chunks += 1
        self._step_saves.append(job)
        self.stats.saves_planned += 1
        jobs.append(job)
        return None

    # -- the step ---------------------------------------------------------------------------
    # The engine adapter calls schedule_step only. Its parts (on_preempted, on_blocks,
    # note_allocated, plan_saves, build_step) stay callable for the planner bench, which
    # times each of them.
    def schedule_step(self, step: StepInput) -> StepPlan:
        """Apply one engine step and return its plan for the workers.

        The order is the contract: preemptions first (a request preempted since the last step
        and resumed in this one keeps its resumed table), then block tables and copy targets
        (the step's allocations, fenced against in-flight saves), then saves, then the plan.
        """
        for req_id in step.preempted:
            self.on_preempted(req_id)
        for new in step.new:
            self.on_blocks(new.req_id, new.block_ids, replace=True)
        for cached in step.cached:
            if cached.new_block_ids is not None:
                self.on_blocks(cached.req_id, cached.new_block_ids, replace=cached.resumed)
        if step.copy_targets:
            self.note_allocated(step.copy_targets)
        for s in step.scheduled:
            self.plan_saves(s.req_id, s.tokens, s.computed_after, s.num_prompt,
                            s.computed_before)
            if self.producers is not None:
                self._note_production(s)
        return self.build_step()

    def _note_production(self, s: ScheduledTokens) -> None:
        """A prefilling request produces its prompt's chunks from the one its computation
        reached (earlier ones are in vLLM's prefix cache, and a waiting request's HBM hit
        covers them); once its prompt is computed it produces nothing more."""
        assert self.producers is not None
        if s.computed_after >= s.num_prompt:
            self.producers.stop(s.req_id)
            return
        st = self.requests.get(s.req_id)
        if st is None or st.keys.unsaveable or self.producers.producing(s.req_id):
            return
        c = self.geometry.chunk_tokens
        self.producers.produce(s.req_id, st.keys.keys[s.computed_after // c:s.num_prompt // c])

    def producing_chunks(self) -> bool:
        """Whether some running request is computing or loading prompt chunks into HBM now
        (False when admission is off)."""
        return self.producers is not None and len(self.producers) > 0

    def produced_until(self, req_id: str, tokens: Sequence[int], hbm_tokens: int) -> int:
        """Where ``req_id``'s HBM hit will reach once the running requests that produce its
        prompt's (``tokens``) chunks, from the one its hit of ``hbm_tokens`` reaches into,
        have put them into HBM: the end of the run of consecutive chunks that other requests
        produce, in tokens; 0 when nobody produces the first of them (or admission is off).
        Above 0 the request waits for them (they land in vLLM's prefix cache soon and its hit
        grows then), and admission holds room for what it needs beyond that point
        (:mod:`kvtier.deferral`)."""
        st = self.requests.get(req_id)
        if self.producers is None or st is None or not len(self.producers):
            return 0
        st.keys.update(tokens)
        c = self.geometry.chunk_tokens
        j = end = hbm_tokens // c
        while end < st.keys.num_chunks:
            producer = self.producers.producer(st.keys.keys[end])
            if producer is None or producer == req_id:
                break
            end += 1
        return end * c if end > j else 0

    def build_step(self) -> StepPlan:
        fence: set[int] = set()
        # one block pool serves every group (vLLM's hybrid allocator: a block a window or
        # state group released comes back in any group), so a save reading block b in one
        # group is fenced when b is handed out in any group
        allocated = set().union(*self._step_allocated)
        allocated.discard(NULL_BLOCK)
        for reading in self._block_jobs:
            if reading and allocated:
                for b in allocated.intersection(reading):
                    fence.update(reading[b])
        for req_id in self._step_preempted:
            st = self.requests.get(req_id)
            if st is not None:
                fence.update(st.save_jobs)
        # saves planned in this very step read blocks only after this step's forward
        fence.difference_update(j.job_id for j in self._step_saves)
        self.stats.fences += len(fence)
        for job_id in fence:
            owner = self.requests.get(self.jobs[job_id].job.req_id)
            if owner is None or owner.finished:
                self.stats.fences_after_finish += 1
        self._step += 1
        for job in self._step_loads + self._step_saves + self._step_verifies:
            self.jobs[job.job_id].step = self._step
        plan = StepPlan(self._step, self._step_loads, self._step_saves, sorted(fence),
                        self._reset_pending, self._step_verifies,
                        self.stack.take_plans(len(self._step_saves)) if self.stack is not None
                        else [])
        self._step_loads, self._step_saves, self._step_verifies = [], [], []
        self._step_allocated = [set() for _ in self.geometry.groups]
        self._step_preempted = set()
        self._reset_pending = False
        return plan

    def on_report(self, report: WorkerReport) -> None:
        if self.stack is not None and report.tiers:
            self.stack.on_report(report.tiers)
        self.stats.checksum_failures += report.checksum_failures
        for job_id, pairs in report.corrupt.items():
            js = self.jobs.get(job_id)
            if js is not None:
                js.corrupt.update(pairs)
        for kind, table in ((JobKind.SAVE, report.saves), (JobKind.LOAD, report.loads),
                            (JobKind.VERIFY, report.verifies)):
            for job_id, (ok, failed) in table.items():
                js = self.jobs.get(job_id)
                if js is None or js.kind != kind:
                    raise RuntimeError(f"a worker reported unknown {kind} job {job_id}")
                js.ok += ok
                js.failed += failed
                if js.ok + js.failed > self.world_size:
                    raise RuntimeError(f"{kind} job {job_id} reported more than once per rank")
                if js.ok + js.failed == self.world_size:
                    self._finish(js)
        if report.bytes_loaded and report.load_seconds > 0:
            # Loads only: the estimate prices loads, and the host-to-device direction has a
            # rate of its own. load_seconds is the link's busy time (WorkerReport), so this
            # is the rate one rank's link achieved, never more.
            self.estimates.observe_transfer(report.bytes_loaded, report.load_seconds)
        self.index.flush()  # the report's commits and unpins, in one round trip at most

    def _finish(self, js: _JobState) -> None:
        del self.jobs[js.job.job_id]
        self.stats.max_job_steps = max(self.stats.max_job_steps, self._step - js.step)
        st = js.state
        if js.kind is JobKind.VERIFY:
            self._finish_preparation(js)
        elif js.kind is JobKind.SAVE:
            self._pending_save_chunks -= 1
            for g, b in js.blocks:
                jobs = self._block_jobs[g].get(b)
                if jobs is not None:
                    jobs.discard(js.job.job_id)
                    if not jobs:
                        del self._block_jobs[g][b]
            for e in js.entries:
                if js.failed:
                    self.index.abort(e)
                elif self.stack is None or not self.stack.notes_saves:
                    self.index.commit_without_answer(e)  # the store's: no round trip
                elif self.index.commit(e):
                    self.stack.note_saved(e)
            if js.failed:
                self.stats.saves_failed += 1
            else:
                self.stats.saves_committed += 1
            if st is not None:
                st.save_jobs.discard(js.job.job_id)
        else:
            self._pending_load_chunks -= js.chunks
            self._pinned_chunks -= len(js.entries)
            self.index.unpin(js.entries)
            self._drop_corrupt(js)
            if js.failed:
                self.stats.loads_failed += 1
            else:
                self.stats.loads_ok += 1
                self.stats.loaded_tokens += js.tokens
            if st is not None:
                st.load_job = None
                if js.failed:
                    st.load_failed = True
        if (st is not None and st.finished and self._idle(st)
                and self.requests.get(st.req_id) is st):
            del self.requests[st.req_id]

    @staticmethod
    def _idle(st: RequestState) -> bool:
        """No job of the request is in flight."""
        return (not st.save_jobs and st.load_job is None
                and (st.preparation is None or st.preparation.job is None))

    def _drop_corrupt(self, js: _JobState) -> None:
        """Forget the chunks of a finished job whose slots failed verification on any rank
        (and, through the index, what is unreachable without them), so no later lookup hits
        the same bad bytes; their slots return to the free list."""
        if not js.corrupt:
            return
        for e in js.entries:
            if (self.slot_class[e.group], e.slot) in js.corrupt and not e.doomed:
                self.index.discard(e)
                self.stats.corrupt_chunks += 1

    def request_finished(self, req_id: str) -> None:
        """The request finished or was aborted; its in-flight jobs still complete normally."""
        st = self.requests.get(req_id)
        if st is None:
            return
        st.finished = True
        st.pending_hit = None
        self._release_preparation(st)
        if self.producers is not None:
            self.producers.stop(req_id)
        if self.stack is not None:
            self.stack.forget_request(req_id)
        if self._idle(st):
            del self.requests[req_id]

    def reset(self) -> None:
        """Drop every stored chunk; in-flight writes and loads end normally but store nothing."""
        self.index.reset()
        if self.stack is not None:
            self.stack.reset()  # the copies go with the next plans' deletes
        self._reset_pending = True
        self.stats.resets += 1

    def loads_in_flight(self) -> bool:
        """Whether a load was planned and has not been reported yet."""
        return bool(self._step_loads) or any(js.kind is JobKind.LOAD
                                             for js in self.jobs.values())

    def has_pending_work(self) -> bool:
        return bool(self.jobs or self._step_loads or self._step_saves or self._step_verifies
                    or (self.stack is not None and self.stack.has_pending_work()))

    def observe_step(self, seconds: float, prefill_tokens: int) -> None:
        self.estimates.observe_step(seconds)
        if prefill_tokens >= self.geometry.chunk_tokens:
            self.estimates.observe_prefill(prefill_tokens, seconds)

    # -- accounting -------------------------------------------------------------------------
    def occupancy(self) -> tuple[int, int]:
        used = total = 0
        for cls in set(self.slot_class):
            n = self.allocator.num_slots(cls)
            total += n
            used += n - self.allocator.num_free(cls)
        return used, total

    def check_drained(self) -> None:
        """Raise AssertionError unless no job, pin or request state is left (tests, soaks)."""
        assert not self.jobs, f"jobs left: {sorted(self.jobs)}"
        assert not any(self._block_jobs), "block->job registrations left"
        assert self._pending_save_chunks == 0 and self._pending_load_chunks == 0
        assert self._pinned_chunks == 0 and self.index.stats().pinned == 0
        assert not self.requests, f"request state left: {sorted(self.requests)}"
        assert self.producers is None or not len(self.producers), "producers left"
        if self.stack is not None:
            self.stack.check_drained()
        self.index.check_invariants()


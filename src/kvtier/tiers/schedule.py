"""The scheduler half's side of a lower tier: what to demote, what to promote, and when a
lookup waits for a promotion.

- **Demotion** (slab -> tier), never on the step loop and never blocking a save or a load:
  once per step, in every full-attention group whose free slots fell below a low watermark
  (:func:`low_watermark`), the chunk eviction would take next is held (``begin_leave``: it
  stays readable, its slot is not reused) and copied by the workers to the tier together with
  its ancestors the tier lacks (the tier, like DRAM, never holds orphans); when every rank
  reported the copy, the tier commits it and the DRAM slot is freed (unless a load pinned the
  chunk or a child was stored under it meanwhile: then it stays). A save that finds no free
  slot still evicts at once (that chunk is lost to the tier, and counted): saves never wait.
- **Promotion** (tier -> slab) before anything is promised: when the tiers extend the hit
  DRAM can give and restoring through them pays (decided by
  :class:`kvtier.tiers.stack.TierStack`, which also says which tier reads which chunk), DRAM
  slots are reserved for the missing chunks, the workers fill them from the tier, verifying every
  checksum, and the lookup answers ``None`` (ask again next step) until the promotion is
  committed; then the hit is an ordinary DRAM hit whose promoted chunks are already prepared.
  The deferral, its bound and its counters are the scheduler's one preparation step
  (:mod:`kvtier.prepare`): past the bound the request goes on with what DRAM holds (the
  promotion still lands, for later requests). A request promotes at most once per lifecycle.
- Chunks whose tier copy did not verify are forgotten by the tier (with their descendants),
  counted, and logged once each by the worker; their DRAM slots are released. So are chunks
  a promotion found gone (a server that evicted them, a removed file: ``vanished``), without
  a log line: the promotion keeps what came before them, and no later lookup tries them
  again (below the disk, the remote store may then serve them).
- With ``verify_checksums`` a demotion first checks the slot against the checksums its save
  stored: a chunk corrupted in DRAM is not written (nor its descendants in the job), is
  dropped from DRAM with what hangs below it, counted (``demotions_corrupt``) and logged.
- Below another tier (the remote store below the disk) a tier does not demote: DRAM's
  evictions go to the tier right below it (``demotes``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.geometry import Geometry
from kvtier.index.base import Entry
from kvtier.index.memory import MemoryIndex
from kvtier.planner import CostEstimates, Decline
from kvtier.slab import SlotAllocator
from kvtier.tiers.catalog import TierCatalog
from kvtier.tiers.cost import TierCost
from kvtier.tiers.seam import TierJob, TierJobKind, TierOp, TierPlan, TierReport

IMPROVABLE = (None, Decline.MISS, Decline.NOT_BEYOND_HBM, Decline.NOT_WORTH_IT)
"""DRAM answers a promotion may improve on (others: bounds, failures, unsaveable requests)."""


def low_watermark(num_slots: int, max_pending: int, burst: int = 0) -> int:
    """Free slots (counting those on their way out) below which a group demotes: room for
    the largest step of saves seen lately (``burst`` chunks, so a prefill's saves find free
    slots instead of evicting chunks that never reach the tier) or 1/32 of the slots, at
    least one; at most a quarter of the slots and what may be in flight."""
    want = max(num_slots // 32, burst + 1)
    return max(1, min(want, num_slots // 4, max_pending))


@dataclass
class LowerTier:
    """A lower tier as the scheduler half gets it: where it is, what it holds, what it costs,
    and the bytes one rank moves per chunk of each group."""

    name: str
    root: str
    namespace: bytes
    catalog: TierCatalog
    cost: TierCost
    chunk_bytes: Sequence[int]
    # builds the scheduler of this tier (same arguments as TierScheduler); None: TierScheduler
    make_scheduler: Callable[..., TierScheduler] | None = None
    # builds what the scheduler drives instead of a kvtier.tiers.stack.TierStack over the
    # lower tiers (same arguments as TierStack), for a tier that is alone below DRAM and
    # whose I/O no worker does (the node-wide store's disk); None: a TierStack
    make_stack: Callable[..., Any] | None = None


@dataclass
class TierStats:
    demotions: int = 0  # chunks committed to the tier
    demotion_jobs_failed: int = 0
    demotions_dropped: int = 0  # chunks that left DRAM uncopied (no room or budget)
    evicted_already_stored: int = 0  # left DRAM with their copy already on the tier
    demotions_corrupt: int = 0  # not demoted: the DRAM copy did not verify (dropped from DRAM)
    promotions: int = 0  # chunks committed to DRAM from the tier
    promotion_jobs_failed: int = 0
    checksum_failures: int = 0  # chunks whose tier copy did not verify (all ranks)
    vanished: int = 0  # chunks a promotion found gone (evicted by the server, file removed)
    tier_full: int = 0  # writes the tier declined for want of space
    declined_slower: int = 0  # promotions declined by the cost model
    hits: int = 0  # loads that restored chunks promoted for them
    hit_tokens: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    bytes_written: int = 0
    write_seconds: float = 0.0


@dataclass
class _TierJobState:
    job: TierJob
    catalog_entries: list[Entry]
    dram_entries: list[Entry]  # promote: reserved slots; demote: pinned ancestors
    leaving: Entry | None = None  # demote: the chunk on its way out
    req_id: str = ""
    ok: int = 0
    failed: int = 0
    corrupt: set[int] = field(default_factory=set)
    absent: set[int] = field(default_factory=set)  # promote: ops whose chunk was gone


PromotionLanded = Callable[[str, int, list[Entry], bool], None]
"""(request id, promotion job id, the DRAM entries it committed, whether it all verified):
the scheduler's preparation step takes the landed chunks as prepared (kvtier.prepare)."""


class TierScheduler:
    discovers = False  # whether :meth:`discovering` may ever defer (the catalog is local)

    def __init__(self, tier: LowerTier, dram: MemoryIndex, allocator: SlotAllocator,
                 slot_class: Sequence[int], geometry: Geometry, config: KvtierConfig,
                 estimates: CostEstimates, world_size: int, job_ids: itertools.count,
                 on_landed: PromotionLanded | None = None) -> None:
        self.tier = tier
        self.catalog = tier.catalog
        self.dram = dram
        self.allocator = allocator
        self.slot_class = list(slot_class)
        self.geometry = geometry
        self.config = config
        self.estimates = estimates
        self.world_size = world_size
        self._job_ids = job_ids
        self.jobs: dict[int, _TierJobState] = {}
        self._queued: list[TierJob] = []
        self._leaving = [0] * len(geometry.groups)
        self._pending_chunks = 0
        self._bursts: deque[int] = deque([0], maxlen=32)  # chunks saved per recent step
        self.on_landed = on_landed
        self.demotes = True  # demote what DRAM evicts (False below another tier: it does)
        self.stats = TierStats()

    # -- demotion ---------------------------------------------------------------------------
    def plan_demotions(self, saves: int = 0) -> None:
        """Demote where DRAM runs low; ``saves``: chunks this step saves (the burst)."""
        if not self.demotes:
            return
        budget = self.config.disk_max_pending_chunks
        self._bursts.append(saves)
        burst = max(self._bursts)
        for g in self.geometry.full_groups:
            cls = self.slot_class[g]
            low = low_watermark(self.allocator.num_slots(cls), budget, burst)
            while (self.allocator.num_free(cls) + self._leaving[g] < low
                   and self._pending_chunks < budget):
                e = self.dram.begin_leave(g)
                if e is None:
                    break
                self._demote(g, e, budget - self._pending_chunks)

    def plan_write_back(self) -> bool:
        """Demote what DRAM would evict next, whatever the watermark, up to the in-flight
        budget (the node-wide store's write-back at a graceful stop); whether anything is
        left to demote or in flight."""
        budget = self.config.disk_max_pending_chunks
        left = False
        for g in self.geometry.full_groups:
            while self._pending_chunks < budget:
                e = self.dram.begin_leave(g)
                if e is None:
                    break
                self._demote(g, e, budget - self._pending_chunks)
            else:
                left = True
        return left or bool(self.jobs or self._queued)

    def _demote(self, g: int, e: Entry, budget: int) -> None:
        chain: list[Entry] = []
        x: Entry | None = e
        while x is not None and self.catalog.index.get(g, x.key) is None:
            chain.append(x)
            x = x.parent
        chain.reverse()
        if not chain:
            self.dram.end_leave(e)
            self.stats.evicted_already_stored += 1
            return
        if len(chain) > budget or not all(c.ready for c in chain):
            self.dram.end_leave(e)
            self.stats.demotions_dropped += 1
            return
        reserved: list[Entry] = []
        for c in chain:
            r = self.catalog.reserve(g, c.key, c.parent.key if c.parent is not None else None)
            if not isinstance(r, Entry):
                for done in reversed(reserved):
                    self.catalog.index.abort(done)
                self.dram.end_leave(e)
                self.stats.demotions_dropped += 1
                return
            reserved.append(r)
        ancestors = self.dram.pin(g, [c.key for c in chain[:-1]])
        ops = [TierOp(g, c.slot, c.key, c.parent.key if c.parent is not None else None)
               for c in chain]
        job = TierJob(next(self._job_ids), TierJobKind.DEMOTE, ops)
        self.jobs[job.job_id] = _TierJobState(job, reserved, ancestors, leaving=e)
        self._leaving[g] += 1
        self._pending_chunks += len(ops)
        self._queued.append(job)

    # -- promotion --------------------------------------------------------------------------
    def discovering(self, req_id: str, keys: Sequence[bytes], num_tokens: int) -> bool:
        """Whether the tier is still finding out which of this request's chunks it holds:
        the lookup defers and asks again (the scheduler's preparation bound applies); then
        :meth:`promote` is asked once. This tier's catalog is local: it always knows."""
        return False

    def forget_request(self, req_id: str) -> None:
        """The request finished or was aborted: drop what was kept for its lookups."""

    @property
    def pending_chunks(self) -> int:
        """Chunks of this tier's jobs queued or in flight (its own budget)."""
        return self._pending_chunks

    def read_bytes(self, todo: Sequence[tuple[int, Sequence[int]]]) -> int:
        """Bytes one rank reads from this tier for ``todo`` (chunk indices per group)."""
        return sum(self.tier.chunk_bytes[g] * len(js) for g, js in todo)

    def start_promotion(self, req_id: str, keys: Sequence[bytes],
                        todo: Sequence[tuple[int, Sequence[int]]]) -> TierJob | None:
        """Reserve DRAM slots for ``todo`` (chunks this tier holds, per group, parents
        first) and queue the job that reads them (None: no slot could be reserved). Which
        chunks, and whether it pays, is decided by :class:`kvtier.tiers.stack.TierStack`."""
        ops: list[TierOp] = []
        dram: list[Entry] = []
        cat: list[Entry] = []
        for g, js in todo:
            for j in js:
                parent = keys[j - 1] if j else None
                e = self.dram.reserve(g, keys[j], parent)
                if not isinstance(e, Entry):
                    break  # DRAM is full of pinned or writing chunks: promote what fits
                dram.append(e)
                cat += self.catalog.index.pin(g, [keys[j]])
                ops.append(TierOp(g, e.slot, keys[j], parent))
        if not ops:
            return None
        job = TierJob(next(self._job_ids), TierJobKind.PROMOTE, ops)
        self.jobs[job.job_id] = _TierJobState(job, cat, dram, req_id=req_id)
        self._pending_chunks += len(ops)
        self._queued.append(job)
        return job

    def note_saved(self, entry: Entry) -> None:
        """A save committed ``entry`` to DRAM (a write-through tier copies it; this one waits
        for eviction)."""

    # -- the step and completions -----------------------------------------------------------
    def take_plan(self, saves: int = 0) -> TierPlan | None:
        """The step's tier jobs; ``saves``: chunks this step saves."""
        self.plan_demotions(saves)
        jobs, self._queued = self._queued, []
        deletes = self.catalog.take_deletes()
        if deletes:
            jobs.append(TierJob(0, TierJobKind.DELETE, deletes))  # no completion
        if not jobs:
            return None
        return TierPlan(self.tier.root, self.tier.namespace, jobs, name=self.tier.name)

    def on_report(self, report: TierReport) -> None:
        self.stats.tier_full += report.full
        self.stats.bytes_read += report.bytes_promoted
        self.stats.read_seconds += report.promote_seconds
        self.stats.bytes_written += report.bytes_demoted
        self.stats.write_seconds += report.demote_seconds
        for job_id, ops in report.corrupt.items():
            js = self.jobs.get(job_id)
            if js is not None:
                js.corrupt.update(ops)
        for job_id, ops in report.absent.items():
            js = self.jobs.get(job_id)
            if js is not None:
                js.absent.update(ops)
        for job_id, (ok, failed) in report.jobs.items():
            js = self.jobs.get(job_id)
            if js is None:
                raise RuntimeError(f"a worker reported unknown tier job {job_id}")
            js.ok += ok
            js.failed += failed
            if js.ok + js.failed > self.world_size:
                raise RuntimeError(f"tier job {job_id} reported more than once per rank")
            if js.ok + js.failed == self.world_size:
                self._finish(js, report)

    def _finish(self, js: _TierJobState, report: TierReport) -> None:
        del self.jobs[js.job.job_id]
        self._pending_chunks -= len(js.job.ops)
        if js.job.kind is TierJobKind.DEMOTE:
            self._finish_demotion(js)
        else:
            self._finish_promotion(js, report)

    def _finish_demotion(self, js: _TierJobState) -> None:
        for e in js.catalog_entries:
            if js.failed:
                self.catalog.index.abort(e)
            elif self.catalog.index.commit(e):
                self.stats.demotions += 1
        if js.failed:
            self.stats.demotion_jobs_failed += 1
        assert js.leaving is not None
        chain = [*js.dram_entries, js.leaving]  # the job's ops, in order
        for i in sorted(js.corrupt):  # bad bytes in DRAM: forget them and what hangs below
            self.dram.discard(chain[i])
            self.stats.demotions_corrupt += 1
        self.dram.unpin(js.dram_entries)
        self._leaving[js.leaving.group] -= 1
        self.dram.end_leave(js.leaving)

    def _finish_promotion(self, js: _TierJobState, report: TierReport) -> None:
        self.catalog.index.unpin(js.catalog_entries)
        for i in sorted(js.corrupt):
            self.catalog.index.discard(js.catalog_entries[i])
            self.stats.checksum_failures += 1
        for i in sorted(js.absent - js.corrupt):  # gone from the tier: forget it, a miss
            self.catalog.index.discard(js.catalog_entries[i])
            self.stats.vanished += 1
        ok = not js.failed
        # a corrupt or vanished chunk ends its group's promoted prefix; what came before it
        # is good
        missed = js.corrupt | js.absent
        first_bad: dict[int, int] = {}
        for i in sorted(missed):
            first_bad.setdefault(js.job.ops[i].group, i)
        landed = []
        for i, e in enumerate(js.dram_entries):
            bad = first_bad.get(e.group)
            if not ok and (not missed or (bad is not None and i >= bad)):
                self.dram.abort(e)
            elif self.dram.commit(e):
                self.stats.promotions += 1
                landed.append(e)
        if ok:
            for e in js.catalog_entries:
                self.catalog.index.touch(e.group, [e.key])
            if report.promote_seconds > 0:
                per_rank = report.bytes_promoted / max(1, self.world_size)
                self.tier.cost.observe(int(per_rank), len(js.job.ops),
                                       report.promote_seconds / max(1, self.world_size))
        else:
            self.stats.promotion_jobs_failed += 1
        if self.on_landed is not None:
            self.on_landed(js.req_id, js.job.job_id, landed, ok)

    def has_pending_work(self) -> bool:
        return bool(self.jobs or self._queued or self.catalog.deletes)

    def check_drained(self) -> None:
        assert not self.jobs, f"tier jobs left: {sorted(self.jobs)}"
        assert self._pending_chunks == 0 and not any(self._leaving)
        self.catalog.check_invariants()


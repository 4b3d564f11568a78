"""The lower tiers below DRAM as one stack, top first: DRAM -> disk -> remote store (either
alone, or both). What the scheduler half asks of "the tiers below DRAM" goes through here.

- **Lookups** see DRAM and every tier as one index (:class:`Tiered`): the longest contiguous
  prefix whose every chunk is in DRAM or in some tier. Each tier keeps prefixes whole (a
  chunk is stored only under its parent), so that prefix is the longest of any one of them.
  A tier still finding out what it holds (the remote tier's discovery) defers the lookup
  within the scheduler's one preparation bound, and is not asked at all when DRAM and the
  tiers above it already hold the whole prefix: a dead or slow remote store never delays a
  hit the disk serves.
- **Promotions**: every chunk of the hit DRAM lacks is read, into reserved DRAM slots, from
  the topmost tier holding it (the disk before the remote store); each tier's part is a job
  of its own, on its own I/O thread, and the promotion lands when every part did. Nothing
  is promised before it landed (:mod:`kvtier.prepare`). The cost model prices each tier by
  its own measured rate and latency (:mod:`kvtier.tiers.cost`) and takes the combination of
  tiers that saves most; a tier left out because reading it would be slower than
  recomputing counts ``declined_slower``.
- **Writes** keep each tier's measured choice: the disk takes what DRAM evicts (demotion),
  the remote store every chunk a save commits (write-through). Below the disk, the remote
  tier does not also demote on eviction: a chunk leaving DRAM goes to the disk, and the
  remote store has it from write-through already. A chunk promoted from the remote store is
  *not* written to the disk at promotion: it sits in DRAM, and when DRAM evicts it the
  disk's demotion copies it like any other chunk; writing it at once would spend disk
  bandwidth, in the very steps the promotion waits for, on chunks that may never leave DRAM.
- Each tier keeps its own catalog, queues, budget (``disk_max_pending_chunks`` each),
  circuit breaker (the remote store's) and statistics; a failed part of a promotion ends the
  hit where that tier's chunks begin, what the other tier brought still lands.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.config import KvtierConfig
from kvtier.geometry import Geometry
from kvtier.index.base import Entry
from kvtier.index.memory import MemoryIndex
from kvtier.planner import CostEstimates, Hit, find_hit, promotion_gain
from kvtier.prepare import Preparation
from kvtier.slab import SlotAllocator
from kvtier.tiers.cost import stacked_read_seconds
from kvtier.tiers.schedule import IMPROVABLE, LowerTier, TierScheduler
from kvtier.tiers.seam import TierPlan, TierReport

StackLanded = Callable[[str, int, list[Entry], Sequence[str]], None]
"""(request id, promotion id, the DRAM entries it committed, the tiers that provided nothing
to the hit: one whose part did not all land and every tier below it): the scheduler's
preparation step takes the landed chunks as prepared."""

Todo = list[tuple[int, list[int]]]
"""Per full group, the chunk indices one tier reads."""


class Tiered:
    """DRAM and some tiers as one index for :func:`find_hit`: a chunk is there if any has it
    ready (each keeps prefixes whole, so a prefix of any is restorable)."""

    def __init__(self, dram: MemoryIndex, tiers: Sequence[MemoryIndex]) -> None:
        self.dram = dram
        self.tiers = list(tiers)

    def is_ready(self, group: int, key: bytes) -> bool:
        return self.dram.is_ready(group, key) or any(t.is_ready(group, key) for t in self.tiers)

    def match(self, group: int, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if not self.is_ready(group, k):
                break
            n += 1
        return n


@dataclass
class _Candidate:
    """A promotion through some of the tiers: the hit it gives and what each tier reads."""

    tiers: tuple[TierScheduler, ...]
    hit: Hit
    todo: dict[str, Todo]
    gain: float = 0.0


@dataclass
class _Promotion:
    req_id: str
    waiting: set[int]  # tier job ids not finished yet
    landed: list[Entry] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class TierStack:
    def __init__(self, lowers: Sequence[LowerTier], dram: MemoryIndex, allocator: SlotAllocator,
                 slot_class: Sequence[int], geometry: Geometry, config: KvtierConfig,
                 estimates: CostEstimates, world_size: int, job_ids: itertools.count,
                 on_landed: StackLanded) -> None:
        self.dram = dram
        self.geometry = geometry
        self.config = config
        self.estimates = estimates
        self.on_landed = on_landed
        self.tiers: list[TierScheduler] = [
            (t.make_scheduler or TierScheduler)(
                t, dram, allocator, slot_class, geometry, config, estimates, world_size,
                job_ids, functools.partial(self._part_landed, t.name))
            for t in lowers]
        for below in self.tiers[1:]:
            below.demotes = False  # DRAM's evictions go to the tier right below it
        self._promotions: dict[int, _Promotion] = {}
        self._promotion_of: dict[int, int] = {}  # tier job id -> promotion id

    notes_saves = True  # note_saved wants each committed save (write-through, catalogs)

    def named(self, name: str) -> TierScheduler | None:
        return next((t for t in self.tiers if t.tier.name == name), None)

    # -- lookups ----------------------------------------------------------------------------
    def discovering(self, req_id: str, keys: Sequence[bytes], num_tokens: int) -> bool:
        """Whether a tier is still finding out which of this request's chunks it holds (the
        lookup defers). A tier is not asked when DRAM and the tiers above it hold every
        chunk of the prompt already."""
        n = min(num_tokens // self.geometry.chunk_tokens, len(keys))
        busy = False
        for i, t in enumerate(self.tiers):
            if not t.discovers:
                continue  # a local catalog always knows (no cost on the lookup)
            above = Tiered(self.dram, [u.catalog.index for u in self.tiers[:i]])
            if n and all(above.match(g, keys[:n]) == n for g in self.geometry.full_groups):
                break
            busy = t.discovering(req_id, keys, num_tokens) or busy
        return busy

    def forget_request(self, req_id: str) -> None:
        for t in self.tiers:
            t.forget_request(req_id)

    def promote(self, req_id: str, keys: Sequence[bytes], num_tokens: int, hbm_tokens: int,
                dram_hit: Hit) -> tuple[int, int, dict[str, int]] | None:
        """Start a promotion for this lookup if the tiers extend ``dram_hit`` and that pays:
        (its id, the tokens it adds to the DRAM hit, those tokens per tier name); the lookup
        defers. None: no promotion (the caller asks once per request lifecycle)."""
        if dram_hit.reason not in IMPROVABLE:
            return None
        have = dram_hit.boundary if dram_hit.ok else hbm_tokens // self.geometry.chunk_tokens
        every = self._candidate(tuple(self.tiers), keys, num_tokens, hbm_tokens, have)
        if every is None:
            return None
        best = every
        if self.config.cost_model:
            best = self._cheapest(every, keys, num_tokens, hbm_tokens, have, dram_hit)
            used = {name for name, todo in every.todo.items() if _chunks(todo)}
            kept = set() if best is None else {n for n, td in best.todo.items() if _chunks(td)}
            for name in used - kept:
                self.named(name).stats.declined_slower += 1  # type: ignore[union-attr]
            if best is None:
                return None
        return self._start(req_id, keys, hbm_tokens, dram_hit, best)

    def _candidate(self, tiers: tuple[TierScheduler, ...], keys: Sequence[bytes],
                   num_tokens: int, hbm_tokens: int, have: int) -> _Candidate | None:
        """The promotion through ``tiers`` (None: they add nothing to DRAM's hit, or a tier's
        budget of chunks in flight is spent): each chunk DRAM lacks from the first of them
        holding it."""
        view = Tiered(self.dram, [t.catalog.index for t in tiers])
        hit = find_hit(view, self.geometry, keys, num_tokens, hbm_tokens)  # type: ignore[arg-type]
        if not hit.ok or hit.boundary <= have:
            return None
        todo: dict[str, Todo] = {t.tier.name: [] for t in tiers}
        for g in self.geometry.full_groups:
            per: dict[str, list[int]] = {t.tier.name: [] for t in tiers}
            for j in range(hit.boundary):
                if self.dram.get(g, keys[j]) is not None:
                    continue
                src = next(t for t in tiers if t.catalog.index.is_ready(g, keys[j]))
                per[src.tier.name].append(j)
            for name, js in per.items():
                todo[name].append((g, js))
        for t in tiers:
            n = sum(len(js) for _, js in todo[t.tier.name])
            if t.pending_chunks + n > self.config.disk_max_pending_chunks:
                return None
        return _Candidate(tiers, hit, todo)

    def _cheapest(self, every: _Candidate, keys: Sequence[bytes], num_tokens: int,
                  hbm_tokens: int, have: int, dram_hit: Hit) -> _Candidate | None:
        """Of the promotions through every combination of tiers, the one that saves most
        beyond the DRAM hit; None if none saves anything."""
        best: _Candidate | None = None
        for size in range(len(self.tiers), 0, -1):
            for tiers in itertools.combinations(self.tiers, size):
                c = every if size == len(self.tiers) else self._candidate(
                    tiers, keys, num_tokens, hbm_tokens, have)
                if c is None:
                    continue
                reads = [(t.tier.cost, t.read_bytes(c.todo[t.tier.name]),
                          max((len(js) for _, js in c.todo[t.tier.name]), default=0))
                         for t in tiers]
                c.gain = promotion_gain(self.geometry, c.hit, dram_hit, hbm_tokens,
                                        self.estimates, stacked_read_seconds(reads))
                if c.gain > 0 and (best is None or c.gain > best.gain):
                    best = c
        return best

    def _start(self, req_id: str, keys: Sequence[bytes], hbm_tokens: int, dram_hit: Hit,
               c: _Candidate) -> tuple[int, int, dict[str, int]] | None:
        jobs = []
        for t in c.tiers:  # top first: a lower tier's chunks hang below the upper one's
            todo = c.todo[t.tier.name]
            if _chunks(todo):
                job = t.start_promotion(req_id, keys, todo)
                if job is not None:
                    jobs.append((t.tier.name, job.job_id))
        if not jobs:
            return None
        pid = jobs[0][1]
        self._promotions[pid] = _Promotion(req_id, {j for _, j in jobs})
        for _, j in jobs:
            self._promotion_of[j] = pid
        added = c.hit.tokens - dram_hit.tokens
        by = self._tokens_by_tier(c, hbm_tokens, added, {n for n, _ in jobs})
        return pid, added, by

    def _tokens_by_tier(self, c: _Candidate, hbm_tokens: int, added: int,
                        started: set[str]) -> dict[str, int]:
        """The promotion's ``added`` tokens per tier: each chunk position's tokens within the
        hit go to the lowest tier reading it; what DRAM held but could not give alone (its
        own hit was declined) goes to the first tier read, as with one tier."""
        ct = self.geometry.chunk_tokens
        start, end = hbm_tokens + c.hit.tokens - added, hbm_tokens + c.hit.tokens
        owner: dict[int, str] = {}
        for t in c.tiers:
            for _, js in c.todo[t.tier.name]:
                for j in js:
                    owner[j] = t.tier.name
        by: dict[str, int] = {}
        for j, name in owner.items():
            n = max(0, min(end, (j + 1) * ct) - max(start, j * ct))
            if n and name in started:
                by[name] = by.get(name, 0) + n
        first = next((t.tier.name for t in c.tiers if t.tier.name in started), None)
        if first is not None and sum(by.values()) < added:
            by[first] = by.get(first, 0) + added - sum(by.values())
        return by

    def _part_landed(self, name: str, req_id: str, job_id: int, landed: list[Entry],
                     ok: bool) -> None:
        pid = self._promotion_of.pop(job_id, None)
        if pid is None:
            return
        p = self._promotions[pid]
        p.waiting.discard(job_id)
        p.landed += landed
        if not ok:
            p.failed.append(name)
        if not p.waiting:
            del self._promotions[pid]
            self.on_landed(p.req_id, pid, p.landed, self._lost(p.failed))

    def _lost(self, failed: Sequence[str]) -> list[str]:
        """The tiers that provided nothing: the first that failed and every one below it (a
        lower tier's chunks hang below the upper one's: an upper part that failed dooms them)."""
        names = [t.tier.name for t in self.tiers]
        first = min((names.index(n) for n in failed), default=len(names))
        return names[first:]

    # -- what a lookup's answer owes each tier ----------------------------------------------
    def answered(self, prep: Preparation | None, hit: Hit) -> dict[str, int]:
        """For a final lookup answer ``hit`` of a request prepared by ``prep``: the tiers that
        were asked (DRAM's answer was one a promotion may improve on, or a promotion was
        considered for the request) and the promised tokens each provided (those its part
        of a landed promotion brought). Tiers not asked are absent."""
        if not ((prep is not None and prep.promotion_tried) or hit.reason in IMPROVABLE):
            return {}
        left = hit.tokens if hit.ok else 0
        out: dict[str, int] = {}
        for t in self.tiers:
            n = min(left, self._landed_tokens(prep, t.tier.name))
            out[t.tier.name] = n
            left -= n
        return out

    @staticmethod
    def _landed_tokens(prep: Preparation | None, name: str) -> int:
        if prep is None or prep.promotion is not None or prep.promoted_tokens <= 0:
            return 0
        return prep.promoted_by.get(name, 0)

    def note_load(self, prep: Preparation, tokens: int) -> None:
        """A load of ``tokens`` was promised to a request prepared by ``prep``: a hit of each
        tier whose part of a landed promotion it restores."""
        for t, n in zip(self.tiers, self.answered(prep, Hit(0, tokens)).values()):
            if n:
                t.stats.hits += 1
                t.stats.hit_tokens += n

    # -- writes, the step and completions ---------------------------------------------------
    def note_saved(self, entry: Entry) -> None:
        for t in self.tiers:
            t.note_saved(entry)

    def take_plans(self, saves: int = 0) -> list[TierPlan]:
        return [p for t in self.tiers if (p := t.take_plan(saves)) is not None]

    def on_report(self, reports: dict[str, TierReport]) -> None:
        """Each tier's completions, top first: of one promotion's parts finishing in one
        step, the upper one's outcome is known when the lower one's chunks commit (those of
        a lower part under an upper part that failed then never commit; a lower part that
        finishes steps before commits, and goes when the upper one fails)."""
        unknown = set(reports) - {t.tier.name for t in self.tiers}
        if unknown:
            raise RuntimeError(f"a worker reported jobs of unknown tiers {sorted(unknown)}")
        for t in self.tiers:
            rep = reports.get(t.tier.name)
            if rep is not None and (rep.jobs or rep.full):
                t.on_report(rep)

    def reset(self) -> None:
        """Forget every tier's chunks (their copies go with the next plans' deletes)."""
        for t in self.tiers:
            t.catalog.index.reset()

    def has_pending_work(self) -> bool:
        return any(t.has_pending_work() for t in self.tiers)

    def check_drained(self) -> None:
        assert not self._promotions, f"promotions left: {sorted(self._promotions)}"
        for t in self.tiers:
            t.check_drained()


def _chunks(todo: Todo) -> int:
    return sum(len(js) for _, js in todo)

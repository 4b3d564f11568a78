"""An engine's side of the store's tiers below its pool (:mod:`kvtier.store.tiers`: the
disk, the remote server): the scheduler's lower tier (``OffloadScheduler.tier``) when the
store moves the bytes.

Contract (the scheduler's preparation step, :mod:`kvtier.prepare`, is unchanged):

- :meth:`StorePromotions.discovering`: with a store tier that finds out what it holds by
  asking (the remote server), each lookup until the promotion is asked sends ``discover``
  (one round trip) and defers while the store waits for the server's answer; the request's
  state there ends with :meth:`StorePromotions.forget_request` (a queued request).
- :meth:`StorePromotions.promote`, asked once per request lifecycle when DRAM's answer is
  one a promotion may improve on, asks the store to promote what its tiers add (one round
  trip, only while the store has tiers for this namespace); if it does, the lookup defers
  (``None``) within ``prepare_timeout_ms`` / ``prepare_max_steps`` like a promotion of the
  engine's own tiers. The store says how many of the tokens each tier brings (the
  scheduler's ``tier_hits`` per tier name).
- :meth:`StorePromotions.take_plans` (once per step) polls the store for the promotions in
  flight and hands the landed ones to the scheduler (``on_landed``, with no entries: the
  store leased the promoted chunks to this engine, and the next lookup finds them as DRAM
  hits). A promotion of a lost epoch (the store went away) lands failed. The workers get no
  tier job: the store did the I/O.
- Counters: ``stats`` (promotions, hits) as a :class:`~kvtier.tiers.schedule.TierStats`;
  ``catalog`` reads the store's numbers for the disk gauges.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.geometry import Geometry
from kvtier.planner import Hit
from kvtier.prepare import Preparation
from kvtier.store.index import StoreIndex
from kvtier.tiers.catalog import TierCatalog
from kvtier.tiers.cost import TierCost
from kvtier.tiers.schedule import IMPROVABLE, LowerTier, TierStats
from kvtier.tiers.seam import TierPlan, TierReport
from kvtier.tiers.stack import StackLanded

TIER_NAME = "disk"


STATS_MAX_AGE_S = 1.0
"""The disk gauges read the store's numbers at most this often (metrics are read every
step; a round trip per gauge per step would cost the step loop)."""


class StoreCatalog:
    """The store's disk catalog of this namespace, as the disk gauges read it (at most
    :data:`STATS_MAX_AGE_S` old)."""

    def __init__(self, index: StoreIndex, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = self  # OffloadScheduler.reset resets ``tier.catalog.index``
        self._store = index
        self._clock = clock
        self._cached: dict[str, Any] = {}
        self._until = 0.0

    def _stats(self) -> dict[str, Any]:
        now = self._clock()
        if now >= self._until:
            self._until = now + STATS_MAX_AGE_S
            self._cached = (self._store.disk_stats() if self._store.has_lower else None) or {}
        return self._cached

    def stored(self, group: int) -> int:
        stored = self._stats().get("stored", [])
        return int(stored[group]) if group < len(stored) else 0

    @property
    def capacity(self) -> int:
        return int(self._stats().get("capacity", 0))

    def reset(self) -> int:
        return 0  # the store's reset (the scheduler resets its index) empties its disk too


class StorePromotions:
    """What the scheduler drives in place of a :class:`~kvtier.tiers.stack.TierStack` for an
    engine attached to the store: the one tier below DRAM is the store's own disk, whose
    promotions the store runs (no worker moves a byte). Built with TierStack's arguments
    (:attr:`LowerTier.make_stack`), it is the stack and its one tier at once (``tiers``)."""

    notes_saves = False  # the store demotes on its own: commits need no answer

    def __init__(self, lowers: Sequence[LowerTier], dram: StoreIndex, _allocator: object,
                 _slot_class: object, geometry: Geometry, _config: object, _estimates: object,
                 _world_size: int, _job_ids: object,
                 on_landed: StackLanded | None = None) -> None:
        self.tier = lowers[0]
        self.tiers = [self]
        self.index = dram
        self.geometry = geometry
        self.on_landed = on_landed
        self.stats = TierStats()
        self.catalog = StoreCatalog(dram)
        self.waiting: dict[int, tuple[str, int]] = {}  # store's job -> (request, epoch)
        self._asked: set[str] = set()  # requests the store's discovery keeps state for

    def named(self, name: str) -> StorePromotions | None:
        return self if name == TIER_NAME else None

    # -- lookups ----------------------------------------------------------------------------
    def discovering(self, req_id: str, keys: Sequence[bytes], num_tokens: int) -> bool:
        """While the store's remote tier finds out what it holds for this request (one
        round trip per lookup, only with a tier that discovers): the lookup defers."""
        if not self.index.discovers:
            return False  # a local tier's catalog always knows: promote() answers at once
        self._asked.add(req_id)
        return self.index.discover(req_id, keys, num_tokens)

    def promote(self, req_id: str, keys: Sequence[bytes], num_tokens: int, hbm_tokens: int,
                dram_hit: Hit) -> tuple[int, int, dict[str, int]] | None:
        """As :meth:`TierStack.promote`: (the store's job, the tokens it adds, per tier)."""
        if dram_hit.reason not in IMPROVABLE or not self.index.has_lower:
            return None
        c = self.geometry.chunk_tokens
        most = min((num_tokens - 1) // c, len(keys))  # a hit never covers the last token
        if most <= 0:
            return None
        started = self.index.promote(keys[:most], num_tokens, hbm_tokens)
        if started is None:
            return None
        job, added, by = started
        self.waiting[job] = (req_id, self.index.epoch)
        return job, added, by

    def answered(self, prep: Preparation | None, hit: Hit) -> dict[str, int]:
        """As :meth:`TierStack.answered`, over the store's tiers; {} while it has none."""
        if not self.index.has_lower:
            return {}
        asked = (prep is not None and prep.promotion_tried) or hit.reason in IMPROVABLE
        if not asked:
            return {}
        landed = prep is not None and prep.promotion is None and prep.promoted_tokens > 0
        left = hit.tokens if hit.ok else 0
        out: dict[str, int] = {}
        for name in self.index.tier_names:
            n = min(left, prep.promoted_by.get(name, 0)) if landed else 0  # type: ignore[union-attr]
            out[name] = n
            left -= n
        return out

    def note_load(self, prep: Preparation, tokens: int) -> None:
        if prep.promotion is None and prep.promoted_tokens:
            self.stats.hits += 1
            self.stats.hit_tokens += min(tokens, prep.promoted_tokens)

    # -- the step ---------------------------------------------------------------------------
    def take_plans(self, saves: int = 0) -> list[TierPlan]:
        """Poll the store for landed promotions (never a worker job: the store moves bytes)."""
        if not self.waiting:
            return []
        epoch = self.index.epoch
        lost = [j for j, (_, e) in self.waiting.items() if e != epoch or not self.index.up]
        live = [j for j in self.waiting if j not in lost]
        done = self.index.promoted(live) if live else {}
        if done is None:
            lost, done = list(self.waiting), {}
        for j, ok in [*((j, False) for j in lost), *done.items()]:
            req_id, _ = self.waiting.pop(j)
            if ok:
                self.stats.promotions += 1
            else:
                self.stats.promotion_jobs_failed += 1
            if self.on_landed is not None:
                self.on_landed(req_id, j, [], [] if ok else
                               list(self.index.tier_names or (TIER_NAME,)))
        return []

    def note_saved(self, entry: object) -> None:
        pass  # the store demotes on its own

    def on_report(self, reports: dict[str, TierReport]) -> None:
        if reports:
            raise RuntimeError(f"a worker reported jobs of store tiers {sorted(reports)}")

    def forget_request(self, req_id: str) -> None:
        """Its promotion still lands (for later requests; on_landed then finds no one); the
        store drops what its discovery kept for the request."""
        if req_id in self._asked:
            self._asked.discard(req_id)
            self.index.forget(req_id)

    def reset(self) -> None:
        pass  # the store's reset (the scheduler resets its index) empties its disk too

    def has_pending_work(self) -> bool:
        return bool(self.waiting)

    def check_drained(self) -> None:
        assert not self.waiting, f"store promotions in flight: {sorted(self.waiting)}"


def store_lower(namespace: bytes, geometry: Geometry) -> LowerTier:
    """The scheduler's ``lower`` for an engine attached to the store: driven by
    :class:`StorePromotions` (the catalog and cost here are placeholders no one reads)."""
    return LowerTier(TIER_NAME, "", namespace, TierCatalog(len(geometry.groups), 1),
                     TierCost(1.0, 0.0), [], make_stack=StorePromotions)

"""Cache-aware admission in the connector (``cache_aware_admission``): what vLLM's scheduler
state says about a waiting request, handed to :class:`kvtier.deferral.Deferrals`.

Contract:
- it decides before kvtier's lookup (a deferred request costs no lookup), from vLLM's local
  hit alone;
- *waits for a producer*: a running request computes or loads, into HBM, the chunk right
  after this request's HBM hit (:meth:`kvtier.scheduler.OffloadScheduler.produced_until`);
- *fits*: vLLM's block pool has at least as many free blocks (evictable cached ones included),
  less the room held for the producers' waiters (below), as the request needs beyond its HBM
  hit in every KV-cache group (vLLM admits a request only
  when its whole prompt fits, ``scheduler_reserve_full_isl``, on by default in 0.25.1 and
  0.32; a state group in ``align`` mode takes one block for a new request); the hit's own
  cached blocks that are evictable are not subtracted, so it errs towards *fits* (then vLLM
  stops its scan at the request, as without admission);
- a request whose HBM hit covers at least half its prompt counts as fitting (*warm*): it needs
  little beyond its hit, so when even that does not fit, the requests behind it rarely would;
  vLLM's scan stops at it and it goes first once room appears, as without admission. Deferring
  it would also cost the most: vLLM walks its whole HBM hit again every step it is scanned
  (H200, Llama-8B shape, 17k-token prompts: about 0.5 ms a deferral, 1.2 s of scheduler time
  in an 8.2 s run);
- *room held for the producers' waiters*: a request that waits for a producer will need, once
  its hit has grown to what the producers put into HBM
  (:meth:`kvtier.scheduler.OffloadScheduler.produced_until`), the blocks beyond that point;
  those blocks are held back from every other request's *fits* while it waits (deferred in
  this step or the one before), so that a request of another prefix does not take the room
  the waiters need;
- *look ahead at tight room*: a cold request that fits but would leave fewer free blocks than
  it takes waits the first time it is asked, and while running requests compute or load
  prompt chunks into HBM (and the step after): vLLM scans its waiting queue in order and
  stops the scan once a step's token budget is spent (a long prefill spends it every step),
  so the siblings behind the request, which wait for those chunks and hold room for what
  they need beyond them, are asked only in the step the producer's prefill ends, after the
  request. Without it the next prefix's request was admitted in that step, before any
  sibling had been asked, and with HBM for two prompts (H200, DeepSeek-V2-Lite shape, 560
  blocks of 64 tokens, 17k-token prompts) the run went two prompts of different prefixes at
  a time, their siblings never fitting beside them (812 engine steps against 55 with HBM
  for all; its CPU model 364 steps, 144 with the look-ahead);
- *busy*: the last step scheduled tokens, or kvtier has loads in flight;
- a request that skips the prefix cache is never deferred (0.32 forces its hit to 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.deferral import DeferralLimits, Deferrals, Situation
from kvtier.layout import GroupKind, GroupSpec


def blocks_needed(groups: Sequence[GroupSpec], num_tokens: int, hbm_tokens: int) -> int:
    """Blocks vLLM allocates for a new request of ``num_tokens`` tokens whose first
    ``hbm_tokens`` hit its prefix cache, summed over the KV-cache groups."""
    total = 0
    for g in groups:
        if g.kind is GroupKind.STATE:
            total += 1  # align mode: one block for the running state
            continue
        need = -(-num_tokens // g.block_size) - hbm_tokens // g.block_size
        if g.kind is GroupKind.SLIDING_WINDOW and g.sliding_window:
            need = min(need, -(-g.sliding_window // g.block_size) + 1)
        total += max(need, 0)
    return total


def _fits(room: tuple[int, int] | None) -> bool:
    """``room`` as :meth:`Admission._room` gives it: None (warm) fits."""
    return room is None or room[0] >= room[1]


class Admission:
    def __init__(self, config: KvtierConfig, priority: bool,
                 groups: Sequence[GroupSpec]) -> None:
        self.deferrals = Deferrals(DeferralLimits(int(config.defer_max_steps),
                                                  float(config.defer_max_ms),
                                                  int(config.defer_max_requests)))
        self.priority = priority
        self.groups = list(groups)
        self.pool: Any = None
        self.step = 0
        self.busy = False
        self.waited_for_producer = 0  # deferrals because a running request produces the chunk
        self.waited_for_room = 0  # deferrals because HBM could not hold the request
        self.looked_ahead = 0  # look-ahead deferrals of a request that leaves little room
        self._producing_step = -2  # the last step after which a request produced chunks
        # request -> (blocks it needs once its producers are done, step it last waited in)
        self._held: dict[str, tuple[int, int]] = {}

    def bind_pool(self, pool: Any) -> None:
        self.pool = pool

    def step_planned(self, scheduler_output: Any, loading: bool,
                     producing: bool = False) -> None:
        """After each of vLLM's scheduling passes (``build_connector_meta``); ``producing``:
        some running request computes or loads prompt chunks into HBM."""
        self.step += 1
        self.busy = bool(getattr(scheduler_output, "total_num_scheduled_tokens", 0)) or loading
        if producing:
            self._producing_step = self.step

    def fits(self, num_tokens: int, hbm_tokens: int, held: int = 0) -> bool:
        """Whether the pool's free blocks, less ``held`` of them, hold what a request of
        ``num_tokens`` needs beyond its HBM hit (a warm request always fits)."""
        return _fits(self._room(num_tokens, hbm_tokens, held))

    def _room(self, num_tokens: int, hbm_tokens: int, held: int) -> tuple[int, int] | None:
        """(free blocks less ``held``, blocks needed beyond the hit), or None for a warm
        request or before the pool is bound."""
        if self.pool is None or 2 * hbm_tokens >= num_tokens:
            return None
        return (int(self.pool.get_num_free_blocks()) - held,
                blocks_needed(self.groups, num_tokens, hbm_tokens))

    def held_blocks(self, for_req: str | None = None) -> int:
        """Blocks held for the requests waiting for a producer (in this step or the one
        before), other than ``for_req``."""
        return sum(n for r, (n, step) in self._held.items()
                   if r != for_req and step >= self.step - 1)

    @property
    def may_defer(self) -> bool:
        """Whether any lookup may be deferred now: the cheap test a caller makes before it
        asks who produces the request's next chunk (:class:`Situation` holds the rule)."""
        return not self.priority and self.busy

    def defer(self, request: Any, hbm_tokens: int, produced_until: int = 0) -> bool:
        """Whether to answer this lookup with ``None`` (asked again next step).
        ``produced_until``: where the request's hit will reach once running requests have
        put the chunks after it into HBM (0: nobody produces its next chunk)."""
        req_id, num_tokens = request.request_id, int(request.num_tokens)
        waits = produced_until > hbm_tokens
        room = self._room(num_tokens, hbm_tokens, self.held_blocks(req_id))
        fits = _fits(room)
        tight = fits and room is not None and not waits and room[0] - room[1] < room[1]
        look_ahead = tight and (self.deferrals.deferred_steps(req_id) == 0
                                or self._producing_step >= self.step - 1)
        situation = Situation(waits_for_producer=waits, fits=fits, busy=self.busy,
                              priority=self.priority, look_ahead=look_ahead)
        deferred = self.deferrals.defer(req_id, self.step, situation)
        if deferred and waits:
            self._held[req_id] = (blocks_needed(self.groups, num_tokens, produced_until),
                                  self.step)
        else:
            self._held.pop(req_id, None)
        if deferred:
            if waits:
                self.waited_for_producer += 1
            elif not fits:
                self.waited_for_room += 1
            else:
                self.looked_ahead += 1
        return deferred

    def counters(self) -> dict[str, int]:
        d = self.deferrals
        return {"admission_deferred": d.deferred, "admission_expired": d.expired,
                "admission_declined_full": d.declined_full,
                "admission_waited_for_producer": self.waited_for_producer,
                "admission_waited_for_room": self.waited_for_room,
                "admission_looked_ahead": self.looked_ahead}

    def forget(self, req_id: str) -> None:
        self.deferrals.forget(req_id)
        self._held.pop(req_id, None)

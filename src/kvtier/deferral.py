"""Cache-aware admission: while HBM is short, a bounded deferral of waiting requests whose
prefix is neither in HBM nor loading, so that the requests behind them that share a resident
or loading prefix run first, together.

vLLM admits waiting requests first come, first served and stops at the first one it cannot
allocate: a cold request at the head of the queue holds back warm ones that would fit. A
connector can move a request out of that step's scan by answering its lookup with ``None``
(vLLM 0.25.1 ``v1/core/sched/scheduler.py:744-750``, 0.32 the same): it joins the step's
skipped queue, is scanned first next step, and is asked again.

Contract (:meth:`Deferrals.defer`):
- never defers a warm request (a local HBM hit, or a kvtier hit: stored or loading), under
  vLLM's priority policy, while nothing is running or loading, or while HBM is not short;
- a request is deferred in at most ``max_steps`` distinct engine steps and for at most
  ``max_ms`` milliseconds from its first deferral; past either bound it is never deferred
  again (starvation-free whatever the workload);
- at most ``max_deferred`` requests are deferred at once (deferred in this step or the one
  before, :meth:`active`): each one costs a lookup per step,
  so the bound keeps the deferrals inside the planner's per-step budget;
- :meth:`forget` drops a finished request's record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeferralLimits:
    max_steps: int
    max_ms: float
    max_deferred: int


@dataclass(frozen=True)
class Situation:
    """What the connector knows when vLLM asks about a waiting request."""

    warm: bool  # its prefix is in HBM or in kvtier (stored or loading)
    hbm_short: bool  # HBM cannot hold it now
    busy: bool  # some request is running or loading
    priority: bool  # vLLM's priority scheduling policy


@dataclass
class _Record:
    first_step: int
    first_s: float
    steps: set[int] = field(default_factory=set)
    expired: bool = False


class Deferrals:
    def __init__(self, limits: DeferralLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._records: dict[str, _Record] = {}
        self.deferred = 0  # lookups answered "not now", ever
        self.expired = 0  # requests that reached a bound, ever
        self.declined_full = 0  # deferrals refused: max_deferred already deferred

    def defer(self, req_id: str, step: int, s: Situation) -> bool:
        """Whether to answer this lookup of ``req_id`` in engine ``step`` with "not now"."""
        rec = self._records.get(req_id)
        if rec is not None and rec.expired:
            return False
        if s.warm or s.priority or not s.busy or not s.hbm_short:
            return False
        now = self.clock()
        if rec is None:
            if self.active(step) >= self.limits.max_deferred:
                self.declined_full += 1
                return False
            rec = self._records[req_id] = _Record(step, now)
        new_step = step not in rec.steps
        if ((new_step and len(rec.steps) >= self.limits.max_steps)
                or (now - rec.first_s) * 1000.0 >= self.limits.max_ms):
            rec.expired = True
            self.expired += 1
            return False
        rec.steps.add(step)
        self.deferred += 1
        return True

    def active(self, step: int) -> int:
        """Requests deferred in this step or the one before (still waiting on a deferral),
        not past a bound."""
        return sum(1 for r in self._records.values()
                   if not r.expired and r.steps and max(r.steps) >= step - 1)

    def deferred_steps(self, req_id: str) -> int:
        rec = self._records.get(req_id)
        return len(rec.steps) if rec is not None else 0

    def forget(self, req_id: str) -> None:
        self._records.pop(req_id, None)

"""Cache-aware admission: a bounded deferral of waiting requests, so that requests sharing a
prefix that is in HBM, or on its way there, run together and nothing is computed or loaded
twice while HBM is short.

vLLM admits waiting requests first come, first served and stops at the first one it cannot
allocate: a request at the head of the queue that does not fit holds back those behind it that
would. And vLLM shares a prefix between requests only once its blocks are in the prefix cache:
a request admitted while another one is still computing (chunked prefill) or loading the same
prefix computes or loads it again into blocks of its own. A connector can move a request out of
a step's scan by answering its lookup with ``None`` (vLLM 0.25.1
``v1/core/sched/scheduler.py:744-750``, 0.32 the same): it joins the step's skipped queue, is
scanned first next step, and is asked again.

Contract (:meth:`Deferrals.defer`): a request is deferred when
- the chunk right after its HBM hit is being computed or loaded by a running request
  (:mod:`kvtier.production`; it gets that chunk from vLLM's prefix cache once it landed), or
- HBM cannot hold it now beside what the requests waiting for a producer will need (vLLM's
  scan would stop at it, or it would take their room: the requests behind it go first), or
- it would leave less room than it takes while the scan may not yet have seen what waits
  behind it (its first ask, or while running requests produce chunks into HBM);

and never under vLLM's priority policy, or while nothing is running or loading (then nothing
would change by waiting). Bounds:
- a request is deferred in at most ``max_steps`` distinct engine steps and for at most
  ``max_ms`` milliseconds from its first deferral; past either bound it is never deferred
  again (starvation-free whatever the workload);
- at most ``max_deferred`` requests are deferred at once (deferred in this step or the one
  before, :meth:`active`): each one is asked again every step;
- :meth:`forget` drops a finished request's record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DeferralLimits:
    max_steps: int
    max_ms: float
    max_deferred: int


@dataclass(frozen=True)
class Situation:
    """What the connector knows when vLLM asks about a waiting request."""

    waits_for_producer: bool  # a running request computes or loads its next chunk into HBM
    fits: bool  # HBM can hold what it needs beyond its HBM hit now, beside the room held
    # for requests that wait for a producer (kvtier.vllm.admission)
    busy: bool  # some request is running or loading
    priority: bool  # vLLM's priority scheduling policy
    # it fits but would leave less room than it takes, and the scan may not yet have seen
    # what waits behind it (its first ask, or chunks are being produced into HBM): waiting
    # lets the scan reach the requests that wait for a producer and learn the room they
    # need (kvtier.vllm.admission)
    look_ahead: bool = False

    @property
    def wants_deferral(self) -> bool:
        """Whether waiting helps, before the bounds."""
        return (not self.priority and self.busy
                and (self.waits_for_producer or not self.fits
                     or self.look_ahead))


@dataclass
class _Record:
    first_s: float
    steps: int = 0  # distinct engine steps it was deferred in (steps only grow)
    last_step: int = -1
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
        if not s.wants_deferral:
            return False
        now = self.clock()
        if rec is None:
            if self.active(step) >= self.limits.max_deferred:
                self.declined_full += 1
                return False
            rec = self._records[req_id] = _Record(now)
        new_step = step != rec.last_step
        if ((new_step and rec.steps >= self.limits.max_steps)
                or (now - rec.first_s) * 1000.0 >= self.limits.max_ms):
            rec.expired = True
            self.expired += 1
            return False
        if new_step:
            rec.steps += 1
            rec.last_step = step
        self.deferred += 1
        return True

    def active(self, step: int) -> int:
        """Requests deferred in this step or the one before (still waiting on a deferral),
        not past a bound."""
        return sum(1 for r in self._records.values()
                   if not r.expired and r.steps and r.last_step >= step - 1)

    def deferred_steps(self, req_id: str) -> int:
        rec = self._records.get(req_id)
        return rec.steps if rec is not None else 0

    def forget(self, req_id: str) -> None:
        self._records.pop(req_id, None)

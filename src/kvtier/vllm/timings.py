"""The scheduler half's histogram observations (:data:`kvtier.vllm.counters.HISTOGRAMS`):
how long each lookup call took, and how long each request waited parked for its load.

Contract: :meth:`SchedulerTimings.take` returns the observations since the last call under
their ``obs_`` stats keys and forgets them; a load that never reports its end (the request
finished or was aborted first) is dropped by :meth:`forget`, never observed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvtier.vllm.counters import obs_key
from kvtier.vllm.stats import add_observations

LOOKUP = obs_key("lookup_seconds")
LOAD_WAIT = obs_key("load_wait_seconds")


class SchedulerTimings:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._observed: dict[str, list[float]] = {}
        self._load_started: dict[str, float] = {}

    def lookup(self, seconds: float) -> None:
        add_observations(self._observed, {LOOKUP: [seconds]})

    def load_started(self, req_id: str) -> None:
        """vLLM allocated the blocks of a load and parks the request (a second call for the
        same load, vLLM's second allocation after it, keeps the first time)."""
        self._load_started.setdefault(req_id, self.clock())

    def loads_ended(self, req_ids: Iterable[str]) -> None:
        """Every rank reported these requests' loads (vLLM's ``finished_recving``)."""
        now = self.clock()
        waited = [now - self._load_started.pop(r) for r in req_ids if r in self._load_started]
        if waited:
            add_observations(self._observed, {LOAD_WAIT: waited})

    def forget(self, req_id: str) -> None:
        self._load_started.pop(req_id, None)

    def take(self) -> dict[str, list[float]]:
        observed, self._observed = self._observed, {}
        return observed

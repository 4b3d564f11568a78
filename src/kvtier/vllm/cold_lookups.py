"""Cache-aware admission in the connector (``defer_cold_requests``): what vLLM's scheduler
state says about a lookup, handed to :class:`kvtier.deferral.Deferrals`.

Contract:
- a lookup is *cold* when vLLM's local hit is 0 and kvtier's answer is 0 (a kvtier hit, a
  load in flight or a hit being prepared is warm);
- HBM is *short* when vLLM's block pool has fewer free blocks (evictable cached ones
  included) than the request needs from scratch in every KV-cache group: vLLM could not
  allocate it this step anyway, and FCFS would stop at it;
- *busy*: the last step scheduled tokens, or kvtier has loads in flight;
- a request that skips the prefix cache is never deferred (0.32 forces its hit to 0).
"""

from __future__ import annotations

from typing import Any

from kvtier.config import KvtierConfig
from kvtier.deferral import DeferralLimits, Deferrals, Situation


class ColdLookups:
    def __init__(self, config: KvtierConfig, priority: bool, block_sizes: list[int]) -> None:
        self.deferrals = Deferrals(DeferralLimits(int(config.defer_max_steps),
                                                  float(config.defer_max_ms),
                                                  int(config.defer_max_requests)))
        self.priority = priority
        self.block_sizes = block_sizes
        self.pool: Any = None
        self.step = 0
        self.busy = False

    def bind_pool(self, pool: Any) -> None:
        self.pool = pool

    def step_planned(self, scheduler_output: Any, loading: bool) -> None:
        """After each of vLLM's scheduling passes (``build_connector_meta``)."""
        self.step += 1
        self.busy = bool(getattr(scheduler_output, "total_num_scheduled_tokens", 0)) or loading

    def blocks_needed(self, num_tokens: int) -> int:
        return sum(-(-num_tokens // bs) for bs in self.block_sizes)

    def hbm_short(self, num_tokens: int) -> bool:
        if self.pool is None:
            return False
        return int(self.pool.get_num_free_blocks()) < self.blocks_needed(num_tokens)

    def defer(self, request: Any, local_hit: int, kvtier_hit: int) -> bool:
        """Whether to answer this lookup with ``None`` (asked again next step)."""
        situation = Situation(warm=local_hit > 0 or kvtier_hit != 0,
                              hbm_short=self.hbm_short(int(request.num_tokens)),
                              busy=self.busy, priority=self.priority)
        return self.deferrals.defer(request.request_id, self.step, situation)

    def forget(self, req_id: str) -> None:
        self.deferrals.forget(req_id)

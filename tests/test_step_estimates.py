"""The step and prefill estimates the connector's scheduler half feeds the planner: a step's
time is what the engine spent on it, never the idle time before it (no requests, no steps),
through the connector's own hooks on a configuration without an engine."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from kvtier.vllm.metadata import KvtierWorkerMetadata
from tests.test_connector_drafts import BLOCK, CHUNK, _request, _scheduler_connector

IDLE_S = 0.5


def _new_request_step(req: Any) -> Any:
    """vLLM's scheduler output of a step that schedules only the whole prompt of ``req``."""
    blocks = list(range(1, req.num_tokens // BLOCK + 2))
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(blocks,))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
        num_scheduled_tokens={req.request_id: req.num_tokens})


def test_a_step_after_idle_time_is_timed_from_when_it_was_scheduled() -> None:
    c = _scheduler_connector(None)
    est = c.scheduler_side.scheduler.estimates
    step_before, prefill_before = est.step_seconds, est.prefill_seconds_per_token
    time.sleep(IDLE_S)  # the engine idles: no requests, so vLLM runs no steps
    req = _request("a", [(5 * i) % 700 + 1 for i in range(2 * CHUNK + 3)])
    c.on_new_request(req)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    c.build_connector_meta(_new_request_step(req))
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KvtierWorkerMetadata()))
    # the step took well under the idle time: the estimates moved by a fraction of that
    assert est.step_seconds < step_before + est.alpha * IDLE_S / 10
    assert est.prefill_seconds_per_token < (
        prefill_before + est.alpha * IDLE_S / req.num_tokens / 10)

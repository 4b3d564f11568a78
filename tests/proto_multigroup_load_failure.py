"""vLLM 0.25.1's side of the multi-group load-failure rules, without kvtier
(docs/notes/hybrid-loads-025.md): why kvtier never reports blocks with several groups and
never truncates to a local hit of 0. kvtier's own mechanism is tested through its real
connector in tests/test_vllm025_multigroup_loads.py (which superseded this prototype's
truncation-at-48 scenario).

Runs vLLM's real scheduler with two KV-cache groups (full attention + sliding window, the
window longer than any prompt so both groups keep every block) and a minimal scheduler-side
connector that implements option (a): a failed async load is reported as finished, and in
``update_connector_output`` (which runs before the next ``schedule()`` promotes the request)
the connector truncates the request's ``num_computed_tokens`` to the last valid boundary.

    cd tests && PYTHONPATH=../.cache/vllm-0.25.1:. python -m proto_multigroup_load_failure

Prints one JSON line: per scenario, what happened. Scenarios:
- ``per_block_report``: vLLM's own path, ``invalid_block_ids`` with two groups (the crash).
- ``truncate_zero_with_local_hit``: the first block fails (boundary 0) while another request
  cached the same prefix meanwhile: 0.25.1 cannot take it (vLLM frees blocks on this path,
  a connector cannot).
"""

from __future__ import annotations

import json
import traceback
from typing import Any

import torch
import vllm
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.structured_output import StructuredOutputManager

from harness.compat import kv_output, make_request, model_config, runner_output

BS = 16
NUM_BLOCKS = 64
PROMPT = [100 + (7 * i) % 500 for i in range(96)]  # 6 blocks


class TruncatingConnector(KVConnectorBase_V1, SupportsHMA):
    """Scheduler side only. ``offers[req_id]`` = tokens it claims to hold (async load);
    ``failures[req_id]`` = the boundary the load fell back to (set by the test, as a worker
    report would). On the finished report it truncates ``num_computed_tokens`` to it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offers: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.requests: dict[str, Any] = {}
        self.loaded: set[str] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   **kw: Any) -> tuple[int, bool]:
        offer = self.offers.get(request.request_id, 0)
        if request.request_id in self.loaded or offer <= num_computed_tokens:
            return 0, False  # never promise twice
        return offer - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int,
                                 **kw: Any) -> None:
        if num_external_tokens:
            self.requests[request.request_id] = request

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            self.loaded.add(req_id)
            request = self.requests.pop(req_id)
            if req_id in self.failures:  # option (a): truncate before the next schedule()
                request.num_computed_tokens = self.failures.pop(req_id)

    def build_connector_meta(self, scheduler_output: Any, **kw: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any, **kw: Any) -> tuple[bool, None]:
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any,
                                    **kw: Any) -> tuple[bool, None]:
        return False, None

    def start_load_kv(self, forward_context: Any, **kw: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str, **kw: Any) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kw: Any) -> None:
        return None

    def wait_for_save(self, **kw: Any) -> None:
        return None


def make_scheduler(with_connector: bool) -> Scheduler:
    kv = KVTransferConfig(kv_connector="TruncatingConnector", kv_role="kv_both",
                          kv_connector_module_path="proto_multigroup_load_failure",
                          kv_load_failure_policy="recompute") if with_connector else None
    cfg = VllmConfig(
        model_config=model_config(),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                         max_model_len=1024, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=kv, device_config=DeviceConfig("cpu"))
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                            sliding_window=4096)
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], swa)])
    return Scheduler(vllm_config=cfg, kv_cache_config=kvc, log_stats=True,
                     structured_output_manager=StructuredOutputManager(cfg), block_size=BS)


def step(s: Scheduler, kv: Any = None, token: int = 7) -> dict[str, int]:
    """One engine step: schedule, then a model output sampling ``token`` for every request
    whose prompt is done; returns the scheduled token counts."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[token] if s.requests[r].num_computed_tokens + out.num_scheduled_tokens[r]
               >= s.requests[r].num_prompt_tokens else [] for r in ids]
    s.update_from_output(out, runner_output(ids, sampled, kv))
    return dict(out.num_scheduled_tokens)


def crash_site(e: BaseException) -> dict[str, Any]:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    path = frame.filename.split("/vllm/", 1)[-1]
    return {"crashed": True, "error": f"{type(e).__name__}: {e}",
            "at": f"{path}:{frame.lineno}", "code": (frame.line or "").strip()}


def truncate_zero_with_local_hit() -> dict[str, Any]:
    """The first loaded block fails (boundary 0) while request ``s`` computed and cached the
    same prompt meanwhile; on retry vLLM finds a local hit for a request that still holds
    its blocks."""
    s = make_scheduler(with_connector=True)
    conn = s.connector
    conn.offers["r"] = 80
    s.add_request(make_request("r", PROMPT, max_tokens=2))
    step(s)
    s.add_request(make_request("s", PROMPT, max_tokens=1))
    step(s)  # s computes and caches the prompt
    conn.failures["r"] = 0
    try:
        step(s, kv_output({"r"}, None, set(), None, None))
        step(s)
        return {"crashed": False}
    except BaseException as e:
        return crash_site(e)


def per_block_report() -> dict[str, Any]:
    """vLLM 0.25.1's own path: ``invalid_block_ids`` for a parked request, two groups."""
    s = make_scheduler(with_connector=True)
    s.connector.offers["r"] = 80
    s.add_request(make_request("r", PROMPT, max_tokens=2))
    step(s)
    bad = s.kv_cache_manager.get_block_ids("r")[0][3]
    try:
        step(s, kv_output({"r"}, None, {bad}, None, None))
        return {"crashed": False}
    except BaseException as e:
        return crash_site(e)


def main() -> None:
    results = {"version": vllm.__version__,
               "truncate_zero_with_local_hit": truncate_zero_with_local_hit(),
               "per_block_report": per_block_report()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()

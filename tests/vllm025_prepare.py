"""Prepare before promise on vLLM 0.25.1's real scheduler with two KV-cache groups (full
attention + sliding window, the window longer than any prompt), where a load cannot fail once
promised (docs/notes/hybrid-loads-025.md). kvtier's scheduler core (``prepare_hits``) and a
worker on a small CPU cache of the same two groups stand behind a scheduler-side connector
that only translates: a lookup answers ``None`` while the hit is verified, and vLLM must ask
again on later steps, then take the promise.

    cd tests && PYTHONPATH=../.cache/vllm-0.25.1:.:../src python -m vllm025_prepare

Prints one JSON line: per scenario (``clean``, ``corrupt``, ``timeout``), the steps' scheduled
tokens, the lookups' answers, vLLM's request status after each step and kvtier's counters.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import vllm
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig, VllmConfig
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
from kvtier.config import KvtierConfig
from kvtier.layout import GroupKind, GroupSpec, build_layout
from kvtier.scheduler import NewRequest, OffloadScheduler, ScheduledTokens, StepInput
from kvtier.testing.corruption import flip_stored_byte, slot_of_chunk
from kvtier.testing.faults import faulty_factory
from kvtier.worker import OffloadWorker, StepResult

BS = 16
CHUNK = 32
NUM_BLOCKS = 64
PROMPT = [100 + (7 * i) % 500 for i in range(97)]  # three whole chunks and a token
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
CONFIG = KvtierConfig(dram_size="4MiB", cost_model=False, prepare_timeout_ms=60_000)


class Tier:
    """kvtier's scheduler core and one worker (a CPU cache of vLLM's two groups' shape)."""

    def __init__(self, config: KvtierConfig, slow: bool = False) -> None:
        """``slow``: every job is held for a few engine steps (the verify outlives the
        timeout)."""
        gen = torch.Generator().manual_seed(0)
        caches = {n: torch.randn(NUM_BLOCKS, 2, BS, 1, 8, generator=gen) for n in LAYERS}
        layout = build_layout(caches, [GroupSpec(GroupKind.FULL, BS, LAYERS[:1]),
                                       GroupSpec(GroupKind.SLIDING_WINDOW, BS, LAYERS[1:],
                                                 sliding_window=4096)], NUM_BLOCKS)
        self.worker = OffloadWorker(config, layout, CHUNK, engine_factory=faulty_factory())
        self.slow = slow
        self.sched = OffloadScheduler(config, self.worker.geometry, b"v" * 16,
                                      self.worker.slab_layout, prepare_hits=True)

    def run(self, step: StepInput) -> StepResult:
        plan = self.sched.schedule_step(step)
        self.worker.fence(plan)
        self.worker.begin_step(plan)
        self.worker.end_step(plan)
        if not self.slow:
            self.worker.drain()
        res = self.worker.collect()
        self.sched.on_report(res.report)
        return res

    def store(self, tokens: list[int]) -> None:
        """Save every chunk of ``tokens`` (a request computed elsewhere before)."""
        self.sched.add_request("seed")
        blocks = [list(range(40, 47)), list(range(50, 57))]
        self.run(StepInput(new=[NewRequest("seed", blocks)],
                           scheduled=[ScheduledTokens("seed", tokens, len(tokens), len(tokens))]))
        self.sched.request_finished("seed")
        self.run(StepInput())


class PreparingConnector(KVConnectorBase_V1, SupportsHMA):
    """Scheduler side only: kvtier's core behind vLLM's hooks (``tier`` set by the test)."""

    tier: Tier
    answers: list[Any]
    last: StepResult | None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   **kw: Any) -> tuple[int | None, bool]:
        sched = self.tier.sched
        if request.request_id not in sched.requests:
            sched.add_request(request.request_id)
        n = sched.lookup(request.request_id, request.all_token_ids[: request.num_tokens],
                         num_computed_tokens)
        self.answers.append(n)
        return n, bool(n)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int,
                                 **kw: Any) -> None:
        if num_external_tokens:
            self.tier.sched.start_load(request.request_id, num_external_tokens,
                                       [list(ids) for ids in blocks.get_block_ids()])

    def build_connector_meta(self, scheduler_output: Any, **kw: Any) -> KVConnectorMetadata:
        self.last = self.tier.run(StepInput())  # the workers run this step's plan
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any, **kw: Any) -> tuple[bool, None]:
        self.tier.sched.request_finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any,
                                    **kw: Any) -> tuple[bool, None]:
        return self.request_finished(request, block_ids)

    def start_load_kv(self, forward_context: Any, **kw: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str, **kw: Any) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kw: Any) -> None:
        return None

    def wait_for_save(self, **kw: Any) -> None:
        return None


def make_scheduler(tier: Tier) -> Scheduler:
    kv = KVTransferConfig(kv_connector="PreparingConnector", kv_role="kv_both",
                          kv_connector_module_path="vllm025_prepare",
                          kv_load_failure_policy="recompute")
    cfg = VllmConfig(
        model_config=model_config(),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                         max_model_len=1024, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=kv, device_config=DeviceConfig("cpu"))
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32,
                            sliding_window=4096)
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], swa)])
    s = Scheduler(vllm_config=cfg, kv_cache_config=kvc, log_stats=True,
                  structured_output_manager=StructuredOutputManager(cfg), block_size=BS)
    s.connector.tier = tier
    s.connector.answers = []
    s.connector.last = None
    return s


def step(s: Scheduler) -> dict[str, Any]:
    """One engine step; the workers' finished loads reach vLLM in this step's output."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens + out.num_scheduled_tokens[r]
               >= s.requests[r].num_prompt_tokens else [] for r in ids]
    last = s.connector.last
    done = set(last.finished_loads) if last is not None else set()
    failed = set(last.failed_loads) if last is not None else set()
    s.update_from_output(out, runner_output(ids, sampled, kv_output(done - failed, failed,
                                                                    set(), None, None)))
    status = {r: str(q.status.name) for r, q in s.requests.items()}
    return {"scheduled": dict(out.num_scheduled_tokens), "status": status}


def scenario(corrupt: bool = False, timeout: bool = False) -> dict[str, Any]:
    config = CONFIG.model_copy(update={"prepare_timeout_ms": 1e-6} if timeout else {})
    tier = Tier(config)
    tier.store(PROMPT)
    if timeout:
        tier.slow = True
        tier.worker.engine.hold_steps = 2  # type: ignore[attr-defined]
    if corrupt:
        cls, slot = slot_of_chunk(tier.sched, PROMPT, chunk=1, group=0)
        flip_stored_byte(tier.worker, cls, slot, offset=0)
    s = make_scheduler(tier)
    s.add_request(make_request("r", PROMPT, max_tokens=2))
    trace = [step(s) for _ in range(6)]
    while tier.sched.has_pending_work():  # the held verify job ends, and its pins with it
        tier.worker.drain()
        tier.run(StepInput())
    st = tier.sched.stats
    return {"trace": trace, "answers": s.connector.answers, "loads_ok": st.loads_ok,
            "loads_failed": st.loads_failed, "loaded_tokens": st.loaded_tokens,
            "prepares": st.prepares, "checksum_failures": st.checksum_failures,
            "corrupt_chunks": st.corrupt_chunks, "declined": dict(st.declined),
            "requests_left": len(s.requests), "kvtier_requests_left": len(tier.sched.requests),
            "pinned": tier.sched.index.stats().pinned}


def main() -> None:
    print(json.dumps({"version": vllm.__version__, "clean": scenario(),
                      "corrupt": scenario(corrupt=True), "timeout": scenario(timeout=True)}))


if __name__ == "__main__":
    main()

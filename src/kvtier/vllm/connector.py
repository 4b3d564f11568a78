"""kvtier as a vLLM V1 KV connector, for vLLM 0.25.1 and 0.32: a facade whose every hook
delegates to the side that serves it.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"dram_size": "64GiB"}}'

(or ``"kv_connector": "kvtier"`` once the plugin entry point registered it).

- :mod:`kvtier.vllm.scheduler_side`: the scheduler's hooks (lookups, allocation, the step's
  metadata, the workers' reports, finished requests) over :mod:`kvtier.scheduler`;
- :mod:`kvtier.vllm.worker_side`: the workers' hooks (cache registration, fences, loads,
  saves, completions) over :mod:`kvtier.worker`;
- :mod:`kvtier.vllm.compat`: every difference between the vLLM versions;
- :mod:`kvtier.vllm.setup`: what both sides decide at start-up (refusals through
  :mod:`kvtier.vllm.startup`: one `kvtier: ...` line, printed last);
- :mod:`kvtier.vllm.counters`: the stats, their Prometheus series and their docs.

Both sides exist in every process (neither holds anything before its first hook); vLLM calls
a scheduler hook only on the scheduler's connector and a worker hook only on a worker's.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvtier.config import KvtierConfig
from kvtier.vllm import compat
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.setup import set_up
from kvtier.vllm.stats import KvtierStats
from kvtier.vllm.timings import SchedulerTimings
from kvtier.vllm.worker_side import EngineFactory, WorkerSide, transfer_engine_factory


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    # 0.32: kvtier's hits are host-memory hits in vllm:prompt_tokens_cached_by_source, and
    # with a disk tier split per request (get_external_cache_hit_sources); 0.25.1 has neither
    if compat.HOST_CACHE_HIT_SOURCE is not None:
        _cache_hit_source = compat.HOST_CACHE_HIT_SOURCE

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.setup = set_up(vllm_config, self._kv_transfer_config, kv_cache_config,
                            is_scheduler=role == KVConnectorRole.SCHEDULER)
        self.config = self.setup.config
        self.groups = self.setup.groups
        self.scheduler_side = SchedulerSide(self.setup)
        self.worker_side = WorkerSide(self.setup, vllm_config, kv_cache_config,
                                      self._engine_factory)
        self.timings = SchedulerTimings()

    def _engine_factory(self, device_is_cuda: bool) -> EngineFactory | None:
        """The transfer engine factory of this worker (None: the worker's CPU engine). The
        seam test connectors override to wrap it (kvtier.testing.probe,
        tests/e2e/faulty_connector.py)."""
        return transfer_engine_factory(self.setup, device_is_cuda)

    # -- scheduler hooks --------------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: nothing must be handed off before freeing

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.scheduler_side.bind_block_pool(gpu_block_pool)

    def on_new_request(self, request: Any, **kwargs: Any) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   **kwargs: Any) -> tuple[int | None, bool]:
        start = time.perf_counter()
        out = self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)
        if out[0] is not None and not self.setup.disabled_reason:
            self.timings.lookup(time.perf_counter() - start)
        return out

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int,
                                 **kwargs: Any) -> None:
        if self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens):
            self.timings.load_started(request.request_id)  # parked until its load ends

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int
                                       ) -> dict[Any, int]:
        return self.scheduler_side.cache_hit_sources(request, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any, **kwargs: Any) -> tuple[int, ...]:
        return self.scheduler_side.get_loaded_kv_cache_group_ids()

    def build_connector_meta(self, scheduler_output: Any, **kwargs: Any) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any, **kwargs: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)
        self.timings.loads_ended(getattr(connector_output, "finished_recving", None) or ())

    def request_finished(self, request: Any, block_ids: Any, **kwargs: Any
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: Any, **kwargs: Any
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self.timings.forget(request.request_id)
        return self.scheduler_side.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side.has_pending_push_work()

    def reset_cache(self) -> bool | None:
        return self.scheduler_side.reset_cache()

    # -- worker hooks -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    @property
    def prefer_cross_layer_blocks(self) -> bool:  # vLLM 0.25.1 asks; 0.32 has no such path
        return self.worker_side.prefers_cross_layer_blocks()

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        self.worker_side.register_cross_layers_kv_cache(kv_cache, attn_backend)

    def handle_preemptions(self, kv_connector_metadata: Any = None, **kwargs: Any) -> None:
        self.worker_side.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker_side.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        return None  # loads were started when the step's metadata was bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        # vLLM calls this before every attention layer of every step: one attribute read
        # unless this step's forward reads layer-by-layer loads
        if self.worker_side.layer_waits:
            self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str], **kwargs: Any
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str], **kwargs: Any) -> Any:
        return self.worker_side.get_transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self.worker_side.build_connector_worker_meta()

    def shutdown(self) -> None:
        self.worker_side.shutdown()
        self.scheduler_side.shutdown()

    # -- both: stats ------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KvtierStats | None:
        if self.role == KVConnectorRole.SCHEDULER:
            data = {**self.scheduler_side.stats(), **self.timings.take()}
        else:
            data = self.worker_side.stats()
        return KvtierStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           **kwargs: Any) -> Any:
        """kvtier's series on vLLM's /metrics (kvtier.vllm.counters lists them)."""
        from kvtier.vllm.prom import KvtierPromMetrics

        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Any layout moves as opaque segments; ``kv_cache_layout`` may still ask for one.
        Called before the connector exists: a setting that does not parse here is left to
        the connector's start-up, which refuses it with its one-line message."""
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
        try:
            layout = KvtierConfig.load(extra).kv_cache_layout
        except ValueError:
            return None
        return None if layout == "engine" else layout

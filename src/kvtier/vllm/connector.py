"""kvtier as a vLLM V1 KV connector: a thin adapter over :mod:`kvtier.scheduler` and
:mod:`kvtier.worker`, for vLLM 0.25.1 and 0.32 (docs/compatibility.md lists the differences).

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"dram_size": "64GiB"}}'

(or ``"kv_connector": "kvtier"`` once the plugin entry point registered it).

Start-up handshake: the scheduler half sizes nothing until every worker has reported its
layout (bytes per block, fingerprint) through the worker metadata of an engine step. Until
then lookups are deferred (``None``) and ``has_pending_push_work`` keeps the engine stepping,
so the first request waits one step, and both halves derive the same slab layout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvtier.config import ConfigError, KvtierConfig
from kvtier.geometry import Geometry, resolve_chunk_tokens
from kvtier.keys import UNSUPPORTED, Namespace
from kvtier.layout import build_layout
from kvtier.log import get_logger, worker_census
from kvtier.protocol import StepPlan
from kvtier.scheduler import (
    CachedRequest,
    NewRequest,
    OffloadScheduler,
    ScheduledTokens,
    StepInput,
)
from kvtier.transfer import ChunkMover, TransferEngine
from kvtier.vllm.block_axes import registered_block_axes
from kvtier.vllm.groups import EngineGroups, UnsupportedModel, engine_groups
from kvtier.vllm.metadata import KvtierMetadata, KvtierWorkerMetadata
from kvtier.vllm.stats import KvtierStats, counter_deltas
from kvtier.worker import OffloadWorker, StepResult

try:  # vLLM 0.32: failures per request
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    HAS_FAILED_RECVING = True
except ImportError:  # vLLM 0.25.1: failures per block, one KV-cache group only
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]
    HAS_FAILED_RECVING = False

try:  # vLLM 0.32: every layer is a [B, H, N, C] view made by create_kv_cache_views
    from vllm.v1.kv_cache_interface import create_kv_cache_views  # noqa: F401

    VIEWS_ARE_BLOCK_MAJOR = True
except ImportError:
    VIEWS_ARE_BLOCK_MAJOR = False

try:
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
except ImportError:  # pragma: no cover
    generate_block_hash_extra_keys = None  # type: ignore[assignment]

logger = get_logger("vllm.connector")

MAX_GEOMETRY_DEFERRALS = 200


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        try:
            self.config = KvtierConfig.load(extra)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute" and not self.config.allow_fail_policy:
            raise ValueError(
                f"kvtier needs kv_load_failure_policy='recompute' (got {policy!r}): a failed "
                "restore must recompute, not fail the request. Set it in --kv-transfer-config, "
                "or set kvtier's allow_fail_policy=true to start anyway."
            )
        parallel = vllm_config.parallel_config
        self.world_size = int(parallel.tensor_parallel_size) * int(
            parallel.pipeline_parallel_size)
        self.disabled_reason: str | None = None
        if int(parallel.pipeline_parallel_size) > 1:
            self.disabled_reason = "pipeline parallelism is not supported yet"
        self.groups: EngineGroups | None = None
        try:
            self.groups = engine_groups(kv_cache_config)
        except UnsupportedModel as e:
            self.disabled_reason = str(e)
        self.loads_enabled = True
        if (self.groups is not None and len(self.groups.engine_ids) > 1
                and not HAS_FAILED_RECVING):
            self.loads_enabled = False
            logger.warning("kvtier: this vLLM reports load failures per block, which it cannot "
                           "map with %d KV-cache groups: saving only, loads are off",
                           len(self.groups.engine_ids))
        sched_policy = str(getattr(vllm_config.scheduler_config, "policy", "fcfs"))
        if (role == KVConnectorRole.SCHEDULER and self.loads_enabled
                and sched_policy == "priority" and not _parked_requests_drained_first()):
            self.loads_enabled = False
            logger.warning("kvtier: this vLLM's priority scheduler can leave a request parked "
                           "for a load behind a higher-priority request that needs its blocks "
                           "(a deadlock): saving only, loads are off; use the fcfs policy or "
                           "vLLM >= 0.32")
        if self.disabled_reason:
            logger.warning("kvtier is off for this engine: %s", self.disabled_reason)
        self.replicated = bool(getattr(vllm_config.model_config, "use_mla", False)) and (
            int(parallel.tensor_parallel_size) > 1)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.kv_cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self.model_name = str(vllm_config.model_config.model)
        # scheduler half
        self._sched: OffloadScheduler | None = None
        self._requests: dict[str, Any] = {}
        self._deferrals = 0
        self._last_output = time.monotonic()
        self._last_counts: dict[str, Any] = {}
        self._prefill_tokens = 0
        # requests vLLM scheduled before the scheduler half existed: their block tables are
        # unknown, so nothing is saved from them until a step hands over a full table
        self._blind: set[str] = set()
        # worker half
        self._worker: OffloadWorker | None = None
        self._geometry: Geometry | None = None
        self._geometry_acked = False
        self._result = StepResult()
        self._fenced_step = -1
        self._begun_step = -1
        self._worker_counts: dict[str, Any] = {}

    # ======================================================================================
    # scheduler half
    # ======================================================================================
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: nothing must be handed off before freeing

    def on_new_request(self, request: Any, **kwargs: Any) -> None:
        self._requests[request.request_id] = request
        self._blind.discard(request.request_id)
        if self._sched is not None:
            # always a new lifecycle: vLLM may reuse the id of a finished request whose saves
            # are still in flight, and that request's keys are not this one's
            self._sched.add_request(request.request_id, getattr(request, "cache_salt", None),
                                    self._extra_keys_fn(request))

    def _ensure_request(self, request: Any) -> None:
        assert self._sched is not None
        if request.request_id in self._sched.requests:
            return
        self._requests[request.request_id] = request
        self._sched.add_request(request.request_id, getattr(request, "cache_salt", None),
                                self._extra_keys_fn(request))

    def _extra_keys_fn(self, request: Any) -> Any:
        if generate_block_hash_extra_keys is None:
            return None
        state = {"mm_idx": 0}

        def extra(start: int, end: int) -> object:
            try:
                keys, state["mm_idx"] = generate_block_hash_extra_keys(
                    request, start, end, state["mm_idx"])
            except Exception:  # anything we cannot reproduce must not be keyed
                return UNSUPPORTED
            return keys

        return extra

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   **kwargs: Any) -> tuple[int | None, bool]:
        if self.disabled_reason:
            return 0, False
        if self._sched is None:
            self._deferrals += 1
            if self._deferrals > MAX_GEOMETRY_DEFERRALS:
                return 0, False  # never hang a request on a missing handshake
            return None, False
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # prompt logprobs need every token computed (0.25.1 asks anyway)
        self._ensure_request(request)
        tokens = request.all_token_ids
        n = self._sched.lookup(request.request_id, tokens[: request.num_tokens],
                               num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int,
                                 **kwargs: Any) -> None:
        if self._sched is None or num_external_tokens == 0 or self.groups is None:
            return
        block_ids = self.groups.to_kvtier(blocks.get_block_ids())
        self._sched.start_load(request.request_id, num_external_tokens, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any, **kwargs: Any) -> tuple[int, ...]:
        if self.groups is None:
            return ()
        return tuple(self.groups.engine_ids)  # every group kvtier restores, state included

    def build_connector_meta(self, scheduler_output: Any, **kwargs: Any) -> KVConnectorMetadata:
        sched = self._sched
        if sched is None or self.groups is None:
            # vLLM can schedule a request before the layout handshake made the scheduler half
            # (0.32 forces the hit of a request that skips the prefix cache to 0, even when
            # kvtier deferred it; kvtier stops deferring after MAX_GEOMETRY_DEFERRALS)
            self._blind.update(scheduler_output.num_scheduled_tokens)
            return KvtierMetadata(StepPlan(), geometry_known=False)
        for nr in scheduler_output.scheduled_new_reqs:
            if nr.req_id in self._requests:
                self._ensure_request(self._requests[nr.req_id])
        step = self._step_input(scheduler_output, self.groups)
        self._blind.difference_update(nr.req_id for nr in step.new)  # a full table
        self._blind.difference_update(c.req_id for c in step.cached if c.resumed)
        scheduled = []
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        prefill = 0
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(req_id)
            if req is None or req_id in self._blind:
                continue
            computed_after = req.num_computed_tokens + n_sched - len(spec.get(req_id, ()))
            if req.num_computed_tokens < req.num_prompt_tokens:
                prefill += n_sched
            scheduled.append(ScheduledTokens(req_id, req.all_token_ids, computed_after,
                                             req.num_prompt_tokens))
        step.scheduled = scheduled
        self._prefill_tokens = prefill
        return KvtierMetadata(sched.schedule_step(step), geometry_known=True)

    @staticmethod
    def _step_input(scheduler_output: Any, groups: EngineGroups) -> StepInput:
        """vLLM's scheduler output as kvtier's step input (block tables in kvtier's groups).
        A request preempted since the last step (reset_prefix_cache with
        reset_running_requests preempts between steps) may be resumed in this very step:
        the scheduler orders that, not this translation."""
        new = [NewRequest(nr.req_id, groups.to_kvtier(nr.block_ids))
               for nr in scheduler_output.scheduled_new_reqs]
        cached_out = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached_out, "resumed_req_ids", None) or set()
        resumed_flags = getattr(cached_out, "resumed_from_preemption", None)
        cached = []
        for i, req_id in enumerate(cached_out.req_ids):
            new_ids = cached_out.new_block_ids[i]
            is_resumed = req_id in resumed or bool(resumed_flags and resumed_flags[i])
            cached.append(CachedRequest(
                req_id, None if new_ids is None else groups.to_kvtier(new_ids),
                resumed=is_resumed and new_ids is not None))
        copies = [dst for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ()
                  if (dst := getattr(copy, "dst_block_id", None)) is not None]
        return StepInput(
            preempted=list(getattr(scheduler_output, "preempted_req_ids", None) or ()),
            new=new, cached=cached,
            copy_targets=[copies] * len(groups.engine_ids) if copies else [],
        )

    def update_connector_output(self, connector_output: Any, **kwargs: Any) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KvtierWorkerMetadata):
            return
        if self._sched is None and wm.geometries:
            self._start_scheduler(wm.geometries)
        if self._sched is not None:
            self._sched.on_report(wm.report)
            now = time.monotonic()
            self._sched.observe_step(now - self._last_output, self._prefill_tokens)
            self._last_output = now

    def _start_scheduler(self, geometries: list[Geometry]) -> None:
        if len(geometries) < self.world_size:
            return  # wait until every rank reported
        first = geometries[0]
        if any(g != first for g in geometries):
            raise RuntimeError(f"kvtier: ranks disagree on the KV layout: {geometries}")
        assert self.groups is not None
        geometry = first
        chunk = geometry.chunk_tokens
        num_shards = 1 if self.replicated else self.world_size
        slab_layout = geometry.slab_layout(self.config, num_shards)
        ns = Namespace(
            model=self.model_name, layout_fingerprint=first.fingerprint,
            kv_cache_dtype=self.kv_cache_dtype, chunk_tokens=chunk,
            model_revision=self.config.model_revision,
            tp_size=int(self._vllm_config.parallel_config.tensor_parallel_size),
            extra=self.config.namespace_extra,
        ).digest()
        self._sched = OffloadScheduler(self.config, geometry, ns, slab_layout,
                                       world_size=self.world_size,
                                       loads_enabled=self.loads_enabled)
        for req in list(self._requests.values()):
            self._ensure_request(req)
        logger.info("kvtier: %d chunk slots per group of %d tokens, %s",
                    slab_layout.classes[0].num_slots, chunk,
                    [c.name for c in slab_layout.classes])

    def request_finished(self, request: Any, block_ids: Any, **kwargs: Any
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: Any, **kwargs: Any
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._blind.discard(request.request_id)
        if self._sched is not None:
            self._sched.request_finished(request.request_id)
        # Never hold blocks: saves in flight are fenced when their blocks are reallocated.
        return False, None

    def has_pending_push_work(self) -> bool:
        if self.disabled_reason:
            return False
        if self._sched is None:
            return bool(self._requests) and self._deferrals <= MAX_GEOMETRY_DEFERRALS
        return self._sched.has_pending_work()

    def reset_cache(self) -> bool | None:
        if self._sched is not None:
            self._sched.reset()
        return True

    def get_kv_connector_stats(self) -> KvtierStats | None:
        if self.role == KVConnectorRole.SCHEDULER:
            counts = self._scheduler_counts()
            before, self._last_counts = self._last_counts, counts
        else:
            counts = dict(self._worker_counts)
            before = {}
            self._worker_counts = {}
        delta = counter_deltas({k: v for k, v in counts.items() if not k.startswith("gauge_")},
                               {k: v for k, v in before.items() if not k.startswith("gauge_")})
        delta.update({k: v for k, v in counts.items() if k.startswith("gauge_")})
        stats = KvtierStats(data=delta)
        return None if stats.is_empty() and not delta else stats

    def _scheduler_counts(self) -> dict[str, Any]:
        if self._sched is None:
            return {}
        s = self._sched.stats
        out: dict[str, Any] = {
            "lookups": s.lookups, "hits": s.hits, "hit_tokens": s.hit_tokens,
            "loads_started": s.loads_started, "loads_ok": s.loads_ok,
            "loads_failed": s.loads_failed, "saves_planned": s.saves_planned,
            "saves_committed": s.saves_committed, "saves_failed": s.saves_failed,
            "fences": s.fences, "unsaveable_requests": s.unsaveable_requests,
            "evictions": self._sched.index.evictions, "resets": s.resets,
            "loaded_tokens": s.loaded_tokens,
        }
        for reason, n in s.declined.items():
            out[f"declined_{reason}"] = n
        for reason, n in s.saves_dropped.items():
            out[f"saves_dropped_{reason}"] = n
        used, total = self._sched.occupancy()
        out["gauge_slots_used"] = used
        out["gauge_slots_total"] = total
        out["gauge_chunk_tokens"] = self._sched.geometry.chunk_tokens
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           **kwargs: Any) -> Any:
        """kvtier's series on vLLM's /metrics (kvtier.vllm.prom lists them)."""
        from kvtier.vllm.prom import KvtierPromMetrics

        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # any layout: bytes move as opaque segments

    # ======================================================================================
    # worker half
    # ======================================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.disabled_reason or self.groups is None:
            return
        layers = dict(getattr(self._vllm_config.compilation_config,
                              "static_forward_context", {}) or {})
        # the block axis of each tensor as vLLM declares it (never guessed from sizes)
        block_axes = registered_block_axes(kv_caches, self._kv_cache_config, layers,
                                           self.kv_cache_dtype)
        layout = build_layout(
            kv_caches, self.groups.specs, int(self._kv_cache_config.num_blocks),
            kv_cache_dtype=self.kv_cache_dtype, layers=layers, block_axes=block_axes,
        )
        chunk = resolve_chunk_tokens(self.config.chunk_tokens,
                                     [g.spec.block_size for g in layout.groups])
        rank = _rank()
        device_is_cuda = any(
            isinstance(t, torch.Tensor) and t.is_cuda for t in kv_caches.values())
        shm = f"kvtier-{self._vllm_config.kv_transfer_config.engine_id}" if (
            self.world_size > 1) else None
        self._worker = OffloadWorker(
            self.config, layout, chunk, rank=rank, world_size=self.world_size,
            replicated=self.replicated, shm_name=shm, pinner=_pinner(device_is_cuda),
            engine_factory=self._engine_factory(device_is_cuda),
        )
        self._geometry = self._worker.geometry
        transfer = f"cuda {self.config.transfer_path}" if device_is_cuda else "cpu threads"
        logger.info("%s", worker_census(rank, layout, chunk, self._worker.slab_layout.total_bytes,
                                        transfer))

    def _engine_factory(self, device_is_cuda: bool
                        ) -> Callable[[ChunkMover], TransferEngine] | None:
        """The transfer engine of this worker: the CUDA engine for a KV cache on a GPU, else
        None (the worker's CPU engine). Test connectors wrap it (kvtier.testing.faults)."""
        if not device_is_cuda:
            return None
        from kvtier.gpu.engine import CudaTransferEngine

        def make(mover: ChunkMover) -> TransferEngine:
            return CudaTransferEngine(mover, self.config, mode=self.config.transfer_path)

        return make

    def _step_plan(self, meta: Any) -> tuple[StepPlan | None, bool]:
        if isinstance(meta, KvtierMetadata):
            return meta.plan, meta.geometry_known
        return None, False

    def handle_preemptions(self, kv_connector_metadata: Any = None, **kwargs: Any) -> None:
        plan, _ = self._step_plan(kv_connector_metadata)
        if self._worker is not None and plan is not None:
            self._worker.fence(plan)
            self._fenced_step = plan.step

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        plan, known = self._step_plan(connector_metadata)
        if known:
            self._geometry_acked = True
        if self._worker is None or plan is None or plan.step == self._begun_step:
            return
        if self._fenced_step != plan.step:  # vLLM without handle_preemptions (or not called)
            self._worker.fence(plan)
            self._fenced_step = plan.step
        self._worker.begin_step(plan)  # loads start before the forward, on their own thread
        self._begun_step = plan.step

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        return None  # loads were started when the step's metadata was bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        plan, _ = self._step_plan(self._connector_metadata)
        if plan is not None and plan.saves:
            self._worker.end_step(plan)  # queued, not waited for

    def _collect(self) -> StepResult:
        if self._worker is None:
            return StepResult()
        res = self._worker.collect()
        r = res.report
        wc = self._worker_counts
        for k, v in (("bytes_saved", r.bytes_saved), ("bytes_loaded", r.bytes_loaded),
                     ("save_seconds", r.save_seconds), ("load_seconds", r.load_seconds),
                     ("fences_waited", r.fences_waited), ("save_jobs", len(r.saves)),
                     ("load_jobs", len(r.loads)),
                     ("transfer_failures", sum(f for _, f in r.saves.values())
                      + sum(f for _, f in r.loads.values()))):
            if v:
                wc[k] = wc.get(k, 0) + v
        # Reports accumulate until build_connector_worker_meta hands them over: a second
        # collection before that (any engine path that polls twice) must not drop the first.
        self._result = self._result.merge(res)
        return res

    def get_finished(self, finished_req_ids: set[str], **kwargs: Any
                     ) -> tuple[set[str] | None, set[str] | None]:
        res = self._collect()
        return None, (res.finished_loads or None)

    def get_transfer_results(self, finished_req_ids: set[str], **kwargs: Any) -> Any:
        res = self._collect()
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=set(res.finished_loads),
            failed_recving=set(res.failed_loads))

    def get_block_ids_with_load_errors(self) -> set[int]:
        if HAS_FAILED_RECVING:
            return set()  # reported per request through failed_recving
        return set(self._result.failed_blocks)

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        if self._worker is None:
            return None
        geoms = [self._geometry] if (self._geometry and not self._geometry_acked) else []
        meta = KvtierWorkerMetadata(report=self._result.report, geometries=geoms)
        self._result = StepResult()
        return meta

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None


def _parked_requests_drained_first() -> bool:
    """Whether vLLM's scheduler admits requests that hold KV blocks (parked loads) before the
    others. 0.32 keeps them in a queue of their own, drained first; 0.25.1's priority policy
    compares the heads of its waiting and skipped queues by priority and stops at the first
    request it cannot allocate, which can be one that needs the parked request's blocks."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:  # pragma: no cover
        return True
    return hasattr(Scheduler, "_holds_kv_blocks")


def _pinner(device_is_cuda: bool) -> Any:
    """The CUDA pinner for a cache on a GPU (vLLM set this worker's device already)."""
    if not device_is_cuda:
        return None
    from kvtier.gpu.pinning import CudaPinner

    return CudaPinner()


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:
        return int(os.environ.get("RANK", "0"))

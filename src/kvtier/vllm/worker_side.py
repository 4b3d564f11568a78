"""The connector's worker side: vLLM's worker hooks translated to
:class:`~kvtier.worker.OffloadWorker` calls.

Per step: the plan arrives in the bound metadata; fences go first (``handle_preemptions``, or
at bind on a vLLM without it), loads start at bind (before the forward), saves at
``wait_for_save`` (after it, never waited for), and completions are collected by
``get_finished`` / ``get_transfer_results`` and handed to the scheduler side in the worker
metadata, with this rank's :class:`~kvtier.geometry.Geometry` until the scheduler side
acknowledged it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from kvtier.geometry import Geometry, resolve_chunk_tokens
from kvtier.layout import GroupKind, Layout, LayoutError, build_layout, layer_index
from kvtier.load_retry import RetryingLoads, retrying_factory
from kvtier.log import get_logger, worker_census
from kvtier.protocol import StepPlan
from kvtier.slab import Pinner
from kvtier.store.attach import StoreMapping
from kvtier.transfer import ChunkMover, TransferEngine, find_engine
from kvtier.vllm import compat, startup
from kvtier.vllm.block_axes import cross_layer_block_axis, registered_block_axes
from kvtier.vllm.counters import worker_counts, worker_observations
from kvtier.vllm.metadata import KvtierMetadata, KvtierWorkerMetadata
from kvtier.vllm.ranks import engine_shared_slab
from kvtier.vllm.setup import ConnectorSetup
from kvtier.vllm.stats import add_observations, stats_payload
from kvtier.vllm.store_link import mapped_epoch, worker_mapping
from kvtier.worker import OffloadWorker, StepResult

logger = get_logger("vllm.connector")

CROSS_LAYERS = "kvtier.cross_layers"  # the name of the one tensor of every layer

_layer_index = functools.lru_cache(maxsize=4096)(layer_index)  # per attention call: cached

EngineFactory = Callable[[ChunkMover], TransferEngine]


def transfer_engine_factory(setup: ConnectorSetup, device_is_cuda: bool
                            ) -> EngineFactory | None:
    """The transfer engine for a KV cache on a GPU (the CUDA engine), else None (the worker's
    CPU engine)."""
    if not device_is_cuda:
        return None
    from kvtier.gpu.engine import CudaTransferEngine

    config = setup.config

    def make(mover: ChunkMover) -> TransferEngine:
        engine = CudaTransferEngine(mover, config, mode=config.transfer_path)
        t0 = time.perf_counter()
        launches = engine.warm_up()  # the first request must not pay the kernels' first use
        logger.info("kvtier transfer engine: paths %s, %d warm-up launches in %.2f s",
                    engine.paths(), launches, time.perf_counter() - t0)
        return engine

    return make


class WorkerSide:
    """``engine_factory(device_is_cuda)`` picks the transfer engine factory: the connector's
    seam (test connectors wrap it, see :mod:`kvtier.testing.faults`)."""

    def __init__(self, setup: ConnectorSetup, vllm_config: Any, kv_cache_config: Any,
                 engine_factory: Callable[[bool], EngineFactory | None]) -> None:
        self.setup = setup
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._engine_factory = engine_factory
        self.worker: OffloadWorker | None = None
        self._geometry: Geometry | None = None
        self._geometry_acked = False
        self._result = StepResult()
        self._fenced_step = -1
        self._begun_step = -1
        self._counts: dict[str, Any] = {}
        self._observations: dict[str, list[float]] = {}
        self.store_mapping: StoreMapping | None = None  # with store_url
        # this step's forward must wait per layer (layer-by-layer loads were begun at bind)
        self.layer_waits = False

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        setup = self.setup
        if setup.disabled_reason or setup.groups is None:
            return
        layers = dict(getattr(self._vllm_config.compilation_config,
                              "static_forward_context", {}) or {})
        with startup.failures(todo=startup.LAYOUT_TODO):  # e.g. a scale it cannot map
            # the block axis of each tensor as vLLM declares it (never guessed from sizes)
            block_axes = registered_block_axes(kv_caches, self._kv_cache_config, layers,
                                               setup.kv_cache_dtype)
            layout = build_layout(
                kv_caches, setup.groups.specs, int(self._kv_cache_config.num_blocks),
                kv_cache_dtype=setup.kv_cache_dtype, layers=layers, block_axes=block_axes,
            )
        self._start(layout, any(isinstance(t, torch.Tensor) and t.is_cuda
                                for t in kv_caches.values()))
        if setup.config.cross_layer_blocks:
            logger.warning("kvtier: cross_layer_blocks is set, but %s; blocks move per layer",
                           self._why_per_layer())

    def _why_per_layer(self) -> str:
        """Why vLLM registered one tensor per layer although ``cross_layer_blocks`` is set."""
        if not compat.HAS_CROSS_LAYER_REGISTRATION:
            return "this vLLM has no cross-layer registration (vLLM 0.25.1 has one)"
        if not self.prefers_cross_layer_blocks():
            return ("this model does not qualify (it needs one KV-cache group of plain "
                    "attention, no EAGLE/MTP drafts and an unquantized cache)")
        # 0.25.1 allocates the one tensor only in its V1 model runner (use_uniform_kv_cache,
        # for one attention group whose backend indexes KV by the block stride); its V2 model
        # runner, the default for most models on CUDA, has no such allocation (H200
        # session 13: the Llama-8B shape on FLASH_ATTN got 32 tensors, native offloading too)
        return ("vLLM registered one tensor per layer: vLLM 0.25.1 allocates one tensor of "
                "every layer only in its V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0) and "
                "for an attention backend that indexes KV by the block stride")

    def prefers_cross_layer_blocks(self) -> bool:
        """Whether to ask vLLM for one tensor of every layer (``cross_layer_blocks``): only
        for one group of plain attention with nothing kept per layer beside the bytes (no
        quantization scales, no draft layers), where the group's block is just the bytes."""
        s = self.setup
        return bool(s.config.cross_layer_blocks and s.disabled_reason is None
                    and s.groups is not None and len(s.groups.specs) == 1
                    and s.groups.specs[0].kind is GroupKind.FULL
                    and s.draft_lookahead == 0 and s.kv_cache_dtype == "auto")

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        """vLLM 0.25.1's one tensor of every layer (in place of :meth:`register_kv_caches`,
        after :meth:`prefers_cross_layer_blocks`): one segment, a block's bytes of all layers
        in memory order (their format in the slab; the layout's fingerprint says so)."""
        setup = self.setup
        if setup.disabled_reason or setup.groups is None:
            return
        num_blocks = int(self._kv_cache_config.num_blocks)
        group = setup.groups.specs[0]
        spec = self._kv_cache_config.kv_cache_groups[setup.groups.engine_ids[0]].kv_cache_spec
        with startup.failures(todo=startup.LAYOUT_TODO):
            axis = cross_layer_block_axis(kv_cache, attn_backend, spec, setup.kv_cache_dtype,
                                          num_blocks)
            layout = build_layout(
                {CROSS_LAYERS: kv_cache}, [replace(group, layer_names=(CROSS_LAYERS,))],
                num_blocks, kv_cache_dtype=setup.kv_cache_dtype,
                block_axes={CROSS_LAYERS: axis},
                extra_fingerprint={"cross_layers": list(group.layer_names)},
            )
            page = getattr(spec, "page_size_bytes", None)
            got = layout.group(0).bytes_per_block
            if page is not None and got != len(group.layer_names) * int(page):
                raise LayoutError(
                    f"the cross-layer KV cache {tuple(kv_cache.shape)} holds {got} bytes per "
                    f"block, not the {len(group.layer_names)} layers x {int(page)} bytes of "
                    "its KV-cache group")
        self._start(layout, kv_cache.is_cuda)

    def _start(self, layout: Layout, device_is_cuda: bool) -> None:
        """The worker over ``layout``: its chunk size, slab, transfer engine."""
        setup = self.setup
        with startup.failures():
            chunk = resolve_chunk_tokens(setup.config.chunk_tokens,
                                         [g.spec.block_size for g in layout.groups])
        rank = compat.rank()
        factory = self._engine_factory(device_is_cuda)
        if setup.loads_must_not_fail:  # no report path once promised: re-issue first
            factory = retrying_factory(factory)
        with startup.failures():  # the slab: dram_size, host memory, /dev/shm, pinning
            store = setup.config.store_url is not None
            shm = (engine_shared_slab(self._vllm_config)
                   if setup.world_size > 1 and not store else None)
            pinner = _pinner(device_is_cuda)
            if store:  # the slab lies in the node-wide store's pool (kvtier.vllm.store_link),
                # pinned with the worker's pinner as a private slab would be
                self.store_mapping = worker_mapping(
                    setup, Geometry.of_layout(layout, chunk),
                    1 if setup.replicated else setup.world_size, layout, pinner)
            self.worker = OffloadWorker(
                setup.config, layout, chunk, rank=rank, world_size=setup.world_size,
                replicated=setup.replicated, shared=shm, pinner=pinner,
                engine_factory=factory,
                slab_factory=self.store_mapping.slab if self.store_mapping else None,
            )
        if setup.layerwise_loads:
            # no load by layer is promised before a forward showed every layer's hook
            self.worker.layer_hooks.start_probe()
            self.worker.layer_failures_fatal = setup.layer_load_failures_fatal
        self._geometry = self.worker.geometry
        transfer = f"cuda {setup.config.transfer_path}" if device_is_cuda else "cpu threads"
        census = worker_census(rank, layout, chunk, self.worker.slab_layout.total_bytes,
                               transfer)
        mapping = self.store_mapping
        if mapping is not None:
            t = mapping.timing
            census += (f", store pool mapped in {t.map_seconds:.2f} s, pinned in "
                       f"{t.pin_seconds:.2f} s" if mapping.attached_at_start else
                       ", store not reachable yet (its pool is mapped when it answers)")
        logger.info("%s", census)

    # -- the step ---------------------------------------------------------------------------
    @staticmethod
    def _step_plan(meta: Any) -> tuple[StepPlan | None, bool]:
        if isinstance(meta, KvtierMetadata):
            return meta.plan, meta.geometry_known
        return None, False

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        plan, _ = self._step_plan(kv_connector_metadata)
        if self.worker is not None and plan is not None:
            self._follow_store(plan)
            self.worker.fence(plan)
            self._fenced_step = plan.step

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        plan, known = self._step_plan(connector_metadata)
        if known:
            self._geometry_acked = True
        if self.worker is None or plan is None or plan.step == self._begun_step:
            return
        if self._fenced_step != plan.step:  # vLLM without handle_preemptions (or not called)
            self._follow_store(plan)
            self.worker.fence(plan)
            self._fenced_step = plan.step
        self.worker.begin_step(plan)  # loads start before the forward, on their own thread
        self._begun_step = plan.step
        self.layer_waits = self.worker.loading_by_layer or self.worker.layer_hooks.probing

    def _follow_store(self, plan: StepPlan) -> None:
        """On a new store epoch, move the slab to the store's new pool (after the jobs in
        flight finished on the old one). Until the slab maps the plan's pool (a GPU worker
        pins it off the step path; or the store cannot be reached) the plan's jobs fail at
        once without touching the slab (:attr:`OffloadWorker.refusing`): never run against
        another epoch's bytes."""
        mapping, worker = self.store_mapping, self.worker
        if mapping is None or worker is None:
            return
        was = worker.refusing
        ok = mapping.follow(plan.store_epoch, worker.drain, worker.engine.slab_moved,
                            plan.store_pool)
        worker.refusing = None if ok else mapping.why
        if worker.refusing is not None and was is None:
            logger.warning("kvtier: %s; this worker fails its jobs (recompute) until it is",
                           mapping.why)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """vLLM is about to run the attention of ``layer_name`` (the connector calls this
        only while :attr:`layer_waits`: this step's forward reads loads by layer, or the
        worker still probes which layers call the hook)."""
        worker = self.worker
        if worker is not None and self.layer_waits:
            worker.wait_layer(_layer_index(layer_name))

    def wait_for_save(self, connector_metadata: Any) -> None:
        self.layer_waits = False  # the forward is over
        if self.worker is None:
            return
        plan, _ = self._step_plan(connector_metadata)
        if plan is not None and plan.saves:
            self.worker.end_step(plan)  # queued, not waited for

    def _collect(self) -> StepResult:
        self.layer_waits = False  # the forward is over (vLLM 0.25.1 skips wait_for_save
        # on steps without one)
        if self.worker is None:
            return StepResult()
        res = self.worker.collect()
        if res.is_empty():
            return res  # most decode steps: nothing to count or hand over (runs every step)
        for k, v in worker_counts(res.report).items():
            if v:
                self._counts[k] = self._counts.get(k, 0) + v
        add_observations(self._observations, worker_observations(res.report))
        # Reports accumulate until build_connector_worker_meta hands them over: a second
        # collection before that (any engine path that polls twice) must not drop the first.
        self._result = self._result.merge(res)
        return res

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        res = self._collect()
        return None, (res.finished_loads or None)

    def get_transfer_results(self) -> Any:
        res = self._collect()
        return compat.transfer_results(set(res.finished_loads), set(res.failed_loads))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Parked loads' failed blocks where this vLLM takes them per block (0.25.1, one
        group), and on every version the blocks of this step's layer-by-layer loads to
        recompute (vLLM's synchronous loads: one group only, where both versions take them)."""
        groups = self.setup.groups
        n = groups.num_engine_groups if groups is not None else 1
        result = self._result
        return (compat.failed_blocks_to_report(result.failed_blocks, n)
                | result.recompute_blocks)

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        if self.worker is None:
            return None
        geoms = [self._geometry] if (self._geometry and not self._geometry_acked) else []
        retrying = find_engine(self.worker.engine, RetryingLoads)
        errors = retrying.take_errors() if retrying is not None else {}
        report = self._result.report
        report.recomputed_blocks |= self._result.recompute_blocks
        mapping = self.store_mapping
        if mapping is not None:  # the scheduler half's confirmation of a store epoch
            report.store_epoch = mapped_epoch(mapping, self.worker.refusing)
        meta = KvtierWorkerMetadata(report=report, geometries=geoms, load_errors=errors)
        self._result = StepResult()
        return meta

    def stats(self) -> dict[str, Any]:
        """Counter increments and histogram observations since the last call (vLLM sums
        and concatenates them over ranks)."""
        counts, self._counts = self._counts, {}
        observed, self._observations = self._observations, {}
        return {**stats_payload(counts, {}), **observed}

    def shutdown(self) -> None:
        if self.store_mapping is not None:
            self.store_mapping.close()
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _pinner(device_is_cuda: bool) -> Pinner | None:
    """The CUDA pinner for a cache on a GPU; vLLM set this worker's device before it
    registered the caches, and the registration is made for the current context."""
    if not device_is_cuda:
        return None
    from kvtier.gpu.pinning import CudaPinner

    return CudaPinner()

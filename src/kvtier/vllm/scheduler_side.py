"""The connector's scheduler side: vLLM's scheduler hooks translated to
:class:`~kvtier.scheduler.OffloadScheduler` calls.

Start-up handshake: the scheduler half sizes nothing until every worker has reported its
:class:`~kvtier.geometry.Geometry` through the worker metadata of an engine step. Until then
lookups are deferred (``None``) and :meth:`SchedulerSide.has_pending_push_work` keeps the
engine stepping, so the first request waits one step, and both halves derive the same slab
layout from the same geometry.
"""

from __future__ import annotations

import time
from typing import Any

from kvtier.geometry import Geometry
from kvtier.layout import GroupKind
from kvtier.log import get_logger
from kvtier.protocol import StepPlan
from kvtier.scheduler import (
    CachedRequest,
    NewRequest,
    OffloadScheduler,
    ScheduledTokens,
    StepInput,
)
from kvtier.store.promotions import store_lower
from kvtier.tiers.setup import DiskTier, open_disk_tier
from kvtier.vllm import compat, startup
from kvtier.vllm.admission import Admission
from kvtier.vllm.counters import scheduler_counts
from kvtier.vllm.failed_loads import (
    completed_failures,
    forget_recomputed_blocks,
    recover_or_stop,
)
from kvtier.vllm.groups import EngineGroups
from kvtier.vllm.hybrid_hits import (
    attention_hit_in_hbm,
    forget_hits_beyond,
    forget_states_beyond,
    state_boundary_in_hbm,
)
from kvtier.vllm.metadata import KvtierMetadata, KvtierWorkerMetadata
from kvtier.vllm.setup import ConnectorSetup
from kvtier.vllm.stats import stats_payload
from kvtier.vllm.store_link import (
    close_index,
    engine_namespace,
    loads_wait_for_epoch,
    stamp_plan,
    store_index_factory,
)

logger = get_logger("vllm.connector")

MAX_GEOMETRY_DEFERRALS = 200
"""Lookups deferred while waiting for the handshake; after that kvtier answers 0 (never hang a
request on a missing handshake)."""

STATS_REFRESH_STEPS = 32
"""Quiet steps (:meth:`SchedulerSide.stats` calls with no lookup, load, save, report or finished
request seen since the last read) after which the counters are read anyway. Reading them
costs more than the rest of a decode step's scheduler-side hooks together, so a quiet step
skips it; what moves without a hook (a lower tier's own threads, a save dropped for want of a
slot) then shows at most this many steps late, its delta never lost."""


class SchedulerSide:
    def __init__(self, setup: ConnectorSetup) -> None:
        self.setup = setup
        self.scheduler: OffloadScheduler | None = None  # made at the handshake
        self.disk: DiskTier | None = None  # the disk tier, if disk_path is set
        self.remote: Any = None  # the remote tier (kvtier.tiers.remote_setup), if remote_url
        self.requests: dict[str, Any] = {}  # vLLM's request objects, by id
        self._deferrals = 0
        self._last_output = time.monotonic()
        self._prefill_tokens = 0
        self._last_counts: dict[str, Any] = {}
        # something the counters count may have moved since they were last read (stats)
        self._moved = True
        self._quiet_reads = 0
        # requests vLLM scheduled before the scheduler half existed: their block tables are
        # unknown, so nothing is saved from them until a step hands over a full table
        self._blind: set[str] = set()
        # requests whose hit, promised by the last lookup, loads layer by layer (not parked)
        self._by_layer: set[str] = set()
        # whether hits may load layer by layer: the setting where it can act, until a worker
        # finds the model's attention skipping vLLM's layer hook
        self.layerwise_loads = setup.layerwise_loads
        # ranks whose forward was heard calling the layer hook on every layer (loads by layer
        # are promised once all setup.world_size have: LayerHookCheck's probe)
        self._hook_ranks_verified = 0
        self._pool: Any = None  # vLLM's block pool (bind_block_pool)
        # whether vLLM's local hit of this hybrid can outrun its state groups' (its pool's
        # entries past a common boundary are then dropped: kvtier.vllm.hybrid_hits)
        self._hybrid_local_hits = False
        self.hits_forgotten = 0  # attention prefix-cache entries dropped for that, ever
        # the store epoch the workers last reported they all map (store_link's
        # loads_wait_for_epoch); None: no report yet
        self._store_epoch_mapped: int | None = None
        self._store_epoch_logged = -1
        # cache-aware admission (cache_aware_admission): None when off or kvtier is off
        self.admission: Admission | None = None
        if setup.config.cache_aware_admission and setup.groups is not None:
            self.admission = Admission(setup.config, setup.priority_policy,
                                       setup.groups.specs)

    def bind_block_pool(self, pool: Any) -> None:
        self._pool = pool
        if self.admission is not None:
            self.admission.bind_pool(pool)
        groups = self.setup.groups
        self._hybrid_local_hits = (
            groups is not None and compat.local_hit_is_longest_group_hit()
            and any(s.kind is GroupKind.STATE for s in groups.specs))

    # -- requests ---------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self.requests[request.request_id] = request
        self._blind.discard(request.request_id)
        if self.scheduler is not None:
            # always a new lifecycle: vLLM may reuse the id of a finished request whose saves
            # are still in flight, and that request's keys are not this one's
            self.scheduler.add_request(request.request_id, getattr(request, "cache_salt", None),
                                       compat.extra_keys_fn(request))

    def _ensure_request(self, request: Any) -> None:
        assert self.scheduler is not None
        if request.request_id in self.scheduler.requests:
            return
        self.requests[request.request_id] = request
        self.scheduler.add_request(request.request_id, getattr(request, "cache_salt", None),
                                   compat.extra_keys_fn(request))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        self._moved = True  # a lookup (counted), or one deferred
        if self._attention_missing_at_local_hit(request, num_computed_tokens):
            return None, False  # asked again next step, at a hit every group holds
        if self._admission_defers(request, num_computed_tokens):
            return None, False  # it shares a chunk on its way into HBM, or does not fit
        if self._store_epoch_unconfirmed():
            n, load = 0, False  # computed here, as a miss is; never a promise a worker refuses
        else:
            n, load = self._matched_tokens(request, num_computed_tokens)
        if n == 0 and self._state_missing_at_local_hit(request, num_computed_tokens):
            return None, False  # asked again next step, at a local hit with its state
        if load and self._loads_by_layer(request, num_computed_tokens, n):
            self._by_layer.add(request.request_id)
            return n, False  # vLLM's synchronous load: computed in this very step
        self._by_layer.discard(request.request_id)
        return n, load

    def _loads_by_layer(self, request: Any, num_computed_tokens: int, n: int) -> bool:
        """Whether the hit of ``n`` tokens is loaded inside the step that computes the rest
        of the prompt (``layerwise_loads`` where this engine allows it). Only while that rest
        is longer than a uniform decode's query: a step of nothing but such queries may
        replay a FULL CUDA graph, which skips the layer waits (the worker then reports the
        blocks as failed, and vLLM recomputes them). And only once every rank's forward was
        heard calling the layer hook on each layer (:class:`~kvtier.worker.LayerHookCheck`):
        a model whose attention skips it is found before any promise."""
        if not self.layerwise_loads or self._hook_ranks_verified < self.setup.world_size:
            return False
        rest = int(request.num_tokens) - num_computed_tokens - n
        return rest > self.setup.decode_query_len

    def _store_epoch_unconfirmed(self) -> bool:
        """Whether a hit must not be promised yet because the workers may not map the store's
        current pool (:func:`kvtier.vllm.store_link.loads_wait_for_epoch`)."""
        sched = self.scheduler
        if (sched is None or not self.setup.loads_must_not_fail
                or not loads_wait_for_epoch(sched.index, self._store_epoch_mapped)):
            return False
        epoch = getattr(sched.index, "epoch", 0)
        if epoch != self._store_epoch_logged:
            self._store_epoch_logged = epoch
            logger.info("kvtier: no store hit is promised until every worker maps the "
                        "store's pool of epoch %d (a promised load must not fail here)", epoch)
        return True

    def _admission_defers(self, request: Any, local_hit: int) -> bool:
        """Cache-aware admission (:mod:`kvtier.vllm.admission`), before kvtier's lookup."""
        adm, sched = self.admission, self.scheduler
        if (adm is None or sched is None or not adm.may_defer
                or self.setup.disabled_reason or compat.skips_prefix_cache(request)):
            return False
        self._ensure_request(request)
        produced = sched.produced_until(request.request_id, _prompt_tokens(request),
                                        local_hit)
        return adm.defer(request, local_hit, produced)

    def _attention_missing_at_local_hit(self, request: Any, local_hit: int) -> bool:
        """Whether vLLM's local hit runs past the attention groups' own (a state group's hit
        is longer): then the state entries past the last boundary every group holds, and the
        attention entries past it, are dropped (:mod:`kvtier.vllm.hybrid_hits`)."""
        pool, groups = self._pool, self.setup.groups
        if not self._hybrid_local_hits or groups is None or local_hit <= 0:
            return False
        hashes = request.block_hashes
        attention_hit = attention_hit_in_hbm(pool, hashes, groups, local_hit)
        if attention_hit >= local_hit:
            return False
        common = state_boundary_in_hbm(pool, hashes, groups, attention_hit)
        dropped = (forget_states_beyond(pool, hashes, groups, common, local_hit)
                   + forget_hits_beyond(pool, hashes, groups, common, local_hit))
        self.hits_forgotten += dropped
        logger.debug("kvtier: request %s: local hit %d, but the attention groups hold only "
                     "%d; %d prefix-cache entries past %d dropped", request.request_id,
                     local_hit, attention_hit, dropped, common)
        return dropped > 0

    def _state_missing_at_local_hit(self, request: Any, local_hit: int) -> bool:
        """Whether vLLM's local hit runs past the state groups' own (kvtier's answer loads
        nothing): then the attention groups' cache entries past the state are dropped
        (:mod:`kvtier.vllm.hybrid_hits`)."""
        pool, groups = self._pool, self.setup.groups
        if not self._hybrid_local_hits or groups is None or local_hit <= 0:
            return False
        hashes = request.block_hashes
        state_hit = state_boundary_in_hbm(pool, hashes, groups, local_hit)
        if state_hit >= local_hit:
            return False
        dropped = forget_hits_beyond(pool, hashes, groups, state_hit, local_hit)
        self.hits_forgotten += dropped
        logger.debug("kvtier: request %s: local hit %d has no state past %d; %d attention "
                     "prefix-cache entries dropped", request.request_id, local_hit, state_hit,
                     dropped)
        return dropped > 0

    def _matched_tokens(self, request: Any, num_computed_tokens: int
                        ) -> tuple[int | None, bool]:
        if self.setup.disabled_reason:
            return 0, False
        if self.scheduler is None:
            self._deferrals += 1
            if self._deferrals > MAX_GEOMETRY_DEFERRALS:
                return 0, False  # never hang a request on a missing handshake
            return None, False
        if compat.skips_prefix_cache(request):
            return 0, False
        self._ensure_request(request)
        n = self.scheduler.lookup(request.request_id, _prompt_tokens(request),
                                  num_computed_tokens)
        return n, bool(n)  # None: the hit is being prepared, ask again next step

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> bool:
        """Start the load of a promised hit; whether vLLM parks the request for it (False:
        none, or loaded layer by layer in this step)."""
        groups = self.setup.groups
        by_layer = request.request_id in self._by_layer
        self._by_layer.discard(request.request_id)
        self._moved = True
        if self.scheduler is None or num_external_tokens == 0 or groups is None:
            return False
        block_ids = groups.to_kvtier(blocks.get_block_ids())
        self.scheduler.start_load(request.request_id, num_external_tokens, block_ids,
                                  by_layer=by_layer)
        return not by_layer

    def cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """vLLM 0.32: the promised tokens of ``request`` by tier (DRAM: host; disk: disk)."""
        per_tier = (self.scheduler.hit_sources(request.request_id)
                    if self.scheduler is not None else {})
        return compat.cache_hit_sources(per_tier, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self) -> tuple[int, ...]:
        if self.setup.groups is None:
            return ()
        return tuple(self.setup.groups.engine_ids)  # every group kvtier restores, state too

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._moved = True
        self.requests.pop(request.request_id, None)
        self._blind.discard(request.request_id)
        self._by_layer.discard(request.request_id)
        if self.admission is not None:
            self.admission.forget(request.request_id)
        if self.scheduler is not None:
            self.scheduler.request_finished(request.request_id)
        # Never hold blocks: saves in flight are fenced when their blocks are reallocated.
        return False, None

    # -- the step ---------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KvtierMetadata:
        sched, groups = self.scheduler, self.setup.groups
        if sched is None or groups is None:
            # vLLM can schedule a request before the layout handshake made the scheduler half
            # (0.32 forces the hit of a request that skips the prefix cache to 0, even when
            # kvtier deferred it; kvtier stops deferring after MAX_GEOMETRY_DEFERRALS)
            self._blind.update(scheduler_output.num_scheduled_tokens)
            return KvtierMetadata(StepPlan(), geometry_known=False)
        for nr in scheduler_output.scheduled_new_reqs:
            if nr.req_id in self.requests:
                self._ensure_request(self.requests[nr.req_id])
        step = step_input(scheduler_output, groups)
        if step.new and not step.cached:
            # Nothing was running, so every earlier step's output is in: the time since the
            # last one was idle (no requests), not this step's; its clock starts now.
            self._last_output = time.monotonic()
        self._blind.difference_update(nr.req_id for nr in step.new)  # a full table
        self._blind.difference_update(c.req_id for c in step.cached if c.resumed)
        step.scheduled = self._scheduled_tokens(scheduler_output)
        plan = stamp_plan(sched.index, sched.schedule_step(step))  # the store's epoch
        # nothing computes this step (every running request waits for a load, a lookup for a
        # promotion): the workers may block a little for what is in flight (IDLE_WAIT_S)
        plan.idle = not scheduler_output.num_scheduled_tokens
        plan.loads_before_forward = self._may_replay_full_graph(plan, scheduler_output)
        chunk = sched.geometry.chunk_tokens
        if (step.new or self._prefill_tokens or plan.loads or plan.saves or plan.verifies
                or plan.tiers or plan.fence or plan.reset
                or any(s.computed_before is None
                       or s.computed_after // chunk != s.computed_before // chunk
                       for s in step.scheduled)):  # a chunk filled: saved, or dropped
            self._moved = True  # else a decode step with nothing to count
        if self.admission is not None:
            self.admission.step_planned(scheduler_output, sched.loads_in_flight(),
                                        sched.producing_chunks())
        return KvtierMetadata(plan, geometry_known=True)

    def _may_replay_full_graph(self, plan: StepPlan, scheduler_output: Any) -> bool:
        """Whether this step has loads by layer and a forward that may replay a FULL CUDA
        graph: no request computes more than a uniform decode's query. A hit promised by
        layer had more left than that (:meth:`_loads_by_layer`), but the step's token
        budget can give its request fewer; such a forward skips every layer hook."""
        if not any(job.by_layer for job in plan.loads):
            return False
        scheduled = scheduler_output.num_scheduled_tokens.values()
        return max(scheduled, default=0) <= self.setup.decode_query_len

    def _scheduled_tokens(self, scheduler_output: Any) -> list[ScheduledTokens]:
        """What each computing request's saves are planned from (draft tokens left out);
        counts this step's prefill tokens for the prefill-rate estimate."""
        scheduled = []
        spec = compat.spec_decode_tokens(scheduler_output)
        prefill = 0
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req_id in self._blind:
                continue
            computed_after = req.num_computed_tokens + n_sched - len(spec.get(req_id, ()))
            if req.num_computed_tokens < req.num_prompt_tokens:
                prefill += n_sched
            scheduled.append(ScheduledTokens(req_id, req.all_token_ids, computed_after,
                                             req.num_prompt_tokens, req.num_computed_tokens))
        self._prefill_tokens = prefill
        return scheduled

    def update_connector_output(self, connector_output: Any) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KvtierWorkerMetadata):
            return
        if self.scheduler is None and wm.geometries:
            self._start_scheduler(wm.geometries)
        if wm.report.store_epoch is not None:
            self._store_epoch_mapped = wm.report.store_epoch
        if wm.report.layer_hooks_verified and self.layerwise_loads:
            self._hook_ranks_verified += wm.report.layer_hooks_verified
            if self._hook_ranks_verified >= self.setup.world_size:
                logger.info("kvtier: every rank's forward called vLLM's wait_for_layer_load "
                            "on each layer: hits load layer by layer from now on")
        if wm.report.layer_hooks_missing and self.layerwise_loads:
            self.layerwise_loads = False
            logger.warning("kvtier: layerwise_loads is set, but the model's attention "
                           "skips vLLM's wait_for_layer_load on some layers (the workers "
                           "log which); from now on hits are loaded with the request "
                           "parked")
        if self.scheduler is not None:
            if self.setup.loads_must_not_fail:
                self._recover_failed_loads(wm)
            if not wm.report.empty() or wm.report.checksum_failures or wm.report.tiers:
                self._moved = True
            if wm.report.recomputed_blocks and self._pool is not None:
                forget_recomputed_blocks(self._pool, self.scheduler, wm.report.recomputed_blocks)
            self.scheduler.on_report(wm.report)
            now = time.monotonic()
            self.scheduler.observe_step(now - self._last_output, self._prefill_tokens)
            self._last_output = now

    def _recover_failed_loads(self, wm: KvtierWorkerMetadata) -> None:
        """Promised loads that failed for good where vLLM has no report path for them:
        recompute from the local hit, or stop (:mod:`kvtier.vllm.failed_loads`)."""
        assert self.scheduler is not None and self.setup.groups is not None
        for job_id, req_id, promised in completed_failures(self.scheduler, wm.report):
            request = self.requests.get(req_id)
            if request is None:
                continue  # finished (aborted while parked): vLLM frees its blocks
            reason = wm.load_errors.get(job_id, "the copy failed on a rank")
            recover_or_stop(request, promised, self.setup.groups, reason)

    def _start_scheduler(self, geometries: list[Geometry]) -> None:
        setup = self.setup
        if len(geometries) < setup.world_size:
            return  # wait until every rank reported
        geometry = geometries[0]
        if any(g != geometry for g in geometries):
            raise RuntimeError(f"kvtier: ranks disagree on the KV layout: {geometries}")
        num_shards = 1 if setup.replicated else setup.world_size
        with startup.failures():
            slab_layout = geometry.slab_layout(setup.config, num_shards)
        ns = engine_namespace(setup, geometry)
        if setup.config.disk_path is not None:
            with startup.failures():  # disk_path, disk_size, the lock, the index rebuild
                self.disk = open_disk_tier(setup.config, geometry, ns, slab_layout, num_shards)
        if setup.config.remote_url is not None:
            from kvtier.tiers.remote_setup import open_remote_tier  # imports redis

            with startup.failures():
                self.remote = open_remote_tier(setup.config, geometry, ns, slab_layout,
                                               num_shards)
        # top first: DRAM -> disk -> remote (kvtier.tiers.stack)
        lower = [t.lower for t in (self.disk, self.remote) if t is not None]
        if setup.config.store_url:  # the store's own tiers below its pool (kvtier.store.tiers)
            lower = [store_lower(ns, geometry)]
        self.scheduler = OffloadScheduler(setup.config, geometry, ns, slab_layout,
                                          world_size=setup.world_size,
                                          loads_enabled=setup.loads_enabled,
                                          prepare_hits=prepares_hits(setup),
                                          draft_lookahead=setup.draft_lookahead,
                                          lower=lower,
                                          index_factory=store_index_factory(setup, ns, geometry)
                                          if setup.config.store_url else None)
        for req in list(self.requests.values()):
            self._ensure_request(req)
        self._moved = True  # the gauges exist from now on
        logger.info("kvtier: %d chunk slots per group of %d tokens, %s%s",
                    slab_layout.classes[0].num_slots, geometry.chunk_tokens,
                    [c.name for c in slab_layout.classes],
                    "; EAGLE/MTP drafts: chunk keys cover the next token"
                    if setup.draft_lookahead else "")

    def has_pending_push_work(self) -> bool:
        if self.setup.disabled_reason:
            return False
        if self.scheduler is None:
            return bool(self.requests) and self._deferrals <= MAX_GEOMETRY_DEFERRALS
        return self.scheduler.has_pending_work()

    def stats(self) -> dict[str, Any]:
        """Counter deltas since the last payload, and the gauges (:mod:`kvtier.vllm.counters`);
        empty when nothing moved. vLLM calls this every step: a quiet one (no hook saw
        activity since the last read) skips the read for up to :data:`STATS_REFRESH_STEPS`
        calls."""
        if not self._moved and self._quiet_reads < STATS_REFRESH_STEPS:
            self._quiet_reads += 1
            return {}
        self._moved, self._quiet_reads = False, 0
        counts = scheduler_counts(self.scheduler) if self.scheduler is not None else {}
        if counts == self._last_counts:
            # nothing moved (most decode steps): the payload would hold gauges alone, which
            # vLLM drops (KvtierStats.is_empty), so skip building it; this runs every step
            return {}
        before, self._last_counts = self._last_counts, counts
        return stats_payload(counts, before)

    def shutdown(self) -> None:
        """Release the disk tier's directory lock (the next engine may use it) and the
        store's connection."""
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()
        if self.scheduler is not None:
            close_index(self.scheduler.index)

    def reset_cache(self) -> bool | None:
        self._moved = True
        if self.scheduler is not None:
            self.scheduler.reset()
        return True


def prepares_hits(setup: ConnectorSetup) -> bool:
    """Verify hits before promising them exactly where a promised load cannot fail
    (:func:`kvtier.vllm.compat.promises_are_final`) and checksums are verified."""
    groups = setup.groups
    return (setup.config.verify_checksums and groups is not None
            and compat.promises_are_final(len(groups.engine_ids)))


def step_input(scheduler_output: Any, groups: EngineGroups) -> StepInput:
    """vLLM's scheduler output as kvtier's step input (block tables in kvtier's groups), less
    the scheduled tokens. A request preempted since the last step (reset_prefix_cache with
    reset_running_requests preempts between steps) may be resumed in this very step: the
    scheduler orders that, not this translation."""
    new = [NewRequest(nr.req_id, groups.to_kvtier(nr.block_ids))
           for nr in scheduler_output.scheduled_new_reqs]
    cached_out = scheduler_output.scheduled_cached_reqs
    cached = []
    for i, req_id in enumerate(cached_out.req_ids):
        new_ids = cached_out.new_block_ids[i]
        cached.append(CachedRequest(
            req_id, None if new_ids is None else groups.to_kvtier(new_ids),
            resumed=compat.is_resumed(cached_out, i, req_id) and new_ids is not None))
    copies = compat.copy_targets(scheduler_output)
    return StepInput(
        preempted=compat.preempted_ids(scheduler_output), new=new, cached=cached,
        copy_targets=[copies] * len(groups.engine_ids) if copies else [],
    )


def _prompt_tokens(request: Any) -> Any:
    """The request's known tokens (``num_tokens`` of them), without copying them where
    vLLM's list holds exactly those (a copy of a 17k-token prompt costs ~30 us a lookup)."""
    tokens = request.all_token_ids
    return tokens if len(tokens) == request.num_tokens else tokens[: request.num_tokens]

"""What the connector decides once, at start-up, from vLLM's configuration: kvtier's settings,
the engine's shape (ranks, KV-cache groups) and what kvtier does for it (off, saving only,
saving and loading). Both sides take the same :class:`ConnectorSetup`. Refusals go through
:mod:`kvtier.vllm.startup` (one ``kvtier: ...`` line, printed last).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.layout import GroupKind
from kvtier.log import get_logger
from kvtier.vllm import compat, startup
from kvtier.vllm.groups import EngineGroups, UnsupportedModel, engine_groups

logger = get_logger("vllm.connector")


@dataclass(frozen=True)
class ConnectorSetup:
    config: KvtierConfig
    world_size: int  # tensor x pipeline ranks
    tp_size: int
    groups: EngineGroups | None  # None: kvtier cannot serve this model
    disabled_reason: str | None  # set: kvtier is off for this engine
    loads_enabled: bool  # False: saving only
    # vLLM has no report path for a promised load (0.25.1, several KV-cache groups): failed
    # copies are re-issued, then recovered or fatal (kvtier.vllm.failed_loads)
    loads_must_not_fail: bool
    replicated: bool  # one slab copy for every rank (MLA under TP)
    kv_cache_dtype: str
    model_name: str
    draft_lookahead: int = 0  # 1 with EAGLE/MTP drafts: a chunk's key covers the next token
    priority_policy: bool = False  # vLLM's scheduling policy is "priority" (not FCFS)
    # hits are restored inside the step that computes the rest of the prompt, layer by
    # layer (``layerwise_loads`` where this engine allows it: :func:`layerwise_loads`)
    layerwise_loads: bool = False
    # a load by layer that fails after its promise stops the engine (the asynchronous
    # scheduler: layer_load_failures_fatal); else vLLM recomputes its blocks in that step
    layer_load_failures_fatal: bool = False
    # tokens a request computes per step in a uniform decode batch (1 + speculative tokens):
    # a batch of only such requests may replay a FULL CUDA graph, which skips the layer waits
    decode_query_len: int = 1


def set_up(vllm_config: Any, kv_transfer_config: Any, kv_cache_config: Any,
           is_scheduler: bool) -> ConnectorSetup:
    """Read and check everything; a setting or combination kvtier refuses is a
    :class:`~kvtier.vllm.startup.StartupError` (a ValueError) naming the fix."""
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    with startup.failures(todo=startup.SETTINGS_TODO):
        config = KvtierConfig.load(extra)
    startup.check_failure_policy(compat.load_failure_policy(kv_transfer_config),
                                 config.allow_fail_policy)
    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    disabled_reason = "pipeline parallelism is not supported yet" if pp > 1 else None
    groups: EngineGroups | None = None
    try:
        groups = engine_groups(kv_cache_config)
    except UnsupportedModel as e:
        disabled_reason = str(e)
    if groups is not None and disabled_reason is None:
        check_state_cache_mode(vllm_config, groups)
    loads_enabled = _loads_enabled(vllm_config, is_scheduler)
    if disabled_reason:
        logger.warning("kvtier is off for this engine: %s", disabled_reason)
    must_not_fail = groups is not None and compat.promised_loads_must_not_fail(
        groups.num_engine_groups)
    by_layer = (config.layerwise_loads and groups is not None and not disabled_reason
                and layerwise_loads(config, vllm_config, groups, must_not_fail,
                                    is_scheduler))
    return ConnectorSetup(
        config=config, world_size=tp * pp, tp_size=tp, groups=groups,
        disabled_reason=disabled_reason, loads_enabled=loads_enabled,
        loads_must_not_fail=must_not_fail,
        replicated=bool(getattr(vllm_config.model_config, "use_mla", False)) and tp > 1,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        model_name=str(vllm_config.model_config.model),
        draft_lookahead=draft_lookahead(vllm_config),
        priority_policy=str(getattr(getattr(vllm_config, "scheduler_config", None), "policy",
                                    "fcfs")).lower().endswith("priority"),
        layerwise_loads=bool(by_layer),
        layer_load_failures_fatal=bool(by_layer) and layer_load_failures_fatal(vllm_config),
        decode_query_len=1 + num_speculative_tokens(vllm_config),
    )


def num_speculative_tokens(vllm_config: Any) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0


def layerwise_loads(config: KvtierConfig, vllm_config: Any, groups: EngineGroups,
                    loads_must_not_fail: bool, warn: bool) -> bool:
    """Whether ``layerwise_loads`` (set) can act in this engine; where it cannot, one warning
    (from the scheduler's connector, ``warn``) says why and hits are loaded parked.

    A layer-by-layer load is vLLM's synchronous load: the forward of the same step reads the
    blocks, each attention layer after ``wait_for_layer_load``. So: one KV-cache group (0.25.1
    reports a failed synchronous load by block id for one group only, and several groups
    cannot report at all there), plain attention (a state or window group is read whole by
    other kernels), no EAGLE/MTP drafts (their draft layers' KV is not on the same hook),
    checksums off (a load is verified per chunk, not per layer), no node-wide store under
    the asynchronous scheduler (:func:`layer_load_failures_fatal`) and no CUDA graph that
    holds a whole forward of a batch that is not a uniform decode (a replayed FULL graph
    never calls the hook: only ``cudagraph_mode`` FULL does that)."""
    why = None
    if len(groups.specs) != 1 or groups.specs[0].kind is not GroupKind.FULL:
        why = "the model has more than one KV-cache group, or one that is not plain attention"
    elif loads_must_not_fail:
        why = "this vLLM cannot report a failed load for this model"
    elif draft_lookahead(vllm_config):
        why = "EAGLE/MTP drafts run"
    elif config.verify_checksums:
        why = "verify_checksums is on (a restore is verified per chunk, not per layer)"
    elif async_scheduling(vllm_config) and config.store_url is not None:
        # under the asynchronous scheduler a promised load by layer must not fail
        # (layer_load_failures_fatal), and a worker refuses every job while it does not map
        # the node-wide store's current pool (a store restart)
        why = ("vLLM schedules asynchronously and the slab lies in a node-wide store (a store "
               "restart would fail a promised load); start vLLM with --no-async-scheduling "
               "to use both")
    elif _mixed_batches_full_graph(vllm_config):
        why = ("cudagraph_mode is FULL: a replayed graph of a whole forward skips the layer "
               "waits (FULL_AND_PIECEWISE, vLLM's default, is fine)")
    if why is not None and warn:
        logger.warning("kvtier: layerwise_loads is set, but %s; hits are loaded with the "
                       "request parked", why)
    elif warn and layer_load_failures_fatal(vllm_config):
        logger.info("kvtier: layerwise_loads under vLLM's asynchronous scheduler: a load by "
                    "layer that fails after its promise stops the engine (vLLM cannot "
                    "recompute it safely there)")
    return why is None


def async_scheduling(vllm_config: Any) -> bool:
    return bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling",
                        False))


def layer_load_failures_fatal(vllm_config: Any) -> bool:
    """Whether a load by layer that fails after its promise must stop the engine: under the
    asynchronous scheduler. The step after the failed one is scheduled already, and vLLM's
    recompute of a failed synchronous load there can leave a block holding KV of a token it
    then replaced (found by the fault-injection harness: vLLM 0.32, two ranks, a failed load,
    then a preemption). Nothing kvtier decides fails such a load after the promise: every
    refusal is made before it (the hit in the DRAM tier, no checksums, no store), and the
    layer hook is heard on every layer first (:class:`~kvtier.worker.LayerHookCheck`). What
    is left is a CUDA error (the engine is lost anyway) or a bug: stopping beats serving KV
    of other tokens."""
    return async_scheduling(vllm_config)


def _mixed_batches_full_graph(vllm_config: Any) -> bool:
    """Whether a batch that is not a uniform decode may replay a FULL CUDA graph."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    mixed = getattr(mode, "mixed_mode", None)
    if mixed is None:
        return False
    return str(getattr(mixed(), "name", "")) == "FULL"


def draft_lookahead(vllm_config: Any) -> int:
    """1 when EAGLE/MTP drafts run (``SpeculativeConfig.use_eagle()``, vLLM 0.25.1 and 0.32),
    else 0. Their draft layers' KV at a chunk's last position is computed from the token
    after the chunk, so kvtier keys each chunk with that token too (:mod:`kvtier.keys`);
    vLLM's own prefix cache drops the last block of such a hit instead. Other methods
    (n-gram, a separate draft model) write no KV that looks ahead."""
    spec = getattr(vllm_config, "speculative_config", None)
    return 1 if spec is not None and spec.use_eagle() else 0


STATE_CACHE_MODES = ("align", "all")
"""``mamba_cache_mode`` values that keep a recurrent state per block position (what kvtier
saves at a boundary and restores there); ``none`` keeps one running state per request."""


def check_state_cache_mode(vllm_config: Any, groups: EngineGroups) -> None:
    """Refuse a model with recurrent-state groups whose states vLLM does not keep per block
    (``cache_config.mamba_cache_mode`` 'none', what vLLM picks without prefix caching)."""
    if not any(s.kind is GroupKind.STATE for s in groups.specs):
        return
    mode = str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none"))
    if mode not in STATE_CACHE_MODES:
        startup.fail(f"mamba_cache_mode={mode!r} keeps one recurrent state per request, which "
                     "kvtier cannot store per prefix",
                     "start vLLM with --enable-prefix-caching (vLLM then picks "
                     "mamba_cache_mode 'align'), or set --mamba-cache-mode align or all")


def _loads_enabled(vllm_config: Any, is_scheduler: bool) -> bool:
    sched_policy = str(getattr(vllm_config.scheduler_config, "policy", "fcfs"))
    if (is_scheduler and sched_policy == "priority"
            and not compat.parked_requests_drained_first()):
        logger.warning("kvtier: this vLLM's priority scheduler can leave a request parked "
                       "for a load behind a higher-priority request that needs its blocks "
                       "(a deadlock): saving only, loads are off; use the fcfs policy or "
                       "vLLM >= 0.32")
        return False
    return True

"""Every difference between the vLLM versions kvtier supports (0.25.1 and 0.32), in one place.

The scheduler side and the worker side ask this module, never vLLM's version or the shape of
its objects directly. docs/vllm-api.md lists the API differences line by line; each function
here says which one it absorbs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from typing import Any

from kvtier.keys import UNSUPPORTED

try:  # vLLM 0.32: failures per request
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    HAS_FAILED_RECVING = True
except ImportError:  # vLLM 0.25.1: failures per block, which only one KV-cache group takes
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]
    HAS_FAILED_RECVING = False

try:  # vLLM 0.32: cached prompt tokens by tier (vllm:prompt_tokens_cached_by_source)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_CACHE_HIT_SOURCE: Any = CacheHitSource.HOST
    # kvtier's tier names -> vLLM's; a tier vLLM has no name for (a remote store) is
    # external_unspecified, as vLLM's docs say for remote stores
    _TIER_SOURCES: dict[str, Any] = {"dram": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
    _UNNAMED_SOURCE: Any = CacheHitSource.EXTERNAL_UNSPECIFIED
except ImportError:  # vLLM 0.25.1: no tiers in its stats
    HOST_CACHE_HIT_SOURCE = None
    _TIER_SOURCES, _UNNAMED_SOURCE = {}, None


try:  # vLLM 0.25.1: a connector may ask for one KV tensor of every layer
    # (prefer_cross_layer_blocks, then register_cross_layers_kv_cache); 0.32 has neither
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    HAS_CROSS_LAYER_REGISTRATION = hasattr(KVConnectorBase_V1, "register_cross_layers_kv_cache")
except ImportError:  # no vLLM at all
    HAS_CROSS_LAYER_REGISTRATION = False


def cache_hit_sources(per_tier: dict[str, int], num_external_tokens: int) -> dict[Any, int]:
    """vLLM 0.32's split of a promised hit by ``CacheHitSource`` from kvtier's split by tier
    name (:meth:`kvtier.scheduler.OffloadScheduler.hit_sources`). The counts must sum to
    ``num_external_tokens``; where kvtier's do not (a hit vLLM got otherwise), all of them
    are host-memory tokens, as ``_cache_hit_source`` says."""
    if num_external_tokens == 0 or HOST_CACHE_HIT_SOURCE is None:
        return {}
    if sum(per_tier.values()) != num_external_tokens:
        return {HOST_CACHE_HIT_SOURCE: num_external_tokens}
    out: dict[Any, int] = {}
    for tier, n in per_tier.items():
        source = _TIER_SOURCES.get(tier, _UNNAMED_SOURCE)
        out[source] = out.get(source, 0) + n
    return out

try:
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
except ImportError:  # pragma: no cover
    generate_block_hash_extra_keys = None  # type: ignore[assignment]


def load_failures_per_block(num_engine_groups: int) -> bool:
    """Whether vLLM takes load failures per block (``invalid_block_ids``): 0.25.1 with one
    KV-cache group. 0.32 takes them per request (``failed_recving``)."""
    return not HAS_FAILED_RECVING and num_engine_groups == 1


def promised_loads_must_not_fail(num_engine_groups: int) -> bool:
    """Whether a load, once promised, has no report path: 0.25.1 with several KV-cache
    groups, whose per-block report unpacks one group (``(req_block_ids,) = ...``,
    ``v1/core/sched/scheduler.py:2546``) and kills the engine, whoever owns the block.
    kvtier then re-issues failed copies and recovers or stops in ``update_connector_output``
    (docs/notes/hybrid-loads-025.md)."""
    return not HAS_FAILED_RECVING and num_engine_groups > 1


def promises_are_final(num_groups: int) -> bool:
    """Whether a load cannot fail once kvtier promised its tokens: 0.25.1 with several
    KV-cache groups has no safe way to report it (docs/notes/hybrid-loads-025.md, option
    (b)), so there hits are prepared (verified) before the promise (:mod:`kvtier.prepare`)."""
    return num_groups > 1 and not HAS_FAILED_RECVING


def local_hit_is_longest_group_hit() -> bool:
    """Whether vLLM tells the connector of a mamba hybrid the longest of its groups' local
    hits rather than their common hit: 0.25.1, for any connector (``sched.py:687-715``);
    0.32 only for connectors that opt in (``supports_divergent_local_hybrid_hits``), which
    kvtier does not (docs/vllm-api.md §0 item 8)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return not hasattr(KVConnectorBase_V1, "supports_divergent_local_hybrid_hits")


def parked_requests_drained_first() -> bool:
    """Whether vLLM's scheduler admits requests that hold KV blocks (parked loads) before the
    others. 0.32 keeps them in a queue of their own, drained first; 0.25.1's priority policy
    compares the heads of its waiting and skipped queues by priority and stops at the first
    request it cannot allocate, which can be one that needs the parked request's blocks."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:  # pragma: no cover
        return True
    return hasattr(Scheduler, "_holds_kv_blocks")


def load_failure_policy(kv_transfer_config: Any) -> str:
    """``kv_load_failure_policy`` of the transfer config (recompute where vLLM has none)."""
    return str(getattr(kv_transfer_config, "kv_load_failure_policy", "recompute"))


def extra_keys_fn(request: Any) -> Callable[[int, int], object] | None:
    """The request's extra block-hash keys (multimodal, LoRA, ...) as vLLM computes them,
    for token ranges in order; :data:`~kvtier.keys.UNSUPPORTED` where vLLM cannot say."""
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


def skips_prefix_cache(request: Any) -> bool:
    """Prompt logprobs need every token computed: 0.32 forces such a request's hit to 0,
    0.25.1 asks the connector anyway."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def preempted_ids(scheduler_output: Any) -> list[str]:
    """Requests preempted since the last step (0.32 lists them; absent on older outputs)."""
    return list(getattr(scheduler_output, "preempted_req_ids", None) or ())


def is_resumed(cached_out: Any, i: int, req_id: str) -> bool:
    """Whether cached request ``i`` comes back from preemption: 0.32 names them in
    ``resumed_req_ids``, 0.25.1 flags them in ``resumed_from_preemption``."""
    resumed: Collection[str] = getattr(cached_out, "resumed_req_ids", None) or set()
    flags = getattr(cached_out, "resumed_from_preemption", None)
    return req_id in resumed or bool(flags and flags[i])


def copy_targets(scheduler_output: Any) -> list[int]:
    """Destination blocks of this step's KV block copies (0.32's ``kv_cache_block_copies``;
    none on 0.25.1): blocks handed out that no request table shows."""
    return [dst for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ()
            if (dst := getattr(copy, "dst_block_id", None)) is not None]


def spec_decode_tokens(scheduler_output: Any) -> dict[str, Any]:
    """Draft tokens scheduled per request (their KV is not kept: never saved)."""
    return getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}


def transfer_results(finished_recving: set[str], failed_recving: set[str]) -> Any:
    """0.32's ``get_transfer_results`` value (0.25.1 never calls that hook)."""
    return KVConnectorTransferResults(finished_sending=set(), finished_recving=finished_recving,
                                      failed_recving=failed_recving)


def failed_blocks_to_report(failed_blocks: set[int], num_engine_groups: int) -> set[int]:
    """``get_block_ids_with_load_errors``: the failed blocks where vLLM takes failures per
    block (0.25.1, one group); none on 0.32 (``failed_recving`` carries them) and none on
    0.25.1 with several groups (a report there kills the engine, see
    :func:`promised_loads_must_not_fail`)."""
    return set(failed_blocks) if load_failures_per_block(num_engine_groups) else set()


def rank() -> int:
    """This worker's rank among the ranks of its engine: the tensor-parallel group's rank
    (kvtier is off under pipeline parallelism). Not the world group's: with data parallelism
    the world spans every engine, so a second engine's ranks would index past its shards.
    RANK where vLLM has no group (tests)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:
        return int(os.environ.get("RANK", "0"))

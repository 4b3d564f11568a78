"""The ranks of one vLLM engine that share its slab: the tensor-parallel group."""

from __future__ import annotations

from typing import Any

from kvtier.shm import ProcessGroupRanks, SharedSlab


def engine_shared_slab(vllm_config: Any) -> SharedSlab:
    """How this worker's engine shares its slab: over vLLM's tensor-parallel CPU (gloo) group,
    which holds exactly this engine's ranks (pipeline parallelism switches kvtier off; data-
    parallel engines each have their own group), named for the engine id. Call on a worker,
    after vLLM initialized its distributed state."""
    from vllm.distributed.parallel_state import get_tp_group

    engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None) or "engine"
    return SharedSlab(str(engine_id), ProcessGroupRanks(get_tp_group().cpu_group))

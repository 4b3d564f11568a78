"""Test support: what vLLM registers for a model, seen without kvtier. Never used in production.

- ``CensusConnector``: a KV connector that moves nothing and promises nothing (no external
  tokens, no deferred frees); it keeps the dict vLLM passes to ``register_kv_caches``, so a
  bare run sees exactly the tensors a real connector would get. It declares HMA support so
  vLLM keeps its hybrid KV-cache manager (several groups) as it would for kvtier.
- ``rpc_census``: for ``LLM.collective_rpc``: the worker's KV-cache groups (kind, block size,
  layers, every spec field) and the registered tensors (name, shape, dtype, stride, storage
  offset). Without the census connector, tensors come from the layers' own ``kv_cache``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class CensusConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.registered: dict[str, Any] = {}

    # -- scheduler side: never a hit, never a deferred free ------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   **kwargs: Any) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int,
                                 **kwargs: Any) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any, **kwargs: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any,
                         **kwargs: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any,
                                    **kwargs: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # -- worker side: remember the registration, move nothing ----------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], **kwargs: Any) -> None:
        self.registered = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str, **kwargs: Any) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self, **kwargs: Any) -> None:
        return None


def jsonable(value: Any) -> Any:
    """Spec fields as JSON: dtypes and enums by name, dataclasses and tuples recursively."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"kind": type(value).__name__, **out}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return getattr(value, "name", None) or str(value)


def describe_tensors(value: Any) -> list[dict[str, Any]]:
    """One entry per tensor of a registered value (a tensor, or a list of state tensors)."""
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    return [{"shape": list(t.shape), "dtype": jsonable(t.dtype), "stride": list(t.stride()),
             "storage_offset": int(t.storage_offset()), "nbytes_storage":
             int(t.untyped_storage().nbytes())} for t in tensors]


def _groups(kv_cache_config: Any) -> list[dict[str, Any]]:
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        out.append({"kind": type(spec).__name__, "block_size": int(spec.block_size),
                    "num_layers": len(group.layer_names), "layers": list(group.layer_names),
                    "page_size_bytes": int(spec.page_size_bytes), "spec": jsonable(spec)})
    return out


def _layer_caches(runner: Any) -> dict[str, Any]:
    context = runner.vllm_config.compilation_config.static_forward_context
    return {name: layer.kv_cache for name, layer in context.items()
            if isinstance(getattr(layer, "kv_cache", None), (torch.Tensor, list))
            and len(layer.kv_cache) > 0}


def rpc_census(worker: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc``: this rank's KV-cache groups and registered tensors."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    runner = worker.model_runner
    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    if isinstance(connector, CensusConnector):
        source, tensors = "register_kv_caches", connector.registered
    else:
        source, tensors = "layer.kv_cache", _layer_caches(runner)
    config = runner.kv_cache_config
    return {"num_blocks": int(config.num_blocks), "groups": _groups(config),
            "tensors_from": source,
            "tensors": {name: describe_tensors(v) for name, v in sorted(tensors.items())}}

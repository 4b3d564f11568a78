"""vLLM objects for the harness, on 0.32 (the venv) and 0.25.1 (``PYTHONPATH=.cache/vllm-0.25.1``).

Built the way vLLM's own ``tests/v1/kv_connector/unit/utils.py`` builds them: a real
``VllmConfig`` with ``DeviceConfig("cpu")``, a ``KVCacheConfig`` of one ``FullAttentionSpec``
group, the real ``Scheduler`` / ``AsyncScheduler`` (which creates the scheduler half of
KvtierConnector from ``kv_transfer_config``), requests with vLLM's sha256 block hasher, and
``ModelRunnerOutput`` / ``KVConnectorOutput`` as the model runner returns them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from .workload import BLOCK_SIZE, MAX_MODEL_LEN, Scenario

VERSION = vllm.__version__
IS_025 = VERSION.startswith("0.25")
HAS_FAILED_RECVING = "failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}
MODEL_DIR = Path(__file__).resolve().parent / "tiny_model"
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
STATE_SHAPE = (8,)  # bytes of each of a mamba layer's two state tensors, per block

__all__ = [
    "HAS_FAILED_RECVING", "IS_025", "LAYERS", "STATE_SHAPE", "VERSION", "KVConnectorOutput",
    "KVConnectorRole", "KVOutputAggregator", "ModelRunnerOutput", "Request", "RequestStatus",
]

_none_hash_ready = False


@functools.lru_cache(maxsize=1)
def model_config() -> ModelConfig:
    return ModelConfig(model=str(MODEL_DIR), dtype="float32", seed=0, skip_tokenizer_init=True,
                       max_model_len=MAX_MODEL_LEN)


def extra_config(sc: Scenario) -> dict[str, Any]:
    state = {"state_size": sc.state_size} if sc.state_size else {}
    defer = {"cache_aware_admission": True, "defer_max_steps": 8} if sc.admission_defers else {}
    layerwise = {"layerwise_loads": True} if sc.layerwise else {}
    return {
        **state,
        **defer,
        **layerwise,
        "dram_size": sc.dram_size,
        "gpu_staging_size": sc.dram_size,
        "chunk_tokens": sc.chunk_tokens,
        "max_pending_saves": sc.max_pending_saves,
        "max_pending_loads": sc.max_pending_loads,
        "policy": sc.policy,
        "admission": sc.admission,
        "cost_model": False,  # timing-based decisions would make runs irreproducible
    }


def vllm_config(sc: Scenario, extra: dict[str, Any] | None = None) -> VllmConfig:
    kv = KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra if extra is not None else extra_config(sc),
    )
    sched = SchedulerConfig(
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        policy=sc.sched_policy,
        enable_chunked_prefill=True,
        async_scheduling=sc.async_scheduling,
    )
    cfg = VllmConfig(
        model_config=model_config(),
        scheduler_config=sched,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True,
                                 mamba_cache_mode="align" if "mamba" in sc.groups else "none"),
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=sc.world_size),
    )
    cfg.cache_config.num_gpu_blocks = sc.num_blocks
    # what real vLLM holds whenever the AsyncScheduler runs (make_scheduler picks it by the
    # scenario; VllmConfig resolves the setting to False here, with no async executor)
    cfg.scheduler_config.async_scheduling = sc.async_scheduling
    return cfg


def group_layers(groups: tuple[str, ...]) -> list[list[str]]:
    """The layer names of each group: group 0 two attention layers, then one layer each."""
    out = [list(LAYERS)]
    for i, kind in enumerate(groups[1:], start=2):
        out.append([f"model.layers.{i}.{'mixer' if kind == 'mamba' else 'self_attn.attn'}"])
    return out


def _spec(kind: str, sc: Scenario) -> Any:
    if kind == "mamba":
        return MambaSpec(block_size=BLOCK_SIZE, shapes=(STATE_SHAPE, STATE_SHAPE),
                         dtypes=(torch.uint8, torch.uint8), mamba_cache_mode="align")
    if kind == "swa":
        return SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                                 dtype=torch.float32, sliding_window=sc.sliding_window)
    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)


def kv_cache_config(sc: Scenario) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=sc.num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layers, _spec(kind, sc))
        for kind, layers in zip(sc.groups, group_layers(sc.groups))])


def make_scheduler(sc: Scenario, cfg: VllmConfig, kvc: KVCacheConfig) -> Scheduler:
    cls = AsyncScheduler if sc.async_scheduling else Scheduler
    return cls(vllm_config=cfg, kv_cache_config=kvc, log_stats=True,
               structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK_SIZE)


def make_request(req_id: str, prompt: list[int], max_tokens: int, priority: int = 0,
                 cache_salt: str | None = None, skip_prefix_cache: bool = False) -> Request:
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                        skip_reading_prefix_cache=skip_prefix_cache or None)
    sp.update_from_generation_config({}, None)
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                   pooling_params=None, priority=priority, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


_MRO_FIELDS = {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def runner_output(req_ids: list[str], sampled: list[list[int]],
                  kv: KVConnectorOutput | None) -> ModelRunnerOutput:
    kw: dict[str, Any] = dict(req_ids=req_ids,
                              req_id_to_index={r: i for i, r in enumerate(req_ids)},
                              sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                              kv_connector_output=kv)
    if "pooler_output" in _MRO_FIELDS:
        kw["pooler_output"] = None
    return ModelRunnerOutput(**kw)


def kv_output(finished_recving: set[str] | None, failed_recving: set[str] | None,
              invalid_block_ids: set[int], worker_meta: Any, stats: Any) -> KVConnectorOutput:
    kw: dict[str, Any] = dict(finished_sending=None, finished_recving=finished_recving or None,
                              kv_connector_stats=stats, kv_connector_worker_meta=worker_meta,
                              invalid_block_ids=set(invalid_block_ids))
    if HAS_FAILED_RECVING:
        kw["failed_recving"] = set(failed_recving or ())
    return KVConnectorOutput(**kw)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """vLLM's and kvtier's warnings off while scenarios run (each builds engines' worth of
    connectors); levels restored after, so that other tests in the process see their logs."""
    loggers = [logging.getLogger(n) for n in ("vllm", "kvtier")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)

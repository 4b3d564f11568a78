"""Start-up checks of the vLLM connector (no engine run): the failure policy, configuration
errors, what it declares to vLLM, and the plugin's short name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness.compat import BLOCK_SIZE, LAYERS, model_config


def _configs(policy: str, extra: dict[str, Any], mamba_cache_mode: str | None = None
             ) -> tuple[Any, Any]:
    """One full-attention group; with ``mamba_cache_mode``, a recurrent-state group beside it
    and that mode in the cache config."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    cfg = VllmConfig(
        model_config=model_config(),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                         max_model_len=model_config().max_model_len,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True,
                                 mamba_cache_mode=mamba_cache_mode or "none"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy=policy, kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    if mamba_cache_mode is not None:
        from vllm.v1.kv_cache_interface import MambaSpec

        groups.append(KVCacheGroupSpec(["model.layers.2.mixer"], MambaSpec(
            block_size=BLOCK_SIZE, shapes=((3, 8),), dtypes=(torch.float32,),
            mamba_cache_mode=mamba_cache_mode)))
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return cfg, kvc


def _connector(policy: str = "recompute", extra: dict[str, Any] | None = None,
               mamba_cache_mode: str | None = None) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.vllm.connector import KvtierConnector

    cfg, kvc = _configs(policy, extra or {}, mamba_cache_mode)
    return KvtierConnector(cfg, KVConnectorRole.SCHEDULER, kvc)


def test_refuses_a_failure_policy_other_than_recompute() -> None:
    with pytest.raises(ValueError, match="kv_load_failure_policy='recompute'"):
        _connector("fail")


def test_starts_with_fail_policy_when_told_to() -> None:
    c = _connector("fail", {"allow_fail_policy": "true"})
    assert c.config.allow_fail_policy


def test_bad_settings_are_start_up_errors_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="dram_size"):
        _connector(extra={"dram_sise": "1GiB"})
    with pytest.raises(ValueError, match="GiB"):
        _connector(extra={"dram_size": "64"})


def test_start_up_refusals_are_one_kvtier_line() -> None:
    from kvtier.vllm.startup import StartupError

    for policy, extra in (("fail", {}), ("recompute", {"dram_sise": "1GiB"})):
        with pytest.raises(StartupError) as info:
            _connector(policy, extra)
        line = str(info.value)
        assert line.startswith("kvtier: ") and "\n" not in line and "; " in line, line
    assert str(info.value) == ("kvtier: unknown kvtier setting 'dram_sise': did you mean "
                               "'dram_size'?; `kvtier config` lists every setting")


def test_a_recurrent_state_group_starts_with_states_kept_per_block() -> None:
    """'align' (0.32 has no 'all'; 0.25.1's 'all': tests/test_vllm025_multigroup_loads.py)."""
    c = _connector(mamba_cache_mode="align")
    assert c.setup.disabled_reason is None and c.setup.loads_enabled


def test_a_recurrent_state_group_without_per_block_states_is_refused_naming_prefix_caching(
        ) -> None:
    from kvtier.vllm.startup import StartupError

    with pytest.raises(StartupError) as info:
        _connector(mamba_cache_mode="none")
    line = str(info.value)
    assert line.startswith("kvtier: mamba_cache_mode='none'") and "\n" not in line, line
    assert "--enable-prefix-caching" in line


QUIET_DEFAULT_HOOKS = (
    "bind_connector_metadata", "build_connector_worker_meta", "get_block_ids_with_load_errors",
    "get_finished", "get_kv_connector_stats", "get_loaded_kv_cache_group_ids",
    "get_transfer_results", "handle_preemptions", "has_pending_push_work", "on_new_request",
    "register_kv_caches", "request_finished", "reset_cache", "shutdown",
    "update_connector_output",
)


def test_what_it_declares_to_vllm() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    c = _connector()
    assert isinstance(c, SupportsHMA)
    assert c.requires_kv_delivery is False
    assert type(c).get_required_kvcache_layout(None) is None  # any layout
    # the hooks whose base versions are silent defaults (no fence, no failed blocks, nothing
    # finished, no stats, ...): inheriting one would drop that part of the protocol quietly
    inherited = [n for n in QUIET_DEFAULT_HOOKS
                 if getattr(type(c), n) is getattr(KVConnectorBase_V1, n)]
    assert not inherited, f"kvtier inherits vLLM's default of {inherited}"
    # until the workers' layout handshake, lookups ask again and the engine keeps stepping
    class _Req:
        request_id = "r1"
        skip_reading_prefix_cache = False

    c.on_new_request(_Req())
    assert c.get_num_new_matched_tokens(_Req(), 0) == (None, False)
    assert c.has_pending_push_work()


def test_the_plugin_registers_the_short_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier.vllm.plugin import SHORT_NAME, register

    register()
    register()  # idempotent: every vLLM process runs the plugins
    cls = KVConnectorFactory._registry[SHORT_NAME]()
    assert cls.__name__ == "KvtierConnector"

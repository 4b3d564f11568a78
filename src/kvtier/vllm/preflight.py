"""What ``kvtier serve`` can know about kvtier's start-up before vLLM starts.

The connector refuses these once vLLM is starting (:mod:`kvtier.vllm.startup`), after the
model is loaded; checked on the command line they cost nothing and start nothing.

Contract: :func:`check_engine` takes the server's arguments as vLLM's parser read them and, if
the KV connector is kvtier's, raises :class:`ConfigError` with one line ``<what is wrong>;
<what to do>`` for the first of:
- kvtier's settings (``kv_connector_extra_config`` and ``KVTIER_*``, as the connector loads
  them);
- a ``kv_load_failure_policy`` the connector refuses;
and, unless pipeline parallelism turns kvtier off (it then allocates nothing):
- ``chunk_tokens`` that is not a multiple of ``--block-size``, when both are given (the block
  size of the attention groups; where a platform overrides the flag, the connector checks the
  block size vLLM picked);
- with tensor parallelism, a ``dram_size`` larger than the free space of ``/dev/shm``, where the ranks share the store;
- a ``dram_size`` above what this host and cgroup can give (:func:`hostmem.check_dram_size`;
  the server runs in this process's cgroup).
Anything else is the connector's to refuse.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvtier.config import ConfigError, KvtierConfig, format_bytes
from kvtier.geometry import resolve_chunk_tokens
from kvtier.hostmem import check_dram_size
from kvtier.vllm.plugin import SHORT_NAME
from kvtier.vllm.startup import failure_policy_refusal

SHM_DIR = "/dev/shm"
CONNECTOR_CLASS = "KvtierConnector"


def _field(ktc: Any, name: str, default: Any = None) -> Any:
    if isinstance(ktc, Mapping):
        return ktc.get(name, default)
    return getattr(ktc, name, default)


def is_kvtier(ktc: Any) -> bool:
    """Does this ``--kv-transfer-config`` name kvtier's connector (or one of its modules)?"""
    if ktc is None:
        return False
    name = str(_field(ktc, "kv_connector") or "")
    module = str(_field(ktc, "kv_connector_module_path") or "")
    return name in (SHORT_NAME, CONNECTOR_CLASS) or module.startswith("kvtier.")


def check_engine(ktc: Any, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 block_size: int | None = None, shm_dir: str = SHM_DIR) -> None:
    """Raise ConfigError (one line) for what kvtier's connector would refuse at start-up."""
    if not is_kvtier(ktc):
        return
    config = KvtierConfig.load(dict(_field(ktc, "kv_connector_extra_config") or {}))
    # vLLM's own default is 'fail': a config that does not say is refused too
    refusal = failure_policy_refusal(str(_field(ktc, "kv_load_failure_policy", "fail")),
                                     config.allow_fail_policy)
    if refusal is not None:
        raise ConfigError("; ".join(refusal))
    if int(pipeline_parallel_size) > 1:
        return  # the connector turns itself off: it allocates nothing
    if config.chunk_tokens is not None and block_size:
        resolve_chunk_tokens(config.chunk_tokens, [int(block_size)])
    if int(tensor_parallel_size) > 1:
        check_shm(config.dram_size, int(tensor_parallel_size), shm_dir)
    check_dram_size(config.dram_size)


def check_shm(dram_size: int, tensor_parallel_size: int, shm_dir: str = SHM_DIR) -> None:
    """Raise ConfigError if ``shm_dir`` cannot hold a store of ``dram_size``."""
    try:
        st = os.statvfs(shm_dir)
    except OSError as e:
        raise ConfigError(f"with --tensor-parallel-size {tensor_parallel_size} kvtier keeps its "
                          f"store in {shm_dir}, which cannot be used ({e.strerror}); mount a "
                          "shared-memory filesystem there (docker --ipc=host or --shm-size)"
                          ) from None
    free = st.f_bavail * st.f_frsize
    if free < dram_size:
        raise ConfigError(
            f"{shm_dir} has {format_bytes(free)} free, and with --tensor-parallel-size "
            f"{tensor_parallel_size} kvtier keeps its store of dram_size "
            f"{format_bytes(dram_size)} there; enlarge {shm_dir} (docker --shm-size, or "
            "--ipc=host) or lower dram_size")

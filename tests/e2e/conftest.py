"""Shared set-up for tests that run a real vLLM engine on the CPU build.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless a test says otherwise,
so checks can reach the scheduler half, the worker half and vLLM's own tensors directly.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROBE = {"kv_connector": "ProbeConnector", "kv_connector_module_path": "kvtier.testing.probe"}


def _uses_mla(model: str) -> bool:
    """Whether the model folder's config is an MLA model (DeepSeek-style ``kv_lora_rank``)."""
    config = Path(model) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("kv_lora_rank") is not None


def make_llm(model: str, extra: dict[str, Any] | None = None, **kw: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args: dict[str, Any] = dict(
        load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        max_model_len=4096, max_num_seqs=4, block_size=32, seed=0,
    )
    args.update(kw)
    if _uses_mla(model):
        # vLLM's reference CPU MLA backend on every CPU: on CPUs with AMX, vLLM 0.32 picks
        # AMX_MLA, which takes bfloat16 weights only ("expect weight to be bfloat16, ...":
        # these tiny models are float32) and keeps prefix caching on; asked for by name,
        # CPU_MLA runs everywhere the same way (prefix caching off for MLA, 16-token blocks).
        # A draft model does not inherit the target's backend: its config asks too.
        args.setdefault("attention_config", {"backend": "CPU_MLA"})
        if args.get("speculative_config") is not None:
            args["speculative_config"] = {"attention_backend": "CPU_MLA",
                                          **args["speculative_config"]}
    # cost_model off: these tests check that every whole chunk is restored bit-exactly, and the
    # load-or-recompute estimate (measured link and prefill speed) may decline a one-chunk hit
    # on a busy CPU; the cost model has its own tests (tests/test_planner.py)
    settings = {"dram_size": "128MiB", "cost_model": False, **(extra or {})}
    ktc = KVTransferConfig(**PROBE, kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config=settings)
    return LLM(model=model, kv_transfer_config=ktc, **args)


def greedy(max_tokens: int = 8, logprobs: int = 5) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          temperature=0.0, logprobs=logprobs)


def prompt(n: int, seed: int = 0, vocab: int = 1000) -> list[int]:
    """A deterministic token prompt of length ``n``."""
    return [(seed * 7919 + 31 * i + (i * i) % 97) % vocab + 3 for i in range(n)]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtier.testing.models import tiny_llama

    return tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def shutdown(llm: Any) -> None:
    """Stop an in-process engine and drop vLLM's process-global connector, so that the next
    engine in this process gets connectors of its own."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def shutdown_after() -> Iterator[list[Any]]:
    """Engines a module shares; stopped when the module ends."""
    engines: list[Any] = []
    yield engines
    for llm in engines:
        shutdown(llm)


@pytest.fixture
def shutdown_now() -> Iterator[list[Any]]:
    """Engines of one test; stopped when the test ends."""
    engines: list[Any] = []
    yield engines
    for llm in engines:
        shutdown(llm)

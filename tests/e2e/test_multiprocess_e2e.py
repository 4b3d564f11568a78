"""The serving path: EngineCore and the worker in their own processes, kvtier's metadata and
reports pickled between them, the connector found by its short name through vLLM's plugin
entry point; and a load that fails in the worker process, through the test connector of
``tests/e2e/faulty_connector.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import greedy, prompt, shutdown

pytestmark = pytest.mark.e2e


def test_restore_across_processes(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test-only rpc below
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.testing.probe import fill_worker_kv_caches
    from kvtier.testing.restore import sharpen_worker_weights

    llm = LLM(model=tiny_llama_dir, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, dtype="float32", max_model_len=4096, max_num_seqs=4,
              block_size=32, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="kvtier", kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"dram_size": "64MiB"}))
    try:
        assert llm.collective_rpc(sharpen_worker_weights)[0] > 0
        p = {"prompt_token_ids": prompt(4 * 256 + 5, seed=99)}
        params = greedy()
        a = llm.generate([p], params, use_tqdm=False)[0]
        c = llm.generate([p], params, use_tqdm=False)[0]  # vLLM's prefix cache
        assert c.num_cached_tokens == 4 * 256
        llm.reset_prefix_cache()
        filled: list[Any] = llm.collective_rpc(fill_worker_kv_caches)
        assert filled and filled[0] > 0
        b = llm.generate([p], params, use_tqdm=False)[0]
        assert b.num_cached_tokens == 4 * 256  # all of it from kvtier
        assert list(b.outputs[0].token_ids) == list(c.outputs[0].token_ids)
        assert b.outputs[0].logprobs == c.outputs[0].logprobs
        assert list(a.outputs[0].token_ids) == list(c.outputs[0].token_ids)
    finally:
        shutdown(llm)


def test_a_load_that_fails_in_a_worker_process_recomputes(
        tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.e2e.faulty_connector import FAULTS_ENV, rpc_faults

    root = str(Path(__file__).resolve().parents[2])  # tests.e2e must import in the workers
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test-only rpcs below
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"fail_loads": 1}))
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.testing.probe import fill_worker_kv_caches
    from kvtier.testing.restore import sharpen_worker_weights

    llm = LLM(model=tiny_llama_dir, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, dtype="float32", max_model_len=4096, max_num_seqs=4,
              block_size=32, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="FaultyConnector",
                  kv_connector_module_path="tests.e2e.faulty_connector",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"dram_size": "64MiB"}))
    try:
        assert llm.collective_rpc(sharpen_worker_weights)[0] > 0
        p = {"prompt_token_ids": prompt(3 * 256 + 5, seed=98)}
        params = greedy()
        llm.generate([p], params, use_tqdm=False)  # computed and saved
        c = llm.generate([p], params, use_tqdm=False)[0]  # vLLM's prefix cache
        outputs = []
        for _ in range(2):  # the first restore fails (and is recomputed), the second loads
            llm.reset_prefix_cache()
            assert llm.collective_rpc(fill_worker_kv_caches)[0] > 0
            outputs.append(llm.generate([p], params, use_tqdm=False)[0])
        (faults,) = llm.collective_rpc(rpc_faults)
        assert faults["injected"] == 1 and faults["fail_loads"] == 0, faults
        for b in outputs:
            assert list(b.outputs[0].token_ids) == list(c.outputs[0].token_ids)
            assert b.outputs[0].logprobs == c.outputs[0].logprobs
        assert outputs[1].num_cached_tokens == 3 * 256  # from kvtier
    finally:
        shutdown(llm)

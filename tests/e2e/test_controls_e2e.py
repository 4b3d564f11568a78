"""The restore check's byte-level negative controls (kvtier.testing.controls) through the probe
connector of a real vLLM CPU engine: with one layer's bytes left unrestored (what "the draft
layers not restored" and "the indexer cache skipped" do on the GPU families) the check
fails on its byte comparison, and with the mask off again it passes."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.testing.controls import draft_layers, rpc_mask_loads
from kvtier.testing.restore import handles, restore_check, sharpen_dummy_weights
from tests.e2e.conftest import greedy, make_llm, prompt

pytestmark = pytest.mark.e2e

C = 256


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str, shutdown_after: list[Any]) -> Any:
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=160)
    shutdown_after.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    return h


def test_a_layer_left_unrestored_fails_the_byte_comparison(engine: Any) -> None:
    names = sorted(engine.worker_connector.vllm_kv_caches)
    last = draft_layers(names, num_target_layers=1)  # the last of two layers stands in
    assert last == ["model.layers.1.self_attn.attn"]
    (masked,) = engine.llm.collective_rpc(rpc_mask_loads, args=("layers", last))
    kv = engine.worker_connector.vllm_kv_caches[last[0]]
    assert masked == kv.numel() * kv.element_size()  # every byte of that layer's cache
    try:
        res = restore_check(engine, [prompt(2 * C + 5, seed=51)], greedy())
    finally:
        engine.llm.collective_rpc(rpc_mask_loads, args=(None, []))
        engine.llm.reset_prefix_cache()  # HBM now caches the unrestored blocks
    (p,) = res.prompts
    assert res.restored_tokens == res.expected_restored > 0  # the load "succeeded"...
    assert res.loads_failed == 0
    assert not p.checksums_equal  # ...but one layer's blocks hold the fill pattern
    assert engine.worker_connector.load_controls.masked > 0
    # the mask off again: the same check passes on a new prompt
    res = restore_check(engine, [prompt(2 * C + 5, seed=52)], greedy())
    assert res.passed, res

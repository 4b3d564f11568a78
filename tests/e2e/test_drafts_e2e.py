"""Speculative decoding with an MTP draft on vLLM 0.32's CPU build (issue 14): a tiny
DeepSeek-V3 with one MTP layer (``num_nextn_predict_layers`` 1) serving as its own draft, 3
speculative tokens. vLLM registers the draft layer (``model.layers.2``) in the target's MLA
group, so the restore check's byte comparison covers its blocks.

vLLM 0.32's reference CPU MLA backend (``make_llm`` asks for ``CPU_MLA``: AMX's takes
bfloat16 weights only) runs without prefix caching for MLA models (``platforms/cpu.py``): run
C of the restore check is then a full recompute, not an HBM hit at the same boundary; kvtier's
restores are unaffected (the connector is asked either way).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.testing.controls import draft_layers, layer_bytes, rpc_mask_draft_layers
from kvtier.testing.models import tiny_deepseek_v3_mtp
from kvtier.testing.restore import handles, restore_check, sharpen_dummy_weights
from tests.e2e.conftest import greedy, make_llm, prompt

pytestmark = pytest.mark.e2e

C = 256
TARGET_LAYERS = 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, shutdown_after: list[Any]) -> Any:
    model = tiny_deepseek_v3_mtp(str(tmp_path_factory.mktemp("dsv3-mtp")), TARGET_LAYERS)
    llm = make_llm(model, max_model_len=2048, num_gpu_blocks_override=256,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    shutdown_after.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    return h


def _drafts(engine: Any) -> list[str]:
    return draft_layers(engine.worker_connector.vllm_kv_caches, TARGET_LAYERS)


def test_the_draft_layer_is_in_the_group_and_chunk_keys_look_ahead(engine: Any) -> None:
    assert _drafts(engine) == ["model.layers.2.self_attn.attn"]
    (group,) = engine.scheduler_connector.groups.specs
    assert "model.layers.2.self_attn.attn" in group.layer_names
    assert engine.kvtier.draft_lookahead == 1


def test_two_prompts_sharing_a_chunk_and_differing_right_after_it(engine: Any) -> None:
    # Both computed in one batch, then both restored: each must get its own chunk 0, whose
    # last position's draft KV was computed with its own token 256.
    shared = prompt(C, seed=61)
    a, b = shared + prompt(C + 5, seed=62), shared + prompt(C + 5, seed=63)
    assert a[C] != b[C]
    res = restore_check(engine, [a, b], greedy())
    assert res.restored_tokens == res.expected_restored == 2 * 2 * C, res
    for p in res.prompts:
        assert p.checksums_equal, "a restored block (draft layer included) differs from run A"
        assert p.tokens_equal and p.logprobs_equal, (p.tokens_b, p.tokens_c)
    assert res.loads_failed == 0


def test_negative_control_draft_layers_not_restored_fails_the_check(engine: Any) -> None:
    # the worker picks its draft layers itself (the control the H200 tool uses), the same
    # bytes as the driver's choice
    want = layer_bytes(engine.worker_connector.vllm_kv_caches, _drafts(engine)).count()
    (masked,) = engine.llm.collective_rpc(rpc_mask_draft_layers)
    assert masked == want > 0
    try:
        res = restore_check(engine, [prompt(2 * C + 5, seed=64)], greedy())
    finally:
        assert engine.llm.collective_rpc(rpc_mask_draft_layers, args=(False,)) == [0]
        engine.llm.reset_prefix_cache()
    (p,) = res.prompts
    assert res.restored_tokens == res.expected_restored > 0  # the load "succeeded"...
    assert not p.checksums_equal  # ...but the draft layer's blocks hold the fill pattern

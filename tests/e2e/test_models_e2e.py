"""The restore check on other model families vLLM's CPU build runs: MLA (a 2-layer
DeepSeek-V2-Lite-shaped model) and alternating sliding-window / full attention (two
KV-cache groups, checksums per group)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.testing.models import tiny_deepseek_v2, tiny_gemma2
from kvtier.testing.restore import handles, restore_check, sharpen_dummy_weights
from tests.e2e.conftest import greedy, make_llm, prompt

pytestmark = pytest.mark.e2e


def _run(model_dir: str, shutdown_now: list[Any], prompts: list[list[int]]) -> Any:
    llm = make_llm(model_dir, max_model_len=2048, num_gpu_blocks_override=256)
    shutdown_now.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    res = restore_check(h, prompts, greedy())
    assert res.restored_tokens == res.expected_restored > 0, res
    for p in res.prompts:
        assert p.checksums_equal and p.tokens_equal and p.logprobs_equal, p
    return h


def test_mla_deepseek_v2_lite_shape(tmp_path: Any, shutdown_now: list[Any]) -> None:
    h = _run(tiny_deepseek_v2(str(tmp_path / "dsv2")), shutdown_now,
             [prompt(3 * 256 + 5, seed=3)])
    layout = h.worker_connector.worker_side.worker.layout
    (group,) = layout.groups
    # MLA's latent rows: 576 values per token, one segment per layer (merged or not)
    assert group.bytes_per_block == 2 * group.spec.block_size * 576 * 4


def test_sliding_window_beside_full_attention(tmp_path: Any, shutdown_now: list[Any]) -> None:
    h = _run(tiny_gemma2(str(tmp_path / "gemma2")), shutdown_now,
             [prompt(3 * 256 + 5, seed=4), prompt(5 * 256 + 9, seed=5)])
    kinds = [g.kind for g in h.scheduler_connector.groups.specs]
    assert sorted(k.value for k in kinds) == ["full", "sliding_window"]
